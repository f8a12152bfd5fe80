"""The errors a user is told about in one line, and their exit codes (README, Commands).

`UsageError` (exit 2) is a missing or malformed option; `InputError` (exit 3) is bad input
(an unknown name, a file that is missing or malformed, a capacity too small, an output that
cannot be written). Anything else that escapes a command is a bug and shows its traceback.
"""

from __future__ import annotations

EXIT_CELL_FAILED = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


class UsageError(Exception):
    """A missing or malformed option: one line for the user, exit code 2 (as argparse)."""


class InputError(Exception):
    """Bad input: one line for the user, exit code 3."""
