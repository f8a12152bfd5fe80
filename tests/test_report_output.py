"""Issue 15's plots and tables: figures drawn without pyplot (the caller's backend stays), PNG at
print resolution plus PDF, readable axes (log TTFT, percent hit rate, capacity ceiling), one
style per backend label whatever its position; tables in ms with the full latency statistics
and vLLM's throughput names; results.json's schema, version and the package's own commit;
results.csv with bounds, knobs and options; cache time as CPU time."""

from __future__ import annotations

import copy
import csv
import json
import os
import struct
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from cachelib import create_cache
from cachelib.types import Sequence
from experiments.__main__ import main
from experiments.engine.cache_client import CacheClient
from experiments.report import figures
from experiments.report.plot_styles import BACKEND_STYLES, base_backend, style_of
from experiments.report.render import markdown, render, sig3
from experiments.report.results import SCHEMA_VERSION
from experiments.runs import provenance

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--workload", "shared_doc_qa", "--knob", "num_documents=4", "--knob", "num_requests=30", "--knob",
         "doc_len=300", "--knob", "question_len=20", "--knob", "output_len=6", "--knob", "rate=40", "--no-progress",
         "--capacity-tokens", "1200", "4800", "--slo-ttft-ms", "60", "--slo-tpot-ms", "20"]  # fmt: skip


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("report") / "out"
    assert main(["compare", *SMALL, "--output-dir", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


# -- figures ------------------------------------------------------------------------------------


def _png_size_and_dpi(path: Path) -> tuple[int, int, float]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    at = data.index(b"pHYs")
    ppm_x, _, unit = struct.unpack(">IIB", data[at + 4 : at + 13])
    assert unit == 1  # pixels per metre
    return width, height, ppm_x * 0.0254


def test_every_figure_is_a_print_resolution_png_and_a_pdf(compared):
    out, _ = compared
    for stem in (figures.HIT_RATE, figures.TTFT_CDF, figures.PAGES_IN_USE):
        width, height, dpi = _png_size_and_dpi(out / f"{stem}.png")
        assert dpi == pytest.approx(figures.PNG_DPI, abs=1) and figures.PNG_DPI >= 200
        assert width / height < 2.5, f"{stem} is a strip: {width}x{height}"
        assert (out / f"{stem}.pdf").read_bytes()[:5] == b"%PDF-"
        md = (out / "report.md").read_text()
        assert f"![{stem}]({stem}.png)" in md and f"[PDF]({stem}.pdf)" in md


def test_the_pdfs_are_the_same_bytes_when_rendered_again(compared, tmp_path):
    out, doc = compared
    render(doc, tmp_path)
    for stem in (figures.HIT_RATE, figures.TTFT_CDF, figures.PAGES_IN_USE):
        assert (tmp_path / f"{stem}.pdf").read_bytes() == (out / f"{stem}.pdf").read_bytes(), stem


def test_rendering_leaves_the_callers_plotting_backend_alone(compared, tmp_path):
    """As in a notebook: the user chose a backend; writing a report must not switch it (the
    old code called matplotlib.use("Agg")) nor import pyplot."""
    out, _ = compared
    script = (
        "import sys, matplotlib\n"
        "matplotlib.use('svg')\n"
        "from experiments.report.render import load, render\n"
        f"render(load({str(out)!r}), {str(tmp_path / 'again')!r})\n"
        "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend()\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "again" / "ttft_cdf.png").is_file()


def test_ttft_cdf_has_one_shared_log_axis_and_one_figure_legend(compared):
    _, doc = compared
    fig = figures.ttft_figure(doc)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == len(doc["capacities"])
    assert all(ax.get_xscale() == "log" for ax in axes)
    assert all(ax.get_shared_x_axes().joined(axes[0], ax) for ax in axes)
    assert axes[0].get_xlim() == axes[-1].get_xlim()
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == doc["backends"]
    # milliseconds: the drawn values are the stored quantiles (s) x 1000
    cell = next(c for c in doc["cells"] if c["config"]["capacity_tokens"] == doc["capacities"][0])
    first = axes[0].get_lines()[0].get_xdata()
    assert first[-1] == pytest.approx(max(cell["serving"]["ttft_quantiles"]) * 1000)


def test_a_zero_ttft_is_drawn_at_the_stated_floor(compared):
    _, doc = compared
    doc = copy.deepcopy(doc)
    doc["cells"][0]["serving"]["ttft_quantiles"][0] = 0.0
    fig = figures.ttft_figure(doc)
    assert f"0 drawn at {figures.TTFT_FLOOR_MS:g} ms" in fig.get_supxlabel()
    assert min(fig.axes[0].get_lines()[0].get_xdata()) == figures.TTFT_FLOOR_MS
    assert "drawn at" not in figures.ttft_figure(compared[1]).get_supxlabel()  # nothing clipped: nothing said


def test_pages_in_use_is_small_multiples_with_the_capacity_ceiling(compared):
    _, doc = compared
    fig = figures.pages_figure(doc)
    axes = fig.axes
    assert len(axes) == len(doc["capacities"]) * len(doc["backends"])
    for ax in axes:
        ceilings = [ln for ln in ax.get_lines() if list(ln.get_ydata()) == [1.0, 1.0]]
        assert len(ceilings) == 1  # the capacity, at 100%
    # each panel's data is pinned pages over that cell's pages
    cell = doc["cells"][1]
    ax = axes[doc["backends"].index(cell["config"]["backend"])]
    raw = ax.get_lines()[1].get_ydata()
    pages = [p for _, p in cell["serving"]["pages_timeline"]]
    assert max(raw) == pytest.approx(max(pages) / cell["num_pages"])
    assert max(raw) <= 1.0


def test_hit_rate_axis_is_percent_with_ticks_at_the_capacities_and_the_legend_outside(compared):
    from matplotlib.ticker import PercentFormatter

    _, doc = compared
    fig = figures.hit_rate_figure(doc)
    (ax,) = fig.axes
    assert isinstance(ax.yaxis.get_major_formatter(), PercentFormatter)
    assert list(ax.get_xticks()) == doc["capacities"]
    assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == ["1.2k tokens", "4.8k tokens"]
    assert ax.get_legend() is None and len(fig.legends) == 1
    fig.canvas.draw()
    legend_box = fig.legends[0].get_window_extent()
    assert legend_box.x0 >= ax.get_window_extent().x1  # beside the data, not over it
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    none, paged = lines["none"], lines["paged"]
    assert list(none.get_ydata()) == list(paged.get_ydata()) == [0.0, 0.0]  # they coincide here...
    assert (none.get_color(), none.get_linestyle(), none.get_marker()) != (
        paged.get_color(),
        paged.get_linestyle(),
        paged.get_marker(),
    )  # ...and are told apart
    assert paged.get_zorder() > none.get_zorder() and paged.get_markerfacecolor() == "none"


# -- one style per label --------------------------------------------------------------------


def test_a_label_has_one_style_wherever_it_stands(compared):
    _, doc = compared
    reordered = copy.deepcopy(doc)
    reordered["backends"] = list(reversed(doc["backends"]))
    reordered["cells"] = list(reversed(doc["cells"]))

    def styles(d):
        (ax,) = figures.hit_rate_figure(d).axes
        return {ln.get_label(): (ln.get_color(), ln.get_linestyle(), ln.get_marker()) for ln in ax.get_lines()}

    a, b = styles(doc), styles(reordered)
    assert a == b and "radix-aged" in a
    assert a["radix-aged"][0] == BACKEND_STYLES["radix-aged"].color


def test_styles_are_fixed_for_the_backends_and_distinct():
    from cachelib import available_backends

    assert set(available_backends()) <= set(BACKEND_STYLES)
    fixed = list(BACKEND_STYLES.values())
    assert len({s.color for s in fixed}) == len(fixed) and len({s.marker for s in fixed}) == len(fixed)


def test_a_variants_style_follows_its_label_not_the_process():
    labels = ["radix[eviction_policy=lfu]", "apc ×8 cache_aware", "my_backend"]
    assert base_backend("apc ×8 cache_aware[cache_threshold=0.5]") == "apc"
    assert base_backend("radix[eviction_policy=lfu]") == "radix"
    here = [style_of(lab) for lab in labels]
    assert here[0].marker == BACKEND_STYLES["radix"].marker and here[1].marker == BACKEND_STYLES["apc"].marker
    assert all(s.color not in {f.color for f in BACKEND_STYLES.values()} for s in here)
    script = (
        "from experiments.report.plot_styles import style_of\n"
        f"print([tuple(map(str, (s.color, s.linestyle, s.marker))) for s in map(style_of, {labels!r})])"
    )
    for seed in ("1", "2"):  # Python's str hash is salted per process; the style must not be
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
        assert done.stdout.strip() == str([tuple(map(str, (s.color, s.linestyle, s.marker))) for s in here])


# -- tables -----------------------------------------------------------------------------------


def test_the_report_has_latency_in_ms_throughput_goodput_and_readable_capacities(compared):
    out, doc = compared
    md = (out / "report.md").read_text()
    kv = doc["cells"][0]["kv_capacity"]
    assert f"## Capacity 1,200 tokens ({kv['gb']:.2f} GB of KV for llama3-8b)" in md
    assert "| cell | latency | mean (ms) | p50 (ms) | p90 (ms) | p99 (ms) |" in md
    cell = doc["cells"][1]  # apc at 1,200
    lat = cell["serving"]["latency"]
    rows = {
        name: f"| {name} | " + " | ".join(sig3(lat[key][s]) for s in ("mean", "p50", "p90", "p99")) + " |"
        for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
    }
    assert f"| apc {rows['TTFT']}" in md
    for name in ("TPOT", "ITL", "E2E"):
        assert f"|  {rows[name]}" in md
    header = (
        "| cell | request throughput (req/s) | output token throughput (tok/s) | total token throughput (tok/s) "
        "| duration (s) | request goodput (req/s) |"
    )
    assert header in md
    sv = cell["serving"]
    assert sv["output_throughput"] == pytest.approx(sv["generated_tokens"] / sv["makespan_s"])
    assert sv["total_token_throughput"] == pytest.approx(
        (sv["prompt_tokens"] + sv["generated_tokens"]) / sv["makespan_s"]
    )
    assert sv["request_throughput"] == pytest.approx(sv["finished"] / sv["makespan_s"])
    good = lat["goodput"]
    assert (good["slo_ttft_ms"], good["slo_tpot_ms"]) == (60, 20)
    assert f"| apc | {sv['request_throughput']:,.2f} | {sv['output_throughput']:,.0f} |" in md
    assert "cache CPU µs/req (replay) | cache CPU µs/req (serving)" in md and "time.thread_time" in md
    assert f"{sv['ttft_p50'] * 1000:,.1f}" in md  # TTFT in ms in the main table too


def test_an_old_document_still_renders_and_says_its_cache_times_are_wall_time():
    old = json.loads((ROOT / "tests" / "fixtures" / "results_schema1.json").read_text())
    md = markdown(old, [])
    assert "cache wall µs/req (replay)" in md and "predates the CPU clock" in md
    assert "| none | 0.00% |" in md


# -- results.json and results.csv -------------------------------------------------------------


def test_results_json_names_its_schema_package_commit_and_clocks(compared):
    _, doc = compared
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["package"] == {"name": "prefix-cache-lab", "version": metadata.version("prefix-cache-lab")}
    assert doc["commit"] == provenance.git_commit() and "thread_time" in doc["clocks"]["cache"]
    assert all("kv_capacity" in c and "latency" in c["serving"] for c in doc["cells"])


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True, env=env).stdout


def test_the_commit_is_the_packages_own_even_inside_another_repository(tmp_path):
    try:
        ours = _git(ROOT, "rev-parse", "--short", "HEAD").strip()
    except subprocess.CalledProcessError:
        pytest.skip("the package is not in a git checkout")
    other = tmp_path / "other"
    other.mkdir()
    _git(other, "init", "-q")
    (other / "f").write_text("x")
    _git(other, "add", "f")
    _git(other, "commit", "-qm", "another repository")
    theirs = _git(other, "rev-parse", "--short", "HEAD").strip()
    script = "from experiments.runs.provenance import git_commit; print(git_commit())"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], cwd=other, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ours != theirs


def test_the_commit_is_unknown_for_a_copy_outside_a_checkout_or_inside_anothers(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "PACKAGE_ROOT", tmp_path)  # no repository at all
    assert provenance.git_commit() == "unknown"
    _git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("x")
    _git(tmp_path, "add", "f")
    _git(tmp_path, "commit", "-qm", "a venv's repository")
    site = tmp_path / "venv" / "site-packages"
    site.mkdir(parents=True)
    monkeypatch.setattr(provenance, "PACKAGE_ROOT", site.resolve())  # installed inside someone's repository
    assert provenance.git_commit() == "unknown"


def test_results_csv_has_bounds_knobs_options_and_throughputs(compared):
    out, doc = compared
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == len(doc["cells"])
    for row, cell in zip(rows, doc["cells"], strict=True):
        cap = cell["config"]["capacity_tokens"]
        assert float(row["bounds.belady.hit_rate"]) == doc["bounds"]["belady"][str(cap)]["hit_rate"]
        assert float(row["bounds.infinite.hit_rate"]) == doc["bounds"]["infinite"]["hit_rate"]
        for knob, value in cell["workload_config"].items():
            assert row[f"workload.{knob}"] == str(value), knob
        assert json.loads(row["backend_options"]) == cell["config"]["backend_options"]
        assert (row["model"], int(row["token_budget"]), row["protocol"]) == ("llama3-8b", 8192, "both")
        assert float(row["serving.output_throughput"]) == cell["serving"]["output_throughput"]
        assert float(row["kv_capacity.gb"]) == cell["kv_capacity"]["gb"]


# -- cache time is CPU time ---------------------------------------------------------------------


class _Sleepy:
    """A cache whose `match` waits 30 ms without using the CPU (as a machine busy with other
    work would delay it)."""

    def __init__(self) -> None:
        self.inner = create_cache("apc", num_pages=8, page_size=4)

    def match(self, seq):
        time.sleep(0.03)
        return self.inner.match(seq)


def test_cache_time_is_the_threads_cpu_time_not_the_wall_clock():
    import numpy as np

    seq = Sequence("r", np.arange(8, dtype=np.int32))
    cpu = CacheClient(_Sleepy())  # type: ignore[arg-type]
    cpu.match(seq)
    wall = CacheClient(_Sleepy(), clock=time.perf_counter)  # type: ignore[arg-type]
    wall.match(seq)
    assert wall.seconds >= 0.03 and cpu.seconds < 0.01


def test_capacity_gb_never_in_exponent_notation():
    from experiments.report.figures import compact_gb

    assert [compact_gb(x) for x in (3.2768, 26.2144, 131.072, 1310.72)] == ["3.28", "26.2", "131", "1,311"]


# -- many long labels (a comparison of option variants) -----------------------------------------


def test_long_labels_wrap_after_the_bracket_and_the_commas():
    label = "radix-hicache[host_capacity_tokens=4000000,storage_backend=file,storage_capacity_tokens=64000000]"
    assert figures.wrap_label(label).split("\n") == [
        "radix-hicache[",
        "host_capacity_tokens=4000000,",
        "storage_backend=file,",
        "storage_capacity_tokens=64000000]",
    ]
    assert figures.wrap_label("apc[host_capacity_tokens=4000000]") == "apc[host_capacity_tokens=4000000]"
    assert figures.wrap_label("radix ×2 cache_aware") == "radix ×2 cache_aware"


def _with_many_variants(doc: dict) -> dict:
    """`doc` with twelve more cells, each a long-named variant of its first cell."""
    out = copy.deepcopy(doc)
    first = out["cells"][0]
    for k in range(12):
        cell = copy.deepcopy(first)
        cell["config"]["backend_options"] = {"host_capacity_tokens": 4_000_000 + k, "write_policy": "write_back"}
        out["cells"].append(cell)
        out["backends"].append(figures.cell_label_of(cell["config"]))
    return out


def test_a_long_legend_widens_the_figure_and_leaves_the_axes_their_size(compared):
    _, doc = compared
    many = _with_many_variants(doc)
    for make in (figures.hit_rate_figure, figures.ttft_figure):
        short, long = make(doc), make(many)
        short.canvas.draw()
        long.canvas.draw()
        assert long.get_size_inches()[0] > short.get_size_inches()[0]
        ax_short, ax_long = short.axes[0].get_window_extent(), long.axes[0].get_window_extent()
        assert ax_long.width >= 0.9 * ax_short.width  # the legend did not squeeze the data
        legend = long.legends[0]
        assert legend.get_window_extent().x0 >= long.axes[0].get_window_extent().x1
        assert any("\n" in t.get_text() for t in legend.get_texts())  # long labels wrapped
        assert legend.get_window_extent().x1 <= long.bbox.x1 + 1  # nothing cut off


def test_many_backends_wrap_the_pages_figure_onto_rows(compared):
    _, doc = compared
    many = _with_many_variants(doc)
    fig = figures.pages_figure(many)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == len(many["capacities"]) * len(many["backends"])
    cols = {round(ax.get_position().x0, 3) for ax in visible}
    assert len(cols) == figures.PAGES_MAX_COLS
