"""Backend options: `--backend-opt KEY=VALUE`, its aliases, and backend variants.

A backend's options are the keyword parameters of its constructor (besides `num_pages` and
`page_size`); a value given as text is converted by the rules of workload knobs
(experiments/workloads/registry.py: to the type of the default, `"true"` a bool, `"inf"` a
float), and where the default is `None`, to the first of `int`, `float`, `bool`, `str` in the
annotation (`none` is `None` where the annotation allows it). Where an option goes:

- `--backend-opt KEY=VALUE` (or an alias: `--eviction-policy`, `--hash-algorithm`,
  `--verify-tokens`) goes to every selected backend, and each must take it;
- `--backend-opt NAME.KEY=VALUE` goes to backend NAME only (which must be selected);
- `--backend 'radix[eviction_policy=lfu,admission_eviction=extend]'` is a *variant*: those
  options for that entry of the list only, so `--backend 'radix,radix[eviction_policy=lfu]'`
  compares two variants of one backend side by side.
The more specific wins: a variant's own options over `NAME.KEY`, over `KEY`. An option the
backend does not take, a value of the wrong type or one the backend refuses is an
`InputError` before any work. Options equal to the default are dropped, so a variant's
label (`radix[eviction_policy=lfu]`: its name and non-default options, in the constructor's
order, as they would be written in `--backend`) names what differs, and two spellings of
one configuration are one variant.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from cachelib import create_cache, get_backend
from cachelib.errors import InvalidRequestError, UnknownBackendError
from experiments.errors import InputError, UsageError
from experiments.workloads.registry import WorkloadError, coerce_knob  # the knob rules, not a copy

#: constructor parameters that are the cache's geometry, not options
GEOMETRY = ("num_pages", "page_size")
#: a text value for an option whose default is None takes the first of these in its annotation
_TEXT_KINDS: dict[str, Any] = {"int": 0, "float": 0.0, "bool": False, "str": ""}


@dataclass(frozen=True)
class OptionGiven:
    """One option as the user wrote it; `target` is a backend name, or None for every backend."""

    key: str
    value: Any
    source: str  # how it was written, for errors: `--eviction-policy`, `--backend-opt k=v`
    target: str | None = None


@dataclass(frozen=True)
class Variant:
    """A registered name (a backend, a router) and its non-default options (constructor order)."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return variant_label(self.name, dict(self.options))

    def options_dict(self) -> dict[str, Any]:
        return dict(self.options)


class BackendVariant(Variant):
    """A registered backend and its non-default options (constructor order)."""


def variant_label(name: str, options: dict[str, Any]) -> str:
    """`name`, or `name[k=v,...]` with the options as `--backend` and `--router` take them."""
    if not options:
        return name
    return f"{name}[{','.join(f'{k}={option_text(v)}' for k, v in options.items())}]"


