"""The demo run (run.py) and its tiny Flux2-shaped DiT (tiny_dit.py, tiny_weights.py), for `./scripts/demo` and the tests."""

from ..moved import forward

__getattr__ = forward(__name__, "demo")  # the old trainer/demo.py's names, one release
