"""Cluster shapes of a grid: `--replicas N [N ...]` x `--router NAME[,NAME...]`.

A shape is a cluster size and, above one replica, a router variant. One replica has no
router (it is single-replica serving, exactly as before clusters); every size above one is
paired with every router (default: every registered router). `cells_over` expands a
template over capacities x shapes x backend variants, capacity first, so a capacity's
table lists each shape's backends together.

A router that needs KV events (`precise`, `kv_cost`) cannot run over a backend that
publishes none (`none`, `paged`). Named with `--router`, the pair is refused before any
work (`check_shapes`, through `CellConfig`); taken by default (no `--router`), the pair is
left out of the grid (`ClusterShape.pairs_with`), so `compare --replicas 4` over every
backend still runs every router each backend can serve.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachelib import available_backends, get_backend
from experiments.engine.routers.registry import ROUTERS, router_class
from experiments.errors import InputError
from experiments.runs.backend_options import BackendVariant
from experiments.runs.cell_runs import cells_for
from experiments.runs.router_options import RouterVariant, parse_router_opt, resolve_routers, split_router_list
from experiments.runs.runner import CellConfig


@dataclass(frozen=True)
class ClusterShape:
    """A cluster size and its router (None for one replica)."""

    replicas: int = 1
    router: RouterVariant | None = None
    #: False when the router came from the default list (no `--router`)
    named: bool = True

    def pairs_with(self, backend: str) -> bool:
        """Whether the grid pairs this shape with `backend`: always, except a router taken by
        default that needs KV events with a backend that publishes none."""
        if self.named or self.router is None or not router_class(self.router.name).subscribes_kv_events:
            return True
        return backend not in available_backends() or get_backend(backend).emits_kv_events

    def apply(self, cfg: CellConfig) -> CellConfig:
        """`cfg` as a cell of this shape (CellConfig checks the combination). A cluster runs
        the serving protocol only: under `both` its cell is `serving` (the replay numbers are
        the one-replica cell's, since replay has one cache); `replay` alone is refused."""
        if self.router is None:
            return dataclasses.replace(cfg, replicas=self.replicas, router=None, router_options={})
        protocol = "serving" if cfg.protocol == "both" else cfg.protocol
        return dataclasses.replace(
            cfg,
            replicas=self.replicas,
            router=self.router.name,
            router_options=self.router.options_dict(),
            protocol=protocol,
        )


#: what a grid runs without `--replicas`: single-replica serving
SINGLE = (ClusterShape(),)


def cluster_shapes(replicas: Sequence[int], routers: Sequence[str], router_opts: Sequence[str]) -> list[ClusterShape]:
    """The shapes of `--replicas`, `--router` (comma lists, variants) and `--router-opt`,
    checked before any work: a router without a cluster, an unknown router or option, a
    value of the wrong type or one the router refuses is an `InputError`."""
    sizes = list(dict.fromkeys(replicas or [1]))
    specs = [s for item in routers for s in split_router_list(item)]
    given = [parse_router_opt(text) for text in router_opts]
    if max(sizes) == 1:
        if specs or given:
            raise InputError("--router and --router-opt choose a cluster's router: add --replicas N with N > 1")
        return [ClusterShape()]
    variants = resolve_routers(specs or list(ROUTERS), given)
    named = bool(specs)
    return [ClusterShape(n, None if n == 1 else v, named) for n in sizes for v in ([None] if n == 1 else variants)]


def check_shapes(template: CellConfig, shapes: Sequence[ClusterShape], backends: Sequence[BackendVariant] = ()) -> None:
    """Each shape with the template's settings (async scheduling refuses a cluster) and with
    each backend it pairs with (a named router needing KV events refuses one that publishes
    none), before any work."""
    for shape in shapes:
        shape.apply(template)
        for variant in backends:
            if shape.pairs_with(variant.name):
                shape.apply(dataclasses.replace(template, backend=variant.name))


def left_out(shapes: Sequence[ClusterShape], variants: Sequence[BackendVariant]) -> list[str]:
    """The default router x backend pairs the grid leaves out (a KV-event router over a
    backend that publishes none), as `router over backend` lines for the user to read."""
    return [
        f"{shape.router.label} over {v.label}"  # type: ignore[union-attr]  # a left-out shape has a router
        for shape in shapes
        for v in variants
        if not shape.pairs_with(v.name)
    ]


def cells_over(
    template: CellConfig,
    variants: Sequence[BackendVariant],
    capacities: Sequence[int],
    shapes: Sequence[ClusterShape] = SINGLE,
    sizing: Mapping[int, Mapping[str, Any]] | None = None,
) -> list[CellConfig]:
    """Capacity x shape x backend variant, the rest (the page size too) as in `template`
    (`sizing`: how each capacity was given, see `cell_runs.cells_for`)."""
    return [
        cell
        for cap in capacities
        for shape in shapes
        for cell in cells_for(shape.apply(template), [v for v in variants if shape.pairs_with(v.name)], [cap], sizing)
    ]
