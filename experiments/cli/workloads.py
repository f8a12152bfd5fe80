"""`workloads`: every workload and its knobs, with the defaults `run`, `compare` and `sweep` use."""

from __future__ import annotations

import argparse

from experiments.cli.args import command_knobs
from experiments.workloads.registry import describe_workloads


def add_parser(sub: argparse._SubParsersAction) -> None:
    wl = sub.add_parser("workloads", help="list the workloads and their knobs, with the defaults the commands use")
    wl.set_defaults(func=cmd_workloads)


def cmd_workloads(args: argparse.Namespace) -> int:
    for name, info in describe_workloads().items():
        print(f"{name}: {info['summary']}")
        ours = command_knobs(name)
        for knob, default in info["knobs"].items():
            # the value a command runs with; the generator's own default beside it when they differ
            shown = f"{ours[knob]!r}  (generator: {default!r})" if knob in ours else repr(default)
            print(f"    {knob} = {shown}  {info['help'].get(knob, '')}")
    return 0
