"""`NAME[KEY=VALUE,...]`: a registered class (a backend, a router) and its options, written once.

A backend's or a router's options are the keyword parameters of its constructor (less those
that are not options: a cache's geometry, a router's replica count). `--backend` and
`--router` take a list of names, each optionally with options in brackets (a *variant*);
`--backend-opt` and `--router-opt` take `KEY=VALUE` for every selected one, or
`NAME.KEY=VALUE` for one. The more specific wins: a variant's own options over `NAME.KEY`,
over `KEY`. An unknown name or option, a value of the wrong type or one the class refuses is
an `InputError` before any work. Options equal to the default are dropped, so a variant's
label (`radix[eviction_policy=lfu]`: its name and non-default options in the constructor's
order, as they would be written) names what differs, and two spellings of one configuration
are one variant.

What differs between backends and routers (which class a name is, how a text value is
typed, how a variant is tried) is a `VariantKind`'s; the parsing and resolving here is the
same for both.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from experiments.errors import InputError, UsageError


@dataclass(frozen=True)
class OptionGiven:
    """One option as the user wrote it; `target` is a name, or None for every selected one."""

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


class VariantKind(ABC):
    """What a kind of registered class (backends, routers) says about its names and options."""

    #: what the kind is called in errors, its list flag and its option flag
    noun: ClassVar[str]
    flag: ClassVar[str]
    opt_flag: ClassVar[str]
    #: constructor parameters that are not options
    not_options: ClassVar[tuple[str, ...]]
    variant_class: ClassVar[type[Variant]] = Variant

    @abstractmethod
    def lookup(self, name: str) -> type:
        """The class registered as `name`; an `InputError` naming the choices otherwise."""

    @abstractmethod
    def coerce(self, name: str, param: inspect.Parameter, value: Any) -> Any:
        """Option `param` of `name` given `value` (text, or already typed), typed."""

    @abstractmethod
    def check(self, variant: Variant) -> None:
        """Build `variant` small: a value the class refuses is an `InputError` now."""

    def parameters(self, name: str) -> dict[str, inspect.Parameter]:
        """Option name -> constructor parameter of `name`."""
        params = inspect.signature(self.lookup(name)).parameters
        return {
            k: p
            for k, p in params.items()
            if k not in self.not_options and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        }

    def split(self, text: str) -> list[str]:
        """`"apc, radix[a=1,b=2] none"` -> `["apc", "radix[a=1,b=2]", "none"]` (commas inside
        brackets belong to the variant)."""
        items, current, depth = [], "", 0
        for ch in text:
            if ch in ", " and depth == 0:
                items.append(current)
                current = ""
                continue
            depth += {"[": 1, "]": -1}.get(ch, 0)
            if depth not in (0, 1):
                raise UsageError(f"{self.flag} {text!r}: unbalanced brackets")
            current += ch
        if depth:
            raise UsageError(f"{self.flag} {text!r}: unbalanced brackets")
        return [item for item in [*items, current] if item]

    def parse(self, spec: str) -> tuple[str, list[OptionGiven]]:
        """`radix[eviction_policy=lfu]` -> ("radix", [its options])."""
        name, bracket, rest = spec.partition("[")
        if not bracket:
            return spec, []
        if not rest.endswith("]") or not name:
            raise UsageError(f"{self.flag} {spec!r}: expected NAME or NAME[KEY=VALUE,...]")
        given = []
        for item in (x.strip() for x in rest[:-1].split(",")):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise UsageError(f"{self.flag} {spec!r}: expected NAME[KEY=VALUE,...], got {item!r}")
            given.append(OptionGiven(key.strip(), value.strip(), f"{self.flag} {spec}", name))
        return name, given

    def parse_opt(self, text: str) -> OptionGiven:
        """`KEY=VALUE` (every selected one) or `NAME.KEY=VALUE` (NAME only)."""
        left, eq, value = text.partition("=")
        target, dot, key = left.strip().rpartition(".")
        if not eq or not key or (dot and not target):
            raise UsageError(f"{self.opt_flag} expects KEY=VALUE or {self.noun.upper()}.KEY=VALUE, got {text!r}")
        return OptionGiven(key, value.strip(), f"{self.opt_flag} {text}", target or None)

    def resolve(self, specs: list[str], given: list[OptionGiven]) -> list[Variant]:
        """The variants `specs` name with the options `given`, typed and each tried
        (`check`) before any work."""
        parsed = [self.parse(s) for s in specs]
        names = [name for name, _ in parsed]
        for name in names:
            self.lookup(name)
        for opt in given:
            if opt.target is not None and opt.target not in names:
                raise InputError(f"{opt.source}: {self.noun} {opt.target!r} is not selected ({', '.join(names)})")
        variants = []
        for name, own in parsed:
            chosen = [g for g in given if g.target is None] + [g for g in given if g.target == name] + own
            variant = self.variant(name, chosen)
            self.check(variant)
            variants.append(variant)
        labels = [v.label for v in variants]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise UsageError(f"{self.flag} names the same variant twice: {', '.join(twice)}")
        return variants

    def variant(self, name: str, chosen: list[OptionGiven]) -> Variant:
        """`name` with the options `chosen` (later ones win), typed; defaults dropped."""
        params = self.parameters(name)
        values: dict[str, Any] = {}
        for opt in chosen:
            if opt.key not in params:
                takes = ", ".join(params) or "no options"
                raise InputError(
                    f"{self.noun} {name!r} does not take {opt.source} (option {opt.key}); it takes: {takes}"
                )
            values[opt.key] = self.coerce(name, params[opt.key], opt.value)
        ordered = tuple((k, values[k]) for k in params if k in values and values[k] != params[k].default)
        return self.variant_class(name, ordered)
