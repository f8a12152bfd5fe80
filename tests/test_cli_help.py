"""Every option of every command has help text, and the help shows each default that is set
(an option unset by default says in its text what unset means)."""

from __future__ import annotations

import argparse

import pytest

from experiments.cli.main import build_parser, commands

PARSER = build_parser()


def _options():
    for name, sub in commands(PARSER).items():
        for action in sub._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                yield name, action


@pytest.mark.parametrize(("command", "action"), list(_options()), ids=lambda x: getattr(x, "dest", x))
def test_every_option_has_help_and_shows_its_default(command, action):
    assert action.help and action.help.strip(), f"{command} {action.option_strings[0]} has no help"
    sub = commands(PARSER)[command]
    entry = sub.formatter_class(sub.prog)._expand_help(action)  # the text `--help` prints for it
    default = action.default
    if default is None or default is False or default == []:
        return
    shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
    assert shown in entry, f"{command} {action.option_strings[0]}: default {shown!r} not shown in {entry!r}"


def test_no_help_points_outside_the_package():
    for sub in (PARSER, *commands(PARSER).values()):
        text = sub.format_help()
        assert "../shared" not in text and "DESIGN" not in text


def test_the_console_script_is_the_command_line():
    import importlib
    import subprocess
    import sys
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[1]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["prefix-cache-lab"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    code = f"import sys; sys.argv = ['prefix-cache-lab', 'workloads']; from {module} import {name}; {name}()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert done.returncode == 0 and "shared_doc_qa:" in done.stdout
