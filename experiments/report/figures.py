"""The report's figures, drawn from a results document alone.

Drawn with matplotlib's object API (`Figure` on its own Agg canvas): nothing here imports
`matplotlib.pyplot` or calls `matplotlib.use`, so rendering a report inside a notebook or
another program never switches its plotting backend or opens a window. Each figure is
written twice: a PNG at print resolution (`PNG_DPI`) and a PDF (vector, for a paper), with
deterministic PDF metadata so a re-render gives the same bytes. Every backend label has one
style across every figure of every report (`experiments.report.plot_styles`).

- `hit_rate_vs_capacity`: each backend's replay hit rate against capacity, with the
  infinite-capacity and Belady bounds; percent axis, ticks at the capacities run.
- `ttft_cdf`: one panel per capacity, the CDF of TTFT on a shared log axis in ms.
- `pages_in_use`: small multiples, a row per capacity and a column per backend, pages
  pinned over time as a share of the capacity (whose ceiling, 100%, is drawn).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from experiments.report.labels import cell_label_of
from experiments.report.plot_styles import BOUND_STYLES, style_of

#: print resolution of the PNGs (dots per inch), and the colours of their palette
PNG_DPI = 200
PNG_COLOURS = 256
#: the formats written for every figure, in this order; the report embeds the first
FORMATS = ("png", "pdf")
#: figure stems, in the report's order
HIT_RATE, TTFT_CDF, PAGES_IN_USE = "hit_rate_vs_capacity", "ttft_cdf", "pages_in_use"
STEMS = (HIT_RATE, TTFT_CDF, PAGES_IN_USE)
#: the lowest TTFT the log axis shows (ms) unless a measured one is lower; a TTFT of 0
#: (nothing to compute, if an executor ever reports it) is drawn there, and the axis says so
TTFT_FLOOR_MS = 1.0
#: samples of the pages-in-use timeline averaged into its thick (smoothed) line
SMOOTH_SAMPLES = 15
#: PDF metadata: no creation date, so the same document renders the same bytes
_PDF_METADATA = {"CreationDate": None, "Creator": "prefix-cache-lab", "Producer": None}
#: a legend beside the axes holds at most this many entries of at most `SHORT_LABEL`
#: characters; more or longer (a comparison of many option variants) goes below, wrapped
LEGEND_BESIDE_MAX, SHORT_LABEL = 8, 32
#: a label is wrapped after a comma once a line reaches this many characters
WRAP_AT = 40
#: the most panels in a row of the pages figure: more backends wrap onto further rows
PAGES_MAX_COLS = 6


def wrap_label(label: str, width: int = WRAP_AT) -> str:
    """`label` broken into lines once a line passes `width` characters: after a variant's
    `[` and after the commas between its options; a short label stays one line."""
    if len(label) <= width:
        return label
    head, bracket, rest = label.partition("[")
    parts = [head + bracket, *rest.split(",")] if bracket else label.split(",")
    lines, line = [], ""
    for k, part in enumerate(parts):
        sep = "" if k == 0 else ("" if bracket and k == 1 else ",")
        if line and len(line) + len(sep) + len(part) > width:
            lines.append(line + sep if sep == "," else line)
            line = part
        else:
            line += sep + part
    return "\n".join([*lines, line])


def _legend(fig: Any, handles: list[Any], names: list[str], title: str) -> None:
    """The figure's one legend, beside the axes. A long one (many or long labels: a
    comparison of option variants) has its labels wrapped and the figure made wider and,
    where needed, taller, so the axes keep their size whatever the labels."""
    if len(names) <= LEGEND_BESIDE_MAX and max(map(len, names), default=0) <= SHORT_LABEL:
        fig.legend(handles, names, loc="outside right upper", fontsize=8, title=title, title_fontsize=8)
        return
    wrapped = [wrap_label(n) for n in names]
    lines = sum(w.count("\n") + 1 for w in wrapped)
    width, height = fig.get_size_inches()
    fig.set_size_inches(width + 3.4, max(height, 0.15 * lines + 0.12 * len(names) + 0.8))
    fig.legend(handles, wrapped, loc="outside right upper", fontsize=7, title=title, title_fontsize=8)


def draw_all(results: dict[str, Any], out_dir: Path, stems: tuple[str, ...] = STEMS) -> list[str]:
    """Write every figure of `stems` the document has data for into `out_dir`; returns
    their stems, in the report's order. Each figure is drawn alone (its own `Figure`), so
    drawing some here and the others in another process writes the same bytes."""
    drawn = []
    for stem, make in ((HIT_RATE, hit_rate_figure), (TTFT_CDF, ttft_figure), (PAGES_IN_USE, pages_figure)):
        fig = make(results) if stem in stems else None
        if fig is not None:
            _save(fig, out_dir, stem)
            drawn.append(stem)
    return drawn


def _new_figure(width: float, height: float) -> Any:
    """A figure on its own Agg canvas: pyplot's global state is never touched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, out_dir: Path, stem: str) -> None:
    for fmt in FORMATS:
        if fmt == "png":
            _save_png(fig, out_dir / f"{stem}.png")
        else:
            fig.savefig(out_dir / f"{stem}.{fmt}", format=fmt, metadata=_PDF_METADATA)


