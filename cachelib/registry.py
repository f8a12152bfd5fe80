"""Backend registry: `--backend NAME` -> a `PrefixCache` class.

The built-in backends are named here and imported on first use, so importing `cachelib`
stays cheap. A new backend registers itself with `@register_backend("name")` in its module
and becomes available to the CLI, the property tests and the equivalence tests once that
module is imported (or listed in `BUILTIN_BACKENDS`).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from cachelib.errors import InvalidRequestError, UnknownBackendError
from cachelib.interface import PrefixCache

#: name -> module that registers it when imported
BUILTIN_BACKENDS: dict[str, str] = {
    "none": "backends.none",
    "apc": "backends.apc",
    "radix": "backends.radix",
    "paged": "backends.paged",
    "radix-aged": "backends.radix_aged",
    "radix-hicache": "backends.radix_hicache",
    "apc-lmcache": "backends.apc_lmcache",
}

_registry: dict[str, type[PrefixCache]] = {}


def register_backend(name: str):
    """Class decorator: make `cls` available as `--backend name`."""

    def deco(cls: type[PrefixCache]) -> type[PrefixCache]:
        if not (isinstance(cls, type) and issubclass(cls, PrefixCache)):
            raise TypeError(f"{cls!r} does not implement PrefixCache")
        existing = _registry.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"backend {name!r} is already registered to {existing.__qualname__}")
        cls.name = name
        _registry[name] = cls
        return cls

    return deco


def available_backends() -> list[str]:
    """Every backend name that `create_cache` accepts, built-ins first."""
    names = list(BUILTIN_BACKENDS)
    names += sorted(n for n in _registry if n not in BUILTIN_BACKENDS)
    return names


def default_backends() -> list[str]:
    """The backends a comparison runs when none is named: every registered one whose class
    says `compared_by_default` (a tiered design holds KV beyond the GPU capacity the others
    get, so it is compared only when named)."""
    return [n for n in available_backends() if get_backend(n).compared_by_default]


def get_backend(name: str) -> type[PrefixCache]:
    """The class registered as `name`; `UnknownBackendError` lists the choices otherwise."""
    cls = _registry.get(name)
    if cls is None and name in BUILTIN_BACKENDS:
        importlib.import_module(BUILTIN_BACKENDS[name])
        cls = _registry.get(name)
    if cls is None:
        raise UnknownBackendError(f"unknown backend {name!r}; choose one of {', '.join(available_backends())}")
    return cls


def create_cache(name: str, *, num_pages: int, page_size: int, **options: Any) -> PrefixCache:
    """Instantiate backend `name` over `num_pages` pages of `page_size` tokens.

    An option the backend does not take is an `InvalidRequestError` naming the ones it
    does (not a `TypeError` from deep inside a constructor)."""
    cls = get_backend(name)
    try:
        inspect.signature(cls).bind(num_pages=num_pages, page_size=page_size, **options)
    except TypeError as exc:
        accepted = [p for p in inspect.signature(cls).parameters if p not in ("num_pages", "page_size")]
        raise InvalidRequestError(f"backend {name!r}: {exc}; its options are {', '.join(accepted) or 'none'}") from None
    return cls(num_pages=num_pages, page_size=page_size, **options)
