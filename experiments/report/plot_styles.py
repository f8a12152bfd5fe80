"""One colour, line style and marker per backend label, the same in every figure of every report.

A style follows from the label alone, never from its position in a run's list: `radix-aged`
is drawn the same whether it is the second backend of a comparison or the fifth. The
project's backends have fixed styles (`BACKEND_STYLES`, Okabe–Ito colours, which stay
distinct for colour-blind readers and in greyscale by their dashes and markers). `none`
and `paged` often coincide (a workload that declares no prefix): they differ in colour,
dash *and* marker, so both stay visible when one lies on the other.

Any other label (a backend variant `radix[eviction_policy=lfu]`, a cluster `apc ×8
cache_aware`, a backend registered by a user) keeps its base backend's marker and takes a
colour and dash from a digest of the whole label (`hashlib`, not Python's salted `hash`),
so it too is the same in every report; the colours of such labels avoid the fixed ones.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Style:
    """How a label is drawn: a matplotlib colour, dash pattern and marker."""

    color: str
    linestyle: str | tuple[int, tuple[int, ...]]
    marker: str
    #: a hollow marker (no face) so a marker drawn beneath it shows through
    hollow: bool = False

    def line_kwargs(self, *, markers: bool = True) -> dict[str, Any]:
        """Keyword arguments for `Axes.plot`."""
        out: dict[str, Any] = {"color": self.color, "linestyle": self.linestyle}
        if markers:
            out["marker"] = self.marker
            if self.hollow:
                out["markerfacecolor"] = "none"
        return out


#: the project's backends (cachelib.available_backends()): fixed, whatever a run lists
BACKEND_STYLES: dict[str, Style] = {
    "none": Style("#000000", "-", "x"),
    "apc": Style("#0072B2", "-", "o"),
    "radix": Style("#E69F00", "--", "^"),
    "paged": Style("#CC79A7", (0, (1, 1)), "s", hollow=True),
    "radix-aged": Style("#009E73", "-.", "D"),
    "radix-hicache": Style("#882255", (0, (5, 1, 1, 1)), "v"),  # radix with SGLang's host tier (Tol's wine)
    "apc-lmcache": Style("#44AA99", (0, (3, 1, 1, 1, 1, 1)), "P"),  # apc with LMCache's host and disk (Tol's teal)
}
#: the bounds drawn beside the backends
BOUND_STYLES: dict[str, Style] = {
    "Belady (offline)": Style("#555555", ":", "*"),
    "infinite capacity": Style("#555555", "--", ""),
}
#: colours for labels without a fixed style: tab10's, less those too close to the fixed ones
_EXTRA_COLORS = ("#D55E00", "#56B4E9", "#8C564B", "#7F7F7F", "#BCBD22", "#9467BD", "#17BECF", "#F0E442")
_EXTRA_DASHES: tuple[str | tuple[int, tuple[int, ...]], ...] = (
    "-", "--", "-.", (0, (5, 1)), (0, (3, 1, 1, 1)), (0, (1, 2)),
)  # fmt: skip
_EXTRA_MARKERS = ("v", "P", "h", "<", ">", "p")
#: the base backend of a label: its name before options (`[`) or a cluster's size (` ×`)
_BASE = re.compile(r"^[^\[\s×]+")


def base_backend(label: str) -> str:
    """`radix[eviction_policy=lfu]` -> `radix`; `apc ×8 cache_aware` -> `apc`."""
    m = _BASE.match(label)
    return m.group(0) if m else label


def style_of(label: str) -> Style:
    """The style of `label` (see the module docstring): fixed for the project's backends
    and bounds, derived from the label's digest for anything else."""
    if label in BACKEND_STYLES:
        return BACKEND_STYLES[label]
    if label in BOUND_STYLES:
        return BOUND_STYLES[label]
    digest = int.from_bytes(hashlib.sha256(label.encode()).digest()[:8], "big")
    color = _EXTRA_COLORS[digest % len(_EXTRA_COLORS)]
    dash = _EXTRA_DASHES[(digest // len(_EXTRA_COLORS)) % len(_EXTRA_DASHES)]
    base = BACKEND_STYLES.get(base_backend(label))
    if base is not None:
        return Style(color, dash, base.marker, base.hollow)
    marker = _EXTRA_MARKERS[(digest // (len(_EXTRA_COLORS) * len(_EXTRA_DASHES))) % len(_EXTRA_MARKERS)]
    return Style(color, dash, marker)
