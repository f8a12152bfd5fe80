"""The timing options on the command line: predict-step, --tp, --executor profile, the
capacity-beyond-memory refusal, and what a report says about its timing."""

from __future__ import annotations

import json

import pytest

from experiments.cli.main import main
from experiments.errors import EXIT_BAD_INPUT, EXIT_USAGE
from experiments.report.metrics import saturation
from experiments.report.render import sig3

SMALL = ["--workload", "no_sharing", "--knob", "num_requests=20", "--no-progress", "--protocol", "serving"]


def compare(capacity: int, *options: str) -> list[str]:
    """A small serving comparison of apc at `capacity` tokens, with `options`."""
    return ["compare", *SMALL, "--backend", "apc", "--capacity-tokens", str(capacity), *options]


def test_predict_step_answers_in_json_with_its_parts(capsys):
    rc = main(
        ["predict-step", "--model", "meta-llama/Meta-Llama-3-70B", "--device", "A100-80GB", "--tp", "4",
         "--prefill-tokens", "2048", "--decode-batch", "64", "--decode-context", "2000", "--executor", "profile", "--json"]
    )  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "llama3-70b" and out["device"] == "a100" and out["tp"] == 4
    assert out["step_ms"] == pytest.approx(sum(out["parts_ms"].values()))
    assert set(out["parts_ms"]) == {"linear", "attention", "all_reduce", "lm_head", "overhead"}
    assert "vidur" in out["source"]
    assert (
        main(
            [
                "predict-step",
                "--model",
                "llama3-8b",
                "--device",
                "h200",
                "--decode-batch",
                "8",
                "--decode-context",
                "100",
            ]
        )
        == 0
    )
    roofline = capsys.readouterr().out
    assert roofline.startswith("llama3-8b on 1 x h200, cost:") and "all_reduce: 0 ms" in roofline


@pytest.mark.parametrize(
    ("args", "rc", "message"),
    [
        (["--model", "llama3-70b", "--device", "h100", "--tp", "3", "--decode-batch", "1", "--decode-context", "5"], EXIT_BAD_INPUT, "does not divide"),
        (["--model", "gpt-5", "--device", "h100", "--decode-batch", "1", "--decode-context", "5"], EXIT_BAD_INPUT, "unknown model 'gpt-5'"),
        (["--model", "llama3-8b", "--device", "v100", "--decode-batch", "1", "--decode-context", "5"], EXIT_BAD_INPUT, "unknown device 'v100'"),
        (["--model", "llama3-8b", "--device", "h100"], EXIT_USAGE, "an empty step"),
        (["--model", "llama3-8b", "--device", "h100", "--decode-batch", "4"], EXIT_USAGE, "needs --decode-context"),
        (["--model", "mixtral-8x7b", "--device", "h200", "--decode-batch", "1", "--decode-context", "5", "--executor", "profile"], EXIT_BAD_INPUT, "no shipped profile for mixtral-8x7b on h200"),
    ],
)  # fmt: skip
def test_predict_step_refuses_bad_input_in_one_line(capsys, args, rc, message):
    assert rc_of(["predict-step", *args]) == rc
    assert message in capsys.readouterr().err


