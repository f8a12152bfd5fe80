"""The routers by name, and their options: `--router NAME[,NAME...]`, `--router-opt KEY=VALUE`.

A router's options are the keyword parameters of its constructor after `num_replicas`,
typed from their defaults by the knob rules (experiments/workloads/registry.py, as backend
options are): `--router-opt KEY=VALUE` goes to every selected router, and each must take it;
`--router-opt NAME.KEY=VALUE` to router NAME only; `--router 'NAME[KEY=VALUE,...]'` is a
variant, those options for that entry only (`--router 'cache_aware,cache_aware[cache_threshold=0.5]'`
compares two). The more specific wins. An unknown router or option, a value of the wrong
type or one the router refuses is an `InputError` before any work, naming the options the
router takes. Options equal to the default are dropped, so a variant's label names what
differs.
"""

from __future__ import annotations

import inspect
from typing import Any

from experiments.engine.routers.affinity import ConsistentHash, Session
from experiments.engine.routers.base import Router
from experiments.engine.routers.cache_aware import CacheAware
from experiments.engine.routers.kv_cost import KvCost
from experiments.engine.routers.load import LeastLoad, PowerOfTwo, RandomRouter, RoundRobin
from experiments.engine.routers.precise import Precise
from experiments.errors import InputError, UsageError
from experiments.runs.backend_options import OptionGiven, Variant, variant_label
from experiments.workloads.registry import WorkloadError, coerce_knob

#: every router, by `--router` name, in the order `--router` lists default to
ROUTERS: dict[str, type[Router]] = {
    cls.name: cls
    for cls in (RoundRobin, RandomRouter, LeastLoad, PowerOfTwo, ConsistentHash, Session, CacheAware, Precise, KvCost)
}


class RouterVariant(Variant):
    """A registered router and its non-default options (constructor order)."""


#: `name`, or `name[k=v,...]` as `--router` takes it (the backends' label rule)
router_label = variant_label


def router_class(name: str) -> type[Router]:
    try:
        return ROUTERS[name]
    except KeyError:
        raise InputError(f"unknown router {name!r}; choose one of: {', '.join(ROUTERS)}") from None


def option_parameters(name: str) -> dict[str, inspect.Parameter]:
    """Option name -> constructor parameter of router `name`."""
    params = inspect.signature(router_class(name)).parameters
    return {
        k: p for k, p in params.items() if k != "num_replicas" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def make_router(name: str, num_replicas: int, options: dict[str, Any] | None = None) -> Router:
    """Router `name` for `num_replicas` replicas; a refused option is an `InputError`."""
    cls = router_class(name)
    try:
        return cls(num_replicas, **(options or {}))
    except ValueError as exc:
        raise InputError(f"router {name!r}: {exc}") from None


def split_router_list(text: str) -> list[str]:
    """`"round_robin, cache_aware[a=1,b=2]"` -> `["round_robin", "cache_aware[a=1,b=2]"]`."""
    items, current, depth = [], "", 0
    for ch in text:
        if ch in ", " and depth == 0:
            items.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise UsageError(f"--router {text!r}: unbalanced brackets")
        current += ch
    if depth:
        raise UsageError(f"--router {text!r}: unbalanced brackets")
    return [item for item in [*items, current] if item]


def parse_router_opt(text: str) -> OptionGiven:
    """`KEY=VALUE` (every selected router) or `NAME.KEY=VALUE` (router NAME only)."""
    left, eq, value = text.partition("=")
    target, dot, key = left.strip().rpartition(".")
    if not eq or not key or (dot and not target):
        raise UsageError(f"--router-opt expects KEY=VALUE or ROUTER.KEY=VALUE, got {text!r}")
    return OptionGiven(key, value.strip(), f"--router-opt {text}", target or None)


def resolve_routers(specs: list[str], given: list[OptionGiven]) -> list[RouterVariant]:
    """The variants `specs` name with the options `given`, typed and checked (each router is
    built once) before any work."""
    parsed = [_parse_variant(s) for s in specs]
    names = [name for name, _ in parsed]
    for name in names:
        router_class(name)
    for opt in given:
        if opt.target is not None and opt.target not in names:
            raise InputError(f"{opt.source}: router {opt.target!r} is not selected ({', '.join(names)})")
    variants = []
    for name, own in parsed:
        chosen = [g for g in given if g.target is None] + [g for g in given if g.target == name] + own
        variant = _variant(name, chosen)
        make_router(variant.name, 2, variant.options_dict())  # a value it refuses fails now
        variants.append(variant)
    labels = [v.label for v in variants]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise UsageError(f"--router names the same variant twice: {', '.join(twice)}")
    return variants


def _parse_variant(spec: str) -> tuple[str, list[OptionGiven]]:
    name, bracket, rest = spec.partition("[")
    if not bracket:
        return spec, []
    if not rest.endswith("]") or not name:
        raise UsageError(f"--router {spec!r}: expected NAME or NAME[KEY=VALUE,...]")
    given = []
    for item in (x.strip() for x in rest[:-1].split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--router {spec!r}: expected NAME[KEY=VALUE,...], got {item!r}")
        given.append(OptionGiven(key.strip(), value.strip(), f"--router {spec}", name))
    return name, given


def _variant(name: str, chosen: list[OptionGiven]) -> RouterVariant:
    params = option_parameters(name)
    values: dict[str, Any] = {}
    for opt in chosen:
        if opt.key not in params:
            takes = ", ".join(params) or "no options"
            raise InputError(f"router {name!r} does not take {opt.source} (option {opt.key}); it takes: {takes}")
        values[opt.key] = _coerce(name, params[opt.key], opt.value)
    ordered = tuple((k, values[k]) for k in params if k in values and values[k] != params[k].default)
    return RouterVariant(name, ordered)


def _coerce(name: str, param: inspect.Parameter, value: Any) -> Any:
    """A text value converted to the type of the option's default (every router option has
    one); a value already typed is checked against it."""
    default = param.default
    try:
        typed = coerce_knob(name, param.name, value, default)
    except WorkloadError:
        raise InputError(
            f"router {name!r}: option {param.name} expects {type(default).__name__}, got {value!r}"
        ) from None
    if isinstance(default, float) and isinstance(typed, int) and not isinstance(typed, bool):
        typed = float(typed)
    if type(typed) is not type(default):
        raise InputError(f"router {name!r}: option {param.name} expects {type(default).__name__}, got {value!r}")
    return typed
