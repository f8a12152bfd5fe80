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
from typing import Any, ClassVar

from experiments.engine.routers.registry import make_router, router_class
from experiments.errors import InputError
from experiments.runs.variants import OptionGiven, Variant, VariantKind, variant_label
from experiments.workloads.registry import WorkloadError, coerce_knob

#: `name`, or `name[k=v,...]` as `--router` takes it (the backends' label rule)
router_label = variant_label


class RouterVariant(Variant):
    """A registered router and its non-default options (constructor order)."""


#: `name`, or `name[k=v,...]` as `--router` takes it (the backends' label rule)
router_label = variant_label


class Routers(VariantKind):
    """Routers as `--router` and `--router-opt` name them; a variant is tried by building it
    for two replicas."""

    noun: ClassVar[str] = "router"
    flag: ClassVar[str] = "--router"
    opt_flag: ClassVar[str] = "--router-opt"
    not_options: ClassVar[tuple[str, ...]] = ("num_replicas",)
    variant_class: ClassVar[type[Variant]] = RouterVariant

    def lookup(self, name: str) -> type:
        return router_class(name)

    def coerce(self, name: str, param: inspect.Parameter, value: Any) -> Any:
        """A text value converted to the type of the option's default (every router option
        has one); a value already typed is checked against it."""
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

    def check(self, variant: Variant) -> None:
        make_router(variant.name, 2, variant.options_dict())


def option_parameters(name: str) -> dict[str, inspect.Parameter]:
    """Option name -> constructor parameter of router `name`."""
    return Routers().parameters(name)


def split_router_list(text: str) -> list[str]:
    """`"round_robin, cache_aware[a=1,b=2]"` -> `["round_robin", "cache_aware[a=1,b=2]"]`."""
    return Routers().split(text)


def parse_router_opt(text: str) -> OptionGiven:
    """`KEY=VALUE` (every selected router) or `NAME.KEY=VALUE` (router NAME only)."""
    return Routers().parse_opt(text)


def resolve_routers(specs: list[str], given: list[OptionGiven]) -> list[RouterVariant]:
    """The variants `specs` name with the options `given`, typed and checked (each router is
    built once) before any work."""
    return Routers().resolve(specs, given)  # type: ignore[return-value]
