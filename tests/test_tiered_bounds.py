"""Belady at the total capacity of all tiers (`bounds.tiered`), each cache's tier sizes
(`PrefixCache.tier_capacities`) and the report's memory-tier table and CSV columns."""

from __future__ import annotations

import csv
import json

import pytest

from cachelib import create_cache
from experiments.__main__ import main
from experiments.bounds.oracle import belady_hits
from experiments.runs.runner import CellConfig, bounds, build_workload

KNOBS = {"num_documents": 30, "num_requests": 200, "doc_len": 400}


@pytest.mark.parametrize(
    ("backend", "options", "want"),
    [
        ("apc", {}, {"gpu": 1600}),
        ("radix", {}, {"gpu": 1600}),
        ("none", {}, {"gpu": 1600}),
        ("radix-hicache", {}, {"gpu": 1600, "host": 3200}),  # SGLang's default host = 2 x GPU
        ("radix-hicache", {"host_capacity_tokens": 4800}, {"gpu": 1600, "host": 4800}),
        ("apc", {"host_capacity_tokens": 4800}, {"gpu": 1600, "host": 4800}),
        ("apc-lmcache", {"host_capacity_tokens": 4864}, {"gpu": 1600, "host": 4864}),
        (
            "apc-lmcache",
            {"host_capacity_tokens": 4864, "disk_capacity_tokens": 9984},
            {"gpu": 1600, "host": 4864, "storage": 9984},
        ),  # fmt: skip
    ],
)
def test_each_cache_names_its_tiers_sizes(backend, options, want):
    cache = create_cache(backend, num_pages=100, page_size=16, **options)
    assert cache.tier_capacities() == want
    assert tuple(want) == cache.memory_tiers


def test_the_tiered_bound_is_belady_at_the_sum_of_the_tiers():
    gpu_only = CellConfig("apc", "shared_doc_qa", 1600, knobs=KNOBS, protocol="replay")
    hicache = CellConfig("radix-hicache", "shared_doc_qa", 1600, knobs=KNOBS, protocol="replay",
                         backend_options={"host_capacity_tokens": 4800})  # fmt: skip
    offload = CellConfig("apc", "shared_doc_qa", 1600, knobs=KNOBS, protocol="replay",
                         backend_options={"host_capacity_tokens": 4800})  # fmt: skip
    wl = build_workload(gpu_only)
    got = bounds(wl, 16, [1600], [gpu_only, hicache, offload])
    entry = got["tiered"]["6400"]
    want = belady_hits(wl.requests, 16, 400)
    assert entry["belady"] == {"hit_rate": want["hit_rate"], "hit_tokens": want["hit_tokens"]}
    assert entry["capacity_tokens"] == 6400
    assert entry["cells"] == {
        "radix-hicache[host_capacity_tokens=4800]": {"gpu": 1600, "host": 4800},
        "apc[host_capacity_tokens=4800]": {"gpu": 1600, "host": 4800},
    }
    # more memory can only help Belady, and the workload reuses more than 1,600 tokens hold
    assert got["belady"]["1600"]["hit_rate"] < entry["belady"]["hit_rate"] <= got["infinite"]["hit_rate"]
    assert "tiered" not in bounds(wl, 16, [1600], [gpu_only])


def test_compare_reports_reuse_by_tier_beside_the_tiered_bound(tmp_path):
    out = tmp_path / "out"
    argv = ["compare", "--workload", "shared_doc_qa", "--knob", "num_documents=30", "--knob", "num_requests=200",
            "--knob", "doc_len=400", "--capacity-tokens", "1600", "--protocol", "replay", "--no-progress",
            "--backend", "apc,radix-hicache[host_capacity_tokens=4800]", "--output-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    apc, hicache = doc["cells"]
    entry = doc["bounds"]["tiered"]["6400"]
    by_tier = hicache["replay"]["hit_tokens_by_tier"]
    assert sum(by_tier.values()) == hicache["replay"]["hit_tokens"] and by_tier["host"] > 0
    report = (out / "report.md").read_text()
    assert "## Memory tiers at 1,600 GPU tokens (replay)" in report
    row = next(
        line for line in report.splitlines() if line.startswith("| radix-hicache[host_capacity_tokens=4800] | gpu")
    )
    assert f"| {by_tier['host']:,} |" in row and row.endswith(f"| {entry['belady']['hit_rate']:.2%} |")
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert rows[0]["bounds.tiered.belady.hit_rate"] == ""  # apc: the GPU only
    assert float(rows[1]["bounds.tiered.belady.hit_rate"]) == entry["belady"]["hit_rate"]
    assert int(rows[1]["replay.hit_tokens_by_tier.host"]) == by_tier["host"]
    assert int(rows[1]["bounds.tiered.capacity_tokens"]) == 6400


def test_an_uncapped_storage_tier_bounds_at_the_infinite_cache():
    cell = CellConfig(
        "radix-hicache",
        "shared_doc_qa",
        1600,
        knobs=KNOBS,
        protocol="replay",
        backend_options={"host_capacity_tokens": 1600, "storage_backend": "file"},
    )
    wl = build_workload(cell)
    got = bounds(wl, 16, [1600], [cell])
    entry = got["tiered"]["unbounded"]
    assert entry["capacity_tokens"] is None
    assert entry["cells"] == {"radix-hicache[host_capacity_tokens=1600,storage_backend=file]": {
        "gpu": 1600, "host": 1600, "storage": 0}}  # fmt: skip
    assert entry["belady"] == {"hit_rate": got["infinite"]["hit_rate"], "hit_tokens": got["infinite"]["hit_tokens"]}