def rc_of(argv: list[str]) -> int:
    """`main`'s exit code, argparse's own (a bad option value) included."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


def test_a_capacity_beyond_the_devices_memory_is_refused_unless_forced(tmp_path, capsys):
    out = tmp_path / "out"
    args = compare(2000000, "--output-dir", str(out))
    assert main(args) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "a KV capacity of 2,000,000 tokens takes 262.1 GB beside 16.1 GB of llama3-8b weights on h200" in err
    assert "--force-capacity" in err and not out.exists()  # nothing written
    # more GPUs hold more: 2M tokens of Llama-3-8B over 4 H200s (2 KV heads each) fit
    assert main([*args, "--tp", "4"]) == 0
    report = (out / "report.md").read_text()
    assert "executor cost (llama3-8b on 4 x h200)" in report
    assert "Timing: a roofline" in report and "three significant figures" in report


def test_a_model_whose_weights_do_not_fit_is_refused_even_when_forced(tmp_path, capsys):
    out = tmp_path / "out"
    args = compare(20000, "--model", "llama3-70b", "--device", "a100")
    assert main([*args, "--force-capacity", "--output-dir", str(out)]) == EXIT_BAD_INPUT
    assert (
        "llama3-70b's weights take 141.1 GB on each of 1 x a100, which has 80 GB: they do not fit (--tp 2 or more"
        in capsys.readouterr().err
    )
    assert not out.exists()


def test_a_forced_capacity_is_run_and_said(tmp_path):
    out = tmp_path / "out"
    args = compare(2000000, "--force-capacity", "--output-dir", str(out))
    assert main(args) == 0
    assert "`--force-capacity`" in (out / "report.md").read_text()


def test_the_profile_executor_runs_a_comparison_and_a_bad_table_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    base = compare(20000, "--model", "llama3-70b", "--device", "a100")
    assert main([*base, "--tp", "4", "--executor", "profile", "--output-dir", str(out)]) == 0
    assert "profile table" in (out / "report.md").read_text()
    bad = tmp_path / "bad.csv"
    bad.write_text(
        "# model: llama3-70b\n# device: a100\n# source: x\n# engine: y\n# license: z\nop,tp,tokens,context,ms\nlinear,1,1,0,oops\n"
    )
    out2 = tmp_path / "out2"
    assert main([*base, "--executor", "profile", "--profile", str(bad), "--output-dir", str(out2)]) == EXIT_BAD_INPUT
    assert "bad.csv, line 7: column ms must be a number, got 'oops'" in capsys.readouterr().err
    assert not out2.exists()
    assert main([*base, "--tp", "3", "--output-dir", str(out2)]) == EXIT_BAD_INPUT
    assert "does not divide llama3-70b's 64 attention heads" in capsys.readouterr().err
    assert main([*base, "--profile", str(bad), "--output-dir", str(out2)]) == EXIT_BAD_INPUT
    assert "is for --executor profile" in capsys.readouterr().err


def test_latencies_print_to_three_significant_figures():
    assert [sig3(x) for x in (501851.4, 118.23, 12.345, 0.123456, 0.0, 1234.5)] == [
        "502,000",
        "118",
        "12.3",
        "0.123",
        "0",
        "1,230",
    ]


def test_a_run_whose_queue_grows_is_saturated():
    steady = [{"arrival": float(i), "ttft": 0.2} for i in range(100)]
    assert not saturation(steady)["saturated"]
    growing = [{"arrival": float(i), "ttft": 0.1 + i} for i in range(100)]
    s = saturation(growing)
    assert s["saturated"] and s["last_tenth_ttft_s"] > 4 * s["first_tenth_ttft_s"]
    assert not saturation(growing[:20])["saturated"]  # too few requests to tell


def test_a_changed_profile_table_is_a_new_cell(tmp_path):
    from experiments.runs.provenance import provenance

    table = tmp_path / "t.csv"
    table.write_text("a")
    first = provenance({}, str(table))["profile_sha256"]
    table.write_text("b")
    assert provenance({}, str(table))["profile_sha256"] != first
    assert "profile_sha256" not in provenance({})


def test_a_users_own_profile_is_named_in_the_report_without_a_borrowed_calibration(tmp_path):
    from experiments.timing.profile import shipped_profiles

    mine = tmp_path / "mine.csv"
    mine.write_text(shipped_profiles()[("llama3-70b", "a100")].read_text())
    out = tmp_path / "out"
    args = compare(20000, "--model", "llama3-70b")
    assert (
        main(
            [
                *args,
                "--device",
                "a100",
                "--tp",
                "4",
                "--executor",
                "profile",
                "--profile",
                str(mine),
                "--output-dir",
                str(out),
            ]
        )
        == 0
    )
    assert "your measured profile table `mine.csv`" in (out / "report.md").read_text()
