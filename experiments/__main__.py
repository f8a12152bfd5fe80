"""`python -m experiments ...`: the command line (experiments/cli/)."""

from __future__ import annotations

import sys

from experiments.cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
