"""`python -m trainer ...`: the command line (trainer/cli/main.py)."""

from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
