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
from typing import Any, ClassVar

from cachelib import create_cache, get_backend
from cachelib.errors import InvalidRequestError, UnknownBackendError
from experiments.errors import InputError
from experiments.runs.variants import OptionGiven, Variant, VariantKind, option_text, variant_label
from experiments.workloads.registry import WorkloadError, coerce_knob  # the knob rules, not a copy

__all__ = [
    "GEOMETRY",
    "BackendVariant",
    "Backends",
    "OptionGiven",
    "Variant",
    "option_parameters",
    "option_text",
    "parse_backend_opt",
    "parse_variant",
    "resolve_variants",
    "split_backend_list",
    "variant_label",
]

#: constructor parameters that are the cache's geometry, not options
GEOMETRY = ("num_pages", "page_size")
#: a text value for an option whose default is None takes the first of these in its annotation
_TEXT_KINDS: dict[str, Any] = {"int": 0, "float": 0.0, "bool": False, "str": ""}


class BackendVariant(Variant):
    """A registered backend and its non-default options (constructor order)."""


class Backends(VariantKind):
    """Backends as `--backend` and `--backend-opt` name them; a variant is tried by building a
    one-page cache at each of `page_sizes`."""

    noun: ClassVar[str] = "backend"
    flag: ClassVar[str] = "--backend"
    opt_flag: ClassVar[str] = "--backend-opt"
    not_options: ClassVar[tuple[str, ...]] = GEOMETRY
    variant_class: ClassVar[type[Variant]] = BackendVariant

    def __init__(self, page_sizes: tuple[int, ...] = ()) -> None:
        self.page_sizes = page_sizes

    def lookup(self, name: str) -> type:
        try:
            return get_backend(name)
        except UnknownBackendError as exc:
            raise InputError(str(exc)) from None

    def coerce(self, name: str, param: inspect.Parameter, value: Any) -> Any:
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

    def check(self, variant: Variant) -> None:
        for page_size in self.page_sizes:
            try:
                create_cache(variant.name, num_pages=1, page_size=page_size, **variant.options_dict())
            except InvalidRequestError as exc:
                raise InputError(f"{variant.label}: {exc}") from None


def split_backend_list(text: str) -> list[str]:
    """`"apc, radix[a=1,b=2] none"` -> `["apc", "radix[a=1,b=2]", "none"]`."""
    return Backends().split(text)


def parse_variant(spec: str) -> tuple[str, list[OptionGiven]]:
    """`radix[eviction_policy=lfu]` -> ("radix", [its options])."""
    return Backends().parse(spec)


def parse_backend_opt(text: str) -> OptionGiven:
    """`KEY=VALUE` (every selected backend) or `NAME.KEY=VALUE` (backend NAME only)."""
    return Backends().parse_opt(text)


def resolve_variants(specs: list[str], given: list[OptionGiven], page_sizes: list[int]) -> list[BackendVariant]:
    """The variants `specs` name with the options `given`, typed and checked against each
    backend before any work (a tiny cache of each is built at every page size)."""
    return Backends(tuple(page_sizes)).resolve(specs, given)  # type: ignore[return-value]


def option_parameters(name: str) -> dict[str, inspect.Parameter]:
    """Option name -> constructor parameter of backend `name`."""
    return Backends().parameters(name)


def _annotation_text(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)