def _save_png(fig: Any, path: Path) -> None:
    """The PNG at `PNG_DPI`, in a palette of `PNG_COLOURS` colours (no dithering): a chart's
    flat colours and their antialiased edges need no more, and the file is about 40% of the
    full-colour one (what lets the committed reports stay small). Deterministic: the same
    figure gives the same bytes."""
    import io

    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PNG_DPI)
    buf.seek(0)
    with Image.open(buf) as im:
        dpi = im.info.get("dpi", (PNG_DPI, PNG_DPI))
        flat = im.convert("RGB").quantize(PNG_COLOURS, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        flat.save(path, format="PNG", optimize=True, dpi=dpi)


def _labels(results: dict[str, Any]) -> list[str]:
    """The document's cell labels in its order (`backends`, then any cluster labels)."""
    seen = dict.fromkeys(results.get("backends") or [])
    seen.update(dict.fromkeys(cell_label_of(c["config"]) for c in results["cells"]))
    return list(seen)


def _cells_at(results: dict[str, Any], cap: int) -> Iterator[tuple[str, dict[str, Any]]]:
    for c in results["cells"]:
        if c["config"]["capacity_tokens"] == cap:
            yield cell_label_of(c["config"]), c


def compact_tokens(n: int) -> str:
    """`25000` -> `25k`, `1000000` -> `1M`, `1500` -> `1.5k`: a capacity as a tick names it."""
    for unit, size in (("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return str(n)


def _kv_gb(results: dict[str, Any], cap: int) -> float | None:
    kv = next((c["kv_capacity"] for _, c in _cells_at(results, cap) if "kv_capacity" in c), None)
    return None if kv is None else kv["gb"]


def compact_gb(gb: float) -> str:
    """`26.2144` -> `26.2`, `1310.72` -> `1,311`: three significant digits, never an exponent."""
    return f"{gb:,.0f}" if gb >= 100 else f"{gb:.3g}"


def _capacity_text(results: dict[str, Any], cap: int, sep: str = " ") -> str:
    gb = _kv_gb(results, cap)
    return f"{compact_tokens(cap)} tokens" + ("" if gb is None else f"{sep}({compact_gb(gb)} GB)")


# -- hit rate vs capacity --------------------------------------------------------------------


def hit_rate_figure(results: dict[str, Any]) -> Any:
    """Replay hit rate (percent) against capacity (log axis, a tick at each capacity run,
    labelled in tokens and, where the cells say, GB of KV), bounds in grey, legend outside."""
    from matplotlib.ticker import NullLocator, PercentFormatter

    caps = results["capacities"]
    fig = _new_figure(7.2, 4.0)
    ax = fig.add_subplot()
    # paged (dotted, hollow squares) is drawn over none (solid, crosses): where they coincide
    # both stay visible; the legend keeps the document's order
    labels = _labels(results)
    order = sorted(labels, key=lambda b: 1 if b == "paged" else 0)
    for b in order:
        ys = []
        for cap in caps:
            hit = next((_get(c, "replay", "hit_rate") for lab, c in _cells_at(results, cap) if lab == b), None)
            ys.append(float("nan") if hit is None else hit)
        if all(math.isnan(y) for y in ys):
            continue  # serving-only cells: no replay hit rate to draw
        ax.plot(caps, ys, label=b, linewidth=1.6, markersize=6, zorder=3 if b == "paged" else 2,
                **style_of(b).line_kwargs())  # fmt: skip
    bounds = results.get("bounds")
    if bounds:
        belady = BOUND_STYLES["Belady (offline)"]
        ax.plot(caps, [bounds["belady"][str(c)]["hit_rate"] for c in caps], label="Belady (offline)",
                linewidth=1.2, markersize=8, **belady.line_kwargs())  # fmt: skip
        inf = BOUND_STYLES["infinite capacity"]
        ax.axhline(bounds["infinite"]["hit_rate"], label="infinite capacity", linewidth=1.2,
                   **inf.line_kwargs(markers=False))  # fmt: skip
    ax.set_xscale("log")
    ax.set_xticks(caps, [_capacity_text(results, c, sep="\n") for c in caps])
    ax.xaxis.set_minor_locator(NullLocator())
    if len(caps) > 1:
        ax.set_xlim(caps[0] / 1.25, caps[-1] * 1.25)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(-0.02, 1.0)
    ax.set_xlabel("KV capacity per replica")
    ax.set_ylabel("prompt tokens reused (replay hit rate)")
    ax.set_title(f"{results['workload']['name']}: hit rate vs capacity")
    ax.grid(alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    rank = {b: i for i, b in enumerate([*labels, "Belady (offline)", "infinite capacity"])}
    ordered = sorted(zip(handles, names, strict=True), key=lambda hn: rank[hn[1]])
    _legend(fig, [h for h, _ in ordered], [n for _, n in ordered], "backend / bound")
    return fig


def _get(cell: dict[str, Any], section: str, key: str) -> Any:
    return cell.get(section, {}).get(key)


# -- TTFT CDF --------------------------------------------------------------------------------


def _grid(n: int) -> tuple[int, int]:
    cols = 1 if n == 1 else 2 if n <= 4 else 3
    return math.ceil(n / cols), cols


def ttft_figure(results: dict[str, Any]) -> Any | None:
    """A panel per capacity: each serving cell's TTFT CDF, on one log x axis (ms) shared
    by every panel; one legend for the figure. None when no cell has TTFTs."""
    caps = results["capacities"]
    series = {
        cap: [(lab, np.asarray(c["serving"]["ttft_quantiles"], dtype=float) * 1000.0)
              for lab, c in _cells_at(results, cap) if c.get("serving", {}).get("ttft_quantiles")]
        for cap in caps
    }  # fmt: skip
    values = [v for rows in series.values() for _, v in rows]
    if not values:
        return None
    positive = [float(v[v > 0].min()) for v in values if (v > 0).any()]
    floor = TTFT_FLOOR_MS
    if positive and min(positive) < floor:
        floor = 10 ** math.floor(math.log10(min(positive)))
    clipped = any((v <= 0).any() for v in values)
    nrows, ncols = _grid(len(caps))
    fig = _new_figure(3.2 * ncols + 1.4, 2.8 * nrows + 0.7)
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False).ravel()
    handles: dict[str, Any] = {}
    for ax, cap in zip(axes, caps, strict=False):
        for lab, ms in series[cap]:
            ys = np.linspace(0.0, 1.0, len(ms)) if len(ms) > 1 else np.ones(1)
            (line,) = ax.plot(np.maximum(ms, floor), ys, linewidth=1.5, **style_of(lab).line_kwargs(markers=False))
            handles.setdefault(lab, line)
        ax.set_title(_capacity_text(results, cap), fontsize=9)
        ax.set_xscale("log")
        ax.grid(alpha=0.35, which="major")
        ax.grid(alpha=0.12, which="minor")
    for ax in axes[len(caps) :]:
        ax.set_visible(False)
    axes[0].set_ylim(0.0, 1.02)
    fig.supxlabel("TTFT (ms, log scale, virtual clock)" + (f"; 0 drawn at {floor:g} ms" if clipped else ""), fontsize=9)
    fig.supylabel("fraction of requests", fontsize=9)
    fig.suptitle(f"{results['workload']['name']}: time to first token, queueing included", fontsize=10)
    _legend(fig, list(handles.values()), list(handles), "backend")
    return fig


# -- pages in use ----------------------------------------------------------------------------


def _smoothed(values: np.ndarray, k: int) -> np.ndarray:
    """The mean of each `k` consecutive samples, centred (shorter at the ends)."""
    if len(values) < 3:
        return values
    k = min(k, len(values))
    kernel = np.ones(k)
    return np.convolve(values, kernel, mode="same") / np.convolve(np.ones(len(values)), kernel, mode="same")


def pages_figure(results: dict[str, Any]) -> Any | None:
    """Small multiples: a row per capacity, a column per backend label; pages pinned over time
    as a share of the cell's capacity (a cluster's: every replica's pages), the 100% ceiling
    drawn; thin: each sampled step end, thick: `SMOOTH_SAMPLES`-sample mean. None when no
    cell has a timeline."""
    from matplotlib.ticker import PercentFormatter

    caps = results["capacities"]
    labels = [
        b
        for b in _labels(results)
        if any(lab == b and _get(c, "serving", "pages_timeline") for lab, c in _all(results))
    ]
    if not labels:
        return None
    # many backends wrap onto further rows of at most PAGES_MAX_COLS panels per capacity
    ncols = min(len(labels), PAGES_MAX_COLS)
    per_cap = math.ceil(len(labels) / ncols)
    nrows = len(caps) * per_cap
    width = 1.75 * ncols + 0.9
    row_height = 1.35 + (0.5 if per_cap > 1 else 0.0)  # a wrapped row has a title of its own
    fig = _new_figure(width, max(row_height * nrows + 1.0, width / 2.4))  # few capacities: taller panels, not a strip
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)
    for i, cap in enumerate(caps):
        cells = dict(_cells_at(results, cap))
        for k in range(len(labels), per_cap * ncols):  # the empty places of a wrapped row
            axes[i * per_cap + k // ncols][k % ncols].set_visible(False)
        for k, lab in enumerate(labels):
            row, j = i * per_cap + k // ncols, k % ncols
            ax = axes[row][j]
            ax.axhline(1.0, color="#555555", linestyle="--", linewidth=0.9)
            cell = cells.get(lab)
            timeline = _get(cell, "serving", "pages_timeline") if cell else None
            if timeline:
                capacity_pages = cell["num_pages"] * cell["config"].get("replicas", 1)
                t = np.array([p[0] for p in timeline], dtype=float)
                share = np.array([p[1] for p in timeline], dtype=float) / capacity_pages
                style = style_of(lab)
                ax.step(t, share, where="post", color=style.color, linewidth=0.5, alpha=0.35)
                ax.plot(t, _smoothed(share, SMOOTH_SAMPLES), color=style.color, linewidth=1.6)
            ax.grid(alpha=0.3)
            if i == 0 or per_cap > 1:
                ax.set_title(wrap_label(lab, 22), fontsize=7 if per_cap > 1 else 8, color=style_of(lab).color)
            if j == 0:
                ax.set_ylabel(_capacity_text(results, cap, sep="\n"), fontsize=7)
            ax.tick_params(labelsize=7)
    axes[0][0].yaxis.set_major_formatter(PercentFormatter(1.0))
    axes[0][0].set_ylim(0.0, 1.1)
    fig.supxlabel("time (s, virtual clock)", fontsize=9)
    fig.supylabel("pages pinned, % of capacity (dashed: the capacity)", fontsize=9)
    fig.suptitle(
        f"{results['workload']['name']}: pages pinned by running requests\n"
        f"thin: after each sampled step; thick: mean of {SMOOTH_SAMPLES} consecutive samples",
        fontsize=9,
    )
    return fig


def _all(results: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for c in results["cells"]:
        yield cell_label_of(c["config"]), c
