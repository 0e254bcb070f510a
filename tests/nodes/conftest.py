"""The node tests import their helpers by module name (comfy_env from tests/; tiny_comfy, comfy_server and
test_nodes from here): both folders go on sys.path once, before any node test module is collected."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent, HERE):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
