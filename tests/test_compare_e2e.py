"""`compare` end to end: report files, consistent numbers, bounds, re-rendering, bad input."""

from __future__ import annotations

import json

import pytest

from experiments.__main__ import main

SMALL = [
    "--workload",
    "shared_doc_qa",
    "--knob",
    "num_documents=6",
    "--knob",
    "num_requests=60",
    "--knob",
    "doc_len=400",
    "--knob",
    "question_len=20",
    "--knob",
    "output_len=8",
    "--knob",
    "rate=50",
    "--no-progress",
]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("cmp")
    assert main(["compare", *SMALL, "--capacity-tokens", "1200", "2400", "4800", "--output-dir", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_writes_markdown_plots_json_and_csv(compared):
    out, results = compared
    for name in (
        "report.md",
        "results.json",
        "results.csv",
        "hit_rate_vs_capacity.png",
        "ttft_cdf.png",
        "pages_in_use.png",
        "hit_rate_vs_capacity.pdf",
        "ttft_cdf.pdf",
        "pages_in_use.pdf",
    ):
        assert (out / name).stat().st_size > 0, name
    md = (out / "report.md").read_text()
    assert (
        "## Capacity 1,200 tokens" in md
        and "Belady" in md
        and "![hit_rate_vs_capacity](hit_rate_vs_capacity.png)" in md
    )
    assert len((out / "results.csv").read_text().splitlines()) == 1 + len(results["cells"])
    assert results["config" if "config" in results else "settings"]["page_size"] == 16


def test_numbers_are_consistent(compared):
    _, results = compared
    bounds = results["bounds"]
    assert bounds["infinite"]["hit_rate"] > 0
    for cell in results["cells"]:
        backend, cap = cell["config"]["backend"], cell["config"]["capacity_tokens"]
        rp, sv = cell["replay"], cell["serving"]
        assert rp["hit_tokens"] + rp["computed_prompt_tokens"] == rp["prompt_tokens"]
        assert sv["prefill_tokens_computed"] >= sv["prompt_tokens"] - sv["hit_tokens"]
        if sv["preemptions"] == 0:
            assert sv["prefill_tokens_computed"] == sv["prompt_tokens"] - sv["hit_tokens"]
        if backend in ("none", "paged"):  # paged shares only declared prefixes; this workload declares none
            assert rp["hit_tokens"] == 0 and sv["hit_tokens"] == 0
        belady = bounds["belady"][str(cap)]["hit_rate"]
        assert belady >= rp["hit_rate"] - 1e-12, f"{backend} beats Belady at {cap}"
        assert bounds["infinite"]["hit_rate"] >= belady
        assert sv["finished"] == 60 and sv["aborted"] == 0
    apc = {
        c["config"]["capacity_tokens"]: c["replay"]["hit_rate"]
        for c in results["cells"]
        if c["config"]["backend"] == "apc"
    }
    assert apc[1200] <= apc[2400] <= apc[4800] and apc[4800] > 0


def test_report_rerenders_the_same_markdown(compared, tmp_path):
    out, _ = compared
    assert main(["report", str(out), "--output-dir", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == (out / "report.md").read_text()
    assert (tmp_path / "hit_rate_vs_capacity.png").exists()


def test_run_takes_one_backend(tmp_path):
    assert (
        main(
            [
                "run",
                "--backend",
                "radix",
                *SMALL,
                "--capacity-tokens",
                "2400",
                "--protocol",
                "replay",
                "--no-bounds",
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert [c["config"]["backend"] for c in results["cells"]] == ["radix"] and "serving" not in results["cells"][0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--backend", "apc,radix", *SMALL], "run takes one --backend"),
        (["run", *SMALL], "run needs --backend"),
        (["compare", *SMALL, "--knob", "num_requests"], "--knob expects NAME=VALUE"),
    ],
)
def test_bad_usage_exits_2_with_a_message(argv, message, capsys, tmp_path):
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--workload", "nope"], "unknown workload"),
        (["compare", "--backend", "lru9", *SMALL], "unknown backend 'lru9'"),
        (["compare", *SMALL, "--capacity-tokens", "100"], "smaller than request"),
        (["compare", "--trace", "/no/such/trace.jsonl"], "trace file not found"),
        (["compare", *SMALL, "--knob", "colour=red"], "colour"),
        (["report", "/no/such/dir"], "no results JSON"),
    ],
)
def test_bad_input_exits_3_with_a_message(argv, message, capsys, tmp_path):
    assert main([*argv, "--output-dir", str(tmp_path)] if argv[0] != "report" else argv) == 3
    assert message in capsys.readouterr().err
