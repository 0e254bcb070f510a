"""Command line: python -m trainer {demo, train, check-dataset, caption, cache, estimate, export, convert,
inspect, merge, resize, extract}. Run with --help. The parser is parser.py; the commands live in train.py,
estimate.py, commands.py and lora_commands.py."""

from __future__ import annotations

import sys

from .pack import PACK, import_pack  # noqa: F401  (their old import path)
from .pack import headless as _headless  # noqa: F401  (its old import path, for tests)
from .parser import build_parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as err:  # OSError: a full disk, a folder where a file goes
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
