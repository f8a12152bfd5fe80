"""`workloads`: every workload and its knobs."""

from __future__ import annotations

import argparse

from experiments.workloads.registry import describe_workloads


def add_parser(sub: argparse._SubParsersAction) -> None:
    wl = sub.add_parser("workloads", help="list the workloads and their knobs")
    wl.set_defaults(func=cmd_workloads)


def cmd_workloads(args: argparse.Namespace) -> int:
    for name, info in describe_workloads().items():
        print(f"{name}: {info['summary']}")
        for knob, default in info["knobs"].items():
            print(f"    {knob} = {default!r}  {info['help'].get(knob, '')}")
    return 0