def option_text(value: Any) -> str:
    """A value as it is written on the command line (`true`, `none`, `inf`, `lfu`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)


def split_backend_list(text: str) -> list[str]:
    """`"apc, radix[a=1,b=2] none"` -> `["apc", "radix[a=1,b=2]", "none"]` (commas inside
    brackets belong to the variant)."""
    items, current, depth = [], "", 0
    for ch in text:
        if ch in ", " and depth == 0:
            items.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise UsageError(f"--backend {text!r}: unbalanced brackets")
        current += ch
    if depth:
        raise UsageError(f"--backend {text!r}: unbalanced brackets")
    return [item for item in [*items, current] if item]


def parse_variant(spec: str) -> tuple[str, list[OptionGiven]]:
    """`radix[eviction_policy=lfu]` -> ("radix", [its options])."""
    name, bracket, rest = spec.partition("[")
    if not bracket:
        return spec, []
    if not rest.endswith("]") or not name:
        raise UsageError(f"--backend {spec!r}: expected NAME or NAME[KEY=VALUE,...]")
    given = []
    for item in (x.strip() for x in rest[:-1].split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--backend {spec!r}: expected NAME[KEY=VALUE,...], got {item!r}")
        given.append(OptionGiven(key.strip(), value.strip(), f"--backend {spec}", name))
    return name, given


def parse_backend_opt(text: str) -> OptionGiven:
    """`KEY=VALUE` (every selected backend) or `NAME.KEY=VALUE` (backend NAME only)."""
    left, eq, value = text.partition("=")
    target, dot, key = left.strip().rpartition(".")
    if not eq or not key or (dot and not target):
        raise UsageError(f"--backend-opt expects KEY=VALUE or BACKEND.KEY=VALUE, got {text!r}")
    return OptionGiven(key, value.strip(), f"--backend-opt {text}", target or None)


def resolve_variants(specs: list[str], given: list[OptionGiven], page_sizes: list[int]) -> list[BackendVariant]:
    """The variants `specs` name with the options `given`, typed and checked against each
    backend before any work (a tiny cache of each is built at every page size)."""
    parsed = [parse_variant(s) for s in specs]
    names = [name for name, _ in parsed]
    for name in names:
        _backend_class(name)
    for opt in given:
        if opt.target is not None and opt.target not in names:
            raise InputError(f"{opt.source}: backend {opt.target!r} is not selected ({', '.join(names)})")
    variants = []
    for name, own in parsed:
        chosen = [g for g in given if g.target is None] + [g for g in given if g.target == name] + own
        variant = _variant(name, chosen)
        for page_size in page_sizes:
            _try_build(variant, page_size)
        variants.append(variant)
    labels = [v.label for v in variants]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise UsageError(f"--backend names the same variant twice: {', '.join(twice)}")
    return variants


def option_parameters(name: str) -> dict[str, inspect.Parameter]:
    """Option name -> constructor parameter of backend `name`."""
    params = inspect.signature(_backend_class(name)).parameters
    return {
        k: p for k, p in params.items() if k not in GEOMETRY and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def _backend_class(name: str) -> type:
    try:
        return get_backend(name)
    except UnknownBackendError as exc:
        raise InputError(str(exc)) from None


def _variant(name: str, chosen: list[OptionGiven]) -> BackendVariant:
    params = option_parameters(name)
    values: dict[str, Any] = {}
    for opt in chosen:
        if opt.key not in params:
            takes = ", ".join(params) or "no options"
            raise InputError(f"backend {name!r} does not take {opt.source} (option {opt.key}); it takes: {takes}")
        values[opt.key] = _coerce(name, params[opt.key], opt.value)
    ordered = tuple((k, values[k]) for k in params if k in values and values[k] != params[k].default)
    return BackendVariant(name, ordered)


def _coerce(name: str, param: inspect.Parameter, value: Any) -> Any:
    """A text value converted by the knob rules; a typed value (a flag's bool) as given."""
    if not isinstance(value, str):
        return value
    annotation = _annotation_text(param.annotation)
    kinds = [k.strip() for k in annotation.split("|")]
    if "None" in kinds and value.strip().lower() == "none":
        return None
    default = param.default
    if default is None or default is param.empty:
        default = next((_TEXT_KINDS[k] for k in kinds if k in _TEXT_KINDS), None)
        if default is None:
            raise InputError(f"backend {name!r}: option {param.name} ({annotation}) cannot be given as text")
    try:
        return coerce_knob(name, param.name, value, default)
    except WorkloadError:
        expected = annotation or type(default).__name__
        raise InputError(f"backend {name!r}: option {param.name} expects {expected}, got {value!r}") from None


def _annotation_text(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def _try_build(variant: BackendVariant, page_size: int) -> None:
    """Build a one-page cache: a value the backend refuses fails now, not inside a cell."""
    try:
        create_cache(variant.name, num_pages=1, page_size=page_size, **variant.options_dict())
    except InvalidRequestError as exc:
        raise InputError(f"{variant.label}: {exc}") from None
