"""Command line: `python -m experiments replay|run|compare|sweep|report|workloads|predict-step ...`.

Exit codes: 0 success; 1 a cell failed (its process was killed, e.g. out of memory, or it
raised an unexpected error; finished cells are kept for a rerun); 2 bad usage (a missing or
malformed option); 3 bad input (unknown backend, option, workload or knob, a trace that does
not exist or cannot be parsed, a capacity smaller than one request or that schedules
nothing, an output that cannot be written or is in use by another run); 130 interrupted
(Ctrl-C or SIGTERM: outputs are left complete or unchanged). Only those errors are one line;
anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
import textwrap

from cachelib.errors import CacheError
from experiments.cli import compare, predict, replay, report, sweep, workloads
from experiments.errors import (
    EXIT_BAD_INPUT,
    EXIT_CELL_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    InputError,
    UsageError,
)
from experiments.runs.cell_pool import TasksFailed
from experiments.runs.run_config import ConfigFileError, expand_config
from experiments.workloads.registry import WorkloadError
from experiments.workloads.spec import TraceFormatError

#: bad input, raised in this process or in a cell: one line, exit 3. A cell refuses a
#: setting it does not run (e.g. beam search under serving) with a `runner.ConfigError`, an
#: `InputError`; any other error inside a cell (a bare ValueError, a CacheError) is a bug
INPUT_ERRORS = (InputError, WorkloadError, TraceFormatError)


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The command line's parser; `parser_class` (the commands' parsers too) lets the Python
    API (experiments/api.py) raise on bad usage instead of exiting."""
    parser = parser_class(prog="python -m experiments", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    compare.add_parsers(sub)
    sweep.add_parser(sub)
    report.add_parser(sub)
    workloads.add_parser(sub)
    replay.add_parser(sub)
    predict.add_parser(sub)
    for command in (parser, *commands(parser).values()):
        command.formatter_class = ShowDefaults
    return parser


class ShowDefaults(argparse.HelpFormatter):
    """Help that ends each option with its default, unless the text already says it or the
    option is unset by default (None, off, an empty list: the text says what unset means);
    lines never break inside an option's name (`--step-ms`)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == [] or default is argparse.SUPPRESS
        if unset or "default" in text or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})"


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Command name -> its parser."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    given = sys.argv[1:] if argv is None else list(argv)
    try:
        expanded = expand_config(given, commands(parser))
    except ConfigFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args = parser.parse_args(expanded)
    args.argv = argv  # None: the report records sys.argv
    # SIGTERM ends a run the way Ctrl-C does: temporary outputs removed, children killed
    previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted: outputs were left complete or unchanged, never half-written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as exc:
        print(f"usage error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TasksFailed as exc:
        return _cells_failed(exc)
    except INPUT_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        signal.signal(signal.SIGTERM, previous_term)


def _is_input_error(error: BaseException | None) -> bool:
    return isinstance(error, INPUT_ERRORS) and not isinstance(error, CacheError)


def _cells_failed(exc: TasksFailed) -> int:
    """One line naming each failed cell; the traceback of each that is a bug."""
    for failure in exc.failures:
        if failure.error is not None and failure.trace and not _is_input_error(failure.error):
            print(failure.trace.rstrip(), file=sys.stderr)
    print(f"error: {exc}", file=sys.stderr)
    if all(_is_input_error(f.error) for f in exc.failures):
        return EXIT_BAD_INPUT
    return EXIT_CELL_FAILED


def run_cli() -> None:
    """The `prefix-cache-lab` console script (pyproject.toml): `main` on sys.argv, its exit code."""
    sys.exit(main())
