"""A run's configuration as a TOML file: `--config exp.toml` reads one, and every run writes
the one it resolved (`config.toml` in its output folder, and `run_config` in results.json,
which the report shows), so a run can be repeated from its output alone.

The file's keys are the command's options, named as the Python API names them (the flag
without its dashes, `-` as `_`: `capacity_tokens`, `page_size`, `eviction_policy`), with
TOML values: a string, number or boolean, or a list of them for an option that takes
several; `knobs` is a table of workload knobs; `command` (optional) names the command and
must agree with the one run. Unknown keys are an error naming the valid ones. A flag given
on the command line beside `--config` wins over the file (it is parsed after it; options
that collect, `--backend` and `--knob`, add to the file's).

TOML is read with the standard library (`tomllib`, Python 3.11+; on 3.10 the `tomli`
package) and written here (a TOML writer is not in the standard library), for the value
types above only.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.errors import InputError

#: dests that are not options a file may set: the command, the function, the recorded argv
NOT_OPTIONS = frozenset({"help", "func", "command", "argv", "config"})
CONFIG_FILE = "config.toml"
CONFIG_HEADER = (
    "The configuration this run resolved: every option at the value it ran with.\n"
    f"Repeat it with: python -m experiments --config {CONFIG_FILE} (flags given beside it win)"
)


class ConfigFileError(InputError):
    """A config file that cannot be read, or a key or value the command does not take."""


def read_toml(path: str | Path) -> dict[str, Any]:
    """The parsed file; a `ConfigFileError` naming it when missing or not TOML."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigFileError("--config needs Python 3.11+ (tomllib) or the tomli package on 3.10") from None
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigFileError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path}: not valid TOML ({exc})") from None


def options_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> action of every option a file or the API may set."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in NOT_OPTIONS}


def to_argv(parser: argparse.ArgumentParser, values: Mapping[str, Any], source: str) -> list[str]:
    """Command-line arguments that set `values` (option dest -> value, `knobs` a mapping) on
    `parser`'s command; `source` names where they came from in errors."""
    actions = options_of(parser)
    argv: list[str] = []
    for key, value in values.items():
        if key == "knobs":
            argv += _knob_args(value, source)
            continue
        action = actions.get(key)
        if action is None:
            raise ConfigFileError(
                f"{source}: {parser.prog} has no option {key!r}; its options: {', '.join(actions)}, knobs"
            )
        argv += _option_args(action, value, f"{source}: {key}")
    return argv


def _knob_args(knobs: Any, source: str) -> list[str]:
    if not isinstance(knobs, Mapping):
        raise ConfigFileError(f"{source}: knobs must be a table of NAME = VALUE, got {type(knobs).__name__}")
    out = []
    for name, value in knobs.items():
        if value is None:
            continue
        out.append(f"--knob={name}={_text(value, f'{source}: knobs.{name}')}")
    return out


def _option_args(action: argparse.Action, value: Any, where: str) -> list[str]:
    flag = action.option_strings[-1]
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where} is true or false, got {value!r}")
        return [flag] if value else []
    if value is None:
        return []
    many = action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not many and len(items) != 1:
        raise ConfigFileError(f"{where} takes one value, got {len(items)}")
    if not items:
        return []
    if isinstance(action, argparse._AppendAction):
        return [f"{flag}={_text(v, where)}" for v in items]
    return [flag, *(_text(v, where) for v in items)]


def _text(value: Any, where: str) -> str:
    """A TOML value as the command line writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return ",".join(str(v) for v in value)  # a tuple knob: "65,65"
    raise ConfigFileError(f"{where}: expected a string, number or boolean, got {type(value).__name__} {value!r}")


def dump_toml(values: Mapping[str, Any], header: str = "") -> str:
    """`values` (scalars, lists of scalars, and one level of tables) as TOML text."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    tables = {k: v for k, v in values.items() if isinstance(v, Mapping)}
    for key, value in values.items():
        if value is not None and not isinstance(value, Mapping):
            lines.append(f"{_key(key)} = {_value(value)}")
    for name, table in tables.items():
        lines += ["", f"[{_key(name)}]"]
        lines += [f"{_key(k)} = {_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            raise ValueError("TOML has no NaN setting here")
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string: the same escapes
    if isinstance(value, Sequence):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the `--config` path, if any, and argv without it)."""
    rest: list[str] = []
    path = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def expand_config(argv: list[str], commands: Mapping[str, argparse.ArgumentParser]) -> list[str]:
    """`argv` with a `--config FILE`'s settings put in, right after the command so that the
    flags given on the command line come later and win. Without a command, the file's
    `command` names it."""
    path, rest = split_config(argv)
    if path is None:
        return argv
    values = dict(read_toml(path))
    named = values.pop("command", None)
    command = rest[0] if rest and rest[0] in commands else None
    if command is None:
        if named is None:
            raise ConfigFileError(
                f"{path}: name the command (compare, run, sweep, replay) or set command = ... in the file"
            )
        if named not in commands:
            raise ConfigFileError(f"{path}: unknown command {named!r}; one of: {', '.join(commands)}")
        command, rest = named, [named, *rest]
    elif named is not None and named != command:
        raise ConfigFileError(f"{path} is a config for {named!r}, not {command!r}")
    return [command, f"--config={path}", *to_argv(commands[command], values, str(path)), *rest[1:]]


def write_config(settings: Mapping[str, Any], out_dir: Path) -> Path:
    """`config.toml` in `out_dir` (a run's staging folder): the settings a run resolved."""
    path = Path(out_dir) / CONFIG_FILE
    path.write_text(dump_toml(settings, CONFIG_HEADER))
    return path
