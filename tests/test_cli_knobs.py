"""`--knob K=V` changes K alone: the main command's workload defaults (experiments/runs/defaults.py
`COMMAND_KNOBS`) stay, and `workloads` prints the defaults the commands run with."""

from __future__ import annotations

from experiments.cli.args import knobs
from experiments.cli.main import build_parser, main
from experiments.runs import defaults
from experiments.runs.runner import build_workload


def _knobs(*argv: str) -> dict:
    return knobs(build_parser().parse_args(["compare", *argv]))


def test_a_knob_keeps_the_commands_defaults():
    got = _knobs("--knob", "zipf_a=1.2")
    assert got == {**defaults.WORKLOAD_KNOBS, "zipf_a": "1.2"}
    assert got["num_documents"] == 100 and got["num_requests"] == 1000


def test_a_knob_replaces_a_default():
    assert _knobs("--knob", "num_requests=7")["num_requests"] == "7"
    assert _knobs()["num_requests"] == defaults.WORKLOAD_KNOBS["num_requests"]


def test_the_built_workload_has_the_commands_size():
    from experiments.runs.runner import CellConfig

    cfg = CellConfig("apc", defaults.WORKLOAD, 20000, knobs=_knobs("--knob", "zipf_a=1.2"))
    wl = build_workload(cfg)
    assert len(wl.requests) == defaults.WORKLOAD_KNOBS["num_requests"]
    assert wl.config["zipf_a"] == 1.2 and wl.config["num_documents"] == 100


def test_another_workload_gets_its_generator_defaults_only():
    assert _knobs("--workload", "no_sharing", "--knob", "num_requests=3") == {"num_requests": "3"}


def test_workloads_prints_the_commands_defaults(capsys):
    assert main(["workloads"]) == 0
    out = capsys.readouterr().out
    block = out.split("shared_doc_qa:")[1].splitlines()[1:]
    block = block[: next(i for i, line in enumerate(block) if not line.startswith(" "))]
    lines = {line.split("=")[0].strip(): line for line in block}
    assert lines["num_documents"].split("=")[1].split()[0] == "100"
    assert "(generator: 20)" in lines["num_documents"]
    assert lines["num_requests"].split("=")[1].split()[0] == "1000"
