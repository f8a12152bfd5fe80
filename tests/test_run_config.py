"""`--config exp.toml`: a TOML file of options; every run writes the config it resolved
(OUT/config.toml, results.json's run_config, the report's Configuration section), and that
file repeats the run."""

from __future__ import annotations

import json
import math

import pytest
import tomllib

from experiments.cli.main import build_parser, commands, main
from experiments.runs.run_config import ConfigFileError, dump_toml, expand_config

FAST = """\
command = "compare"
workload = "no_sharing"
backend = ["apc", "radix[eviction_policy=lfu]"]
capacity_tokens = [20000]
protocol = "replay"
no_bounds = true
no_progress = true

[knobs]
num_requests = 6
"""


def _numbers(doc: dict) -> list:
    return [(c["config"]["backend"], c["config"]["backend_options"], c["replay"]["hit_rate"], c["replay"]["requests"])
            for c in doc["cells"]]  # fmt: skip


def test_a_config_file_runs_and_its_resolved_config_repeats_the_run(tmp_path):
    exp = tmp_path / "exp.toml"
    exp.write_text(FAST)
    first, second = tmp_path / "a", tmp_path / "b"
    assert main(["--config", str(exp), "--output-dir", str(first)]) == 0
    resolved = tomllib.loads((first / "config.toml").read_text())
    doc = json.loads((first / "results.json").read_text())
    assert doc["run_config"] == resolved  # the same settings, two places
    assert resolved["knobs"] == {"num_requests": 6}  # typed
    assert resolved["backend"] == ["apc", "radix[eviction_policy=lfu]"] and resolved["page_size"] == 16
    assert "## Configuration" in (first / "report.md").read_text()
    assert doc["cells"][0]["replay"]["requests"] == 6
    # the resolved file alone repeats the run (the output folder given anew)
    assert main(["--config", str(first / "config.toml"), "--output-dir", str(second)]) == 0
    again = json.loads((second / "results.json").read_text())
    assert _numbers(again) == _numbers(doc)
    assert {k: v for k, v in again["run_config"].items() if k != "output_dir"} == {
        k: v for k, v in resolved.items() if k != "output_dir"
    }


def test_the_default_run_resolves_every_default(tmp_path):
    parser = build_parser()
    args = parser.parse_args(expand_config(["compare"], commands(parser)))
    from experiments.cli.args import knobs, resolved_settings

    settings = resolved_settings(args, args.workload, knobs(args), [])
    assert settings["knobs"] == {"num_documents": 100, "num_requests": 1000, "rate": 20.0}
    assert settings["capacity_tokens"] == [25_000, 50_000, 100_000, 200_000]
    # written and read back: the same values, inf included
    settings["request_rate"] = math.inf
    assert tomllib.loads(dump_toml(settings)) == {k: v for k, v in settings.items() if v is not None}


def test_flags_beside_the_file_win(tmp_path):
    exp = tmp_path / "exp.toml"
    exp.write_text(FAST)
    parser = build_parser()
    argv = expand_config(
        ["compare", "--config", str(exp), "--protocol", "both", "--knob", "num_requests=9"], commands(parser)
    )
    args = parser.parse_args(argv)
    assert args.protocol == "both" and args.knob == ["num_requests=6", "num_requests=9"]
    from experiments.cli.args import knobs

    assert knobs(args)["num_requests"] == "9"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('workload = "no_sharing"\nbogus = 3\n', "has no option 'bogus'"),
        ("capacity_tokens = [1, {a = 2}]\n", "expected a string, number or boolean"),
        ("page_size = [16, 32]\n", "page_size takes one value, got 2"),
        ('command = "sweep"\n', "is a config for 'sweep', not 'compare'"),
        ("workload = \n", "not valid TOML"),
        ("no_bounds = 3\n", "no_bounds is true or false"),
    ],
)
def test_a_bad_config_is_one_line_and_exit_3(tmp_path, capsys, text, message):
    exp = tmp_path / "exp.toml"
    exp.write_text(text)
    assert main(["compare", "--config", str(exp), "--output-dir", str(tmp_path / "o")]) == 3
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_missing_config_and_a_config_without_a_command(tmp_path):
    with pytest.raises(ConfigFileError, match="config file not found"):
        expand_config(["compare", "--config", str(tmp_path / "nope.toml")], commands(build_parser()))
    (tmp_path / "e.toml").write_text("seed = 1\n")
    with pytest.raises(ConfigFileError, match="name the command"):
        expand_config(["--config", str(tmp_path / "e.toml")], commands(build_parser()))


def test_a_sweeps_config_resumes_the_same_cells(tmp_path, capsys):
    out = tmp_path / "sw"
    argv = ["sweep", "--workloads", "shared_doc_qa", "no_sharing", "--knob", "num_requests=5", "--knob", "doc_len=64",
            "--backend", "apc", "--protocol", "replay", "--capacity-tokens", "20000", "--page-size", "16", "32",
            "--no-progress", "--no-bounds", "--output-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    settings = tomllib.loads((out / "config.toml").read_text())
    assert settings["workloads"] == ["shared_doc_qa", "no_sharing"] and settings["page_size"] == [16, 32]
    assert settings["knobs"] == {"num_requests": "5", "doc_len": "64"}
    assert json.loads((out / "no_sharing-p32" / "results.json").read_text())["run_config"] == settings
    capsys.readouterr()
    # the file alone names the same cells: all of them already done
    assert main(["--config", str(out / "config.toml")]) == 0
    assert "sweep: 4 cells, 4 already done, 0 to run" in capsys.readouterr().err
