"""The Python API (experiments/api.py): the commands as functions, a Results object with
`.to_pandas()`, errors raised (never an exit), pandas optional."""

from __future__ import annotations

import json
import sys

import pytest

from experiments import api
from experiments.errors import InputError, UsageError

FAST = {"workload": "no_sharing", "knobs": {"num_requests": 6}, "capacity_tokens": [20000, 40000], "no_bounds": True}


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    return api.compare(backend=["apc", "none"], protocol="both", output_dir=tmp_path_factory.mktemp("api"), **FAST)


def test_compare_returns_the_runs_results(compared):
    doc = json.loads((compared.path / "results.json").read_text())
    assert compared.document == doc and len(compared.cells) == 4
    assert compared.run_config["knobs"] == {"num_requests": 6} and compared.run_config["backend"] == ["apc", "none"]
    rows = compared.rows()
    assert [(r["backend"], r["capacity_tokens"]) for r in rows] == [
        ("apc", 20000), ("none", 20000), ("apc", 40000), ("none", 40000)]  # fmt: skip
    cell = doc["cells"][0]
    assert rows[0]["replay.hit_rate"] == cell["replay"]["hit_rate"]
    assert rows[0]["serving.ttft_p50"] == cell["serving"]["ttft_p50"]
    assert not any(isinstance(v, list) for r in rows for v in r.values())


def test_to_pandas_is_one_row_per_cell(compared):
    pd = pytest.importorskip("pandas")
    df = compared.to_pandas()
    assert isinstance(df, pd.DataFrame) and len(df) == 4
    assert list(df["backend"]) == ["apc", "none", "apc", "none"]
    assert df["replay.requests"].tolist() == [6] * 4
    per = compared.per_request()
    assert len(per) == 4 * 6 and {"backend", "capacity_tokens"} <= set(per.columns)
    assert api.load(compared.path).to_pandas().equals(df)


def test_without_pandas_the_error_says_what_to_install(compared, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"prefix-cache-lab\[pandas\]"):
        compared.to_pandas()


def test_bad_calls_raise_before_any_work(tmp_path):
    with pytest.raises(UsageError, match="invalid choice: 'nope'"):
        api.compare(protocol="nope", output_dir=tmp_path / "a", **FAST)
    with pytest.raises(InputError, match="has no option 'bogus'"):
        api.compare(bogus=1, output_dir=tmp_path / "b")
    with pytest.raises(InputError, match="unknown workload"):
        api.compare(workload="nope", output_dir=tmp_path / "c")
    assert not any((tmp_path / n).exists() for n in "abc")


def test_run_takes_one_backend(tmp_path):
    res = api.run("radix", output_dir=tmp_path / "r", protocol="replay", **FAST)
    assert [r["backend"] for r in res.rows()] == ["radix", "radix"]
