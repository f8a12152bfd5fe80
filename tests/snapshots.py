"""A deep, backend-agnostic picture of a cache's state, for "a failed call changes nothing".

`stats()` can stay equal while a free list is reordered, a lock count moves between two
nodes, or a table gains a page; comparing it proves little. `deep_state(obj)` walks the whole
object graph reachable from `obj` (the cache, and the sequences a call was given): every
attribute of every object (slots and `__dict__`), the *order* of lists, dicts and queues,
array contents, and which references point at the same object. Two pictures are equal iff
the graphs are the same shape with the same values, so any change a failed call made,
anywhere, shows up. It is generic on purpose: a backend added later (or a field added to
one) is covered without touching this file.

Objects are numbered in breadth-first order of first reference (no recursion through the
links of long chains like the free-block queue); containers are encoded inline.
"""

from __future__ import annotations

import types
from collections import deque
from functools import partial
from typing import Any

import numpy as np
from sortedcontainers import SortedList

#: scratch that is not state: a memo of a pure function of the sequence's tokens (apc's
#: block hashes, radix's last match), which a refused call may extend without changing
#: anything observable, and `Sequence._view` and `Sequence._ro`, the read-only views
#: `tokens` makes once (per length, per buffer)
SKIP_ATTRS = frozenset({"cache_memo", "_view", "_ro"})

_ATOMS = (type(None), bool, int, float, str, bytes)
_FUNCS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.BuiltinMethodType, partial)


_NAMES: dict[type, list[str]] = {}


def _attr_names(cls: type) -> list[str]:
    names = _NAMES.get(cls)
    if names is None:
        slots: list[str] = []
        for klass in reversed(cls.__mro__):
            own = klass.__dict__.get("__slots__", ())
            slots.extend([own] if isinstance(own, str) else own)
        skip = {"__dict__", "__weakref__"} | SKIP_ATTRS
        names = _NAMES[cls] = [n for n in dict.fromkeys(slots) if n not in skip]
    return names


def deep_state(root: Any) -> tuple:
    """The state graph reachable from `root` as nested tuples (compare two with `==`)."""
    numbers: dict[int, int] = {}
    pending: deque = deque()
    alive: list = []  # keeps every visited object alive, so `id`s stay unique during the walk
    atoms = set(_ATOMS)

    def enc(x: Any) -> Any:
        t = type(x)
        if t in atoms:
            return x
        if t is list or t is tuple:
            return (t.__name__, tuple([enc(v) for v in x]))
        if t is dict:
            return ("dict", tuple([(enc(k), enc(v)) for k, v in x.items()]))
        if isinstance(x, np.ndarray):
            return ("nd", x.dtype.str, x.shape, x.tobytes())
        if isinstance(x, np.generic):
            return ("np", x.item())
        if isinstance(x, _ATOMS):  # subclasses (an IntEnum, a str subclass)
            return (t.__name__, x)
        if isinstance(x, (list, tuple)):  # NamedTuples, list subclasses
            return (t.__name__, tuple([enc(v) for v in x]))
        if isinstance(x, dict):
            return (t.__name__, tuple([(enc(k), enc(v)) for k, v in x.items()]))
        if isinstance(x, (set, frozenset)):
            return ("set", tuple(sorted(map(repr, (enc(v) for v in x)))))
        if isinstance(x, SortedList):
            return ("sorted", tuple([enc(v) for v in x]))  # its order, not its lazy index
        if isinstance(x, deque):
            return ("deque", tuple([enc(v) for v in x]))
        if isinstance(x, _FUNCS):
            return ("fn", getattr(x, "__qualname__", repr(x)), enc(getattr(x, "__self__", None)))
        k = numbers.get(id(x))
        if k is None:
            k = numbers[id(x)] = len(numbers)
            alive.append(x)
            pending.append(x)
        return ("obj", k)

    out = [enc(root)]
    while pending:
        obj = pending.popleft()
        names = _attr_names(type(obj))
        d = getattr(obj, "__dict__", None)
        if d:
            names = names + sorted(n for n in d if n not in SKIP_ATTRS)
        if not names:  # an opaque object (a sentinel, an iterator): its repr is all there is
            out.append((type(obj).__name__, repr(obj)))
            continue
        out.append((type(obj).__name__, tuple([(n, enc(getattr(obj, n, "<unset>"))) for n in names])))
    return tuple(out)


def first_difference(a: tuple, b: tuple) -> str:
    """Where two `deep_state` pictures first differ (for assertion messages)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"object #{i - 1}: {str(x)[:300]} != {str(y)[:300]}"
    return f"lengths {len(a)} != {len(b)}"
