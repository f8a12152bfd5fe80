"""Each replica's KV capacity, given one way: in tokens, in GB, or from the device and model.

- `--capacity-tokens T`: T tokens; the cache holds `T // page size` pages (as before).
- `--capacity-gb G`: `G × 10**9` bytes of KV; `G × 10**9 // page bytes` pages, a page's bytes
  being the model's KV bytes per token × the page size.
- `--gpu-memory-utilization U`: as vLLM sizes its KV cache (`Worker.determine_available_memory`
  in `vllm/v1/worker/gpu_worker.py`, `get_num_blocks` in `vllm/v1/core/kv_cache_utils.py`:
  `available // page bytes per layer // layers`): a share U of the device's memory, minus
  what the model takes besides, in whole pages. vLLM measures "besides" with a profiling
  run (weights, the peak of a dummy forward's activations, CUDA graphs, memory outside
  torch); here it is the weights alone, every parameter × its bytes (`ModelShape.
  weight_bytes`). A simplification: the capacity is overstated by what activations, graphs
  and the CUDA context take on a real run (a few GB for an 8B model).

- `--capacity-fraction F`: F × the workload's working set, as libCacheSim sizes a cache
  (`cache_size = working set × ratio`): the working set is the workload's distinct full
  pages at the run's page size (what an unlimited cache would hold at the end of the replay,
  `oracle.page_keys(...).num_keys`), and the capacity `max(1, floor(F × pages))` pages. Every
  workload's sweep then lands on the same part of its hit-rate curve, whatever its size.
  Resolved before any work, once the workload is built.

Capacities given in GB, by utilisation or as a fraction are whole pages: `pages × page size` tokens. A run
gives them one way only (`CapacityGiven`); a cell records how (`CellConfig.capacity_gb` /
`gpu_memory_utilization`) and its result carries `kv_capacity`: tokens, pages, bytes, GB.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from attention.config import PRESETS
from experiments.bounds.oracle import page_keys
from experiments.engine.executors import DEVICE_PROFILES, ModelShape, llama3_8b_shape
from experiments.errors import InputError
from experiments.workloads.generators import Workload

#: bytes in a GB, as `--capacity-gb` and the device datasheets count them
GB = 10**9
#: the ways a capacity is given, as CellConfig fields (`tokens`: `capacity_tokens` alone)
WAYS = ("tokens", "capacity_gb", "gpu_memory_utilization", "capacity_fraction")
#: the flag of each way, for errors
FLAGS = {
    "tokens": "--capacity-tokens",
    "capacity_gb": "--capacity-gb",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "capacity_fraction": "--capacity-fraction",
}


class SizingError(InputError, ValueError):
    """A capacity that cannot be sized: a device with no memory size, weights that do not
    fit, two ways at once, or two values that give the same capacity."""


def model_shape(name: str) -> ModelShape:
    """The shape of model `name` (`llama3-8b`'s own; others from `attention.config.PRESETS`, no torch)."""
    if name == "llama3-8b":
        return llama3_8b_shape()
    if name not in PRESETS:
        raise SizingError(f"unknown model {name!r}; choose one of: {', '.join(PRESETS)}")
    return ModelShape.from_config(PRESETS[name])


@dataclass(frozen=True)
class KvSizing:
    """How many bytes a token's KV takes for a model, and what a device leaves for it."""

    shape: ModelShape
    page_size: int

    @property
    def page_bytes(self) -> int:
        return self.shape.kv_bytes_per_token * self.page_size

    def pages_in(self, kv_bytes: int) -> int:
        """Whole pages in `kv_bytes` bytes."""
        return kv_bytes // self.page_bytes

    def tokens_for_gb(self, gb: float) -> int:
        """Tokens (whole pages) in `gb` × 10**9 bytes."""
        return self.pages_in(math.floor(gb * GB)) * self.page_size

    def kv_bytes_on(self, device: str, utilization: float) -> int:
        """Bytes left for KV on `device` at `utilization`: `floor(U × memory) − weights`."""
        memory = DEVICE_PROFILES[device].memory_bytes
        if memory is None:
            raise SizingError(
                f"device {device!r} has no memory size, so --gpu-memory-utilization cannot size its KV cache; "
                "give --capacity-tokens or --capacity-gb"
            )
        share = math.floor(utilization * memory)
        left = share - self.shape.weight_bytes
        if left < self.page_bytes:
            raise SizingError(
                f"--gpu-memory-utilization {utilization:g} of {device}'s {memory / GB:g} GB is {share / GB:.2f} GB, "
                f"which leaves {max(left, 0) / GB:.2f} GB after the weights ({self.shape.weight_bytes / GB:.2f} GB): "
                "not one page of KV"
            )
        return left

    def tokens_on(self, device: str, utilization: float) -> int:
        """Tokens (whole pages) of KV on `device` at `utilization`."""
        return self.pages_in(self.kv_bytes_on(device, utilization)) * self.page_size

    def describe(self, capacity_tokens: int, device: str, given: dict[str, float]) -> dict[str, Any]:
        """A cell's `kv_capacity`: tokens, pages and their bytes (GB), how it was given, and
        for a utilisation what it was taken from."""
        pages = capacity_tokens // self.page_size
        nbytes = pages * self.page_bytes
        out: dict[str, Any] = {
            "given": next(iter(given), "tokens"),
            "tokens": capacity_tokens,
            "pages": pages,
            "bytes": nbytes,
            "gb": nbytes / GB,
            "kv_bytes_per_token": self.shape.kv_bytes_per_token,
            **given,
        }
        if "gpu_memory_utilization" in given:
            out["device_memory_bytes"] = DEVICE_PROFILES[device].memory_bytes
            out["weight_bytes"] = self.shape.weight_bytes
        return out


@dataclass(frozen=True)
class CapacityGiven:
    """The capacities of a run, as given: `way` (one of `WAYS`) and one value per capacity."""

    way: str
    values: tuple[float, ...]

    @classmethod
    def of(cls, tokens: Sequence[int] | None, gb: Sequence[float] | None, utilization: Sequence[float] | None,
           default: Sequence[int], fraction: Sequence[float] | None = None) -> CapacityGiven:  # fmt: skip
        """The one way the command line gives (default: `default` tokens); two ways at once is a `SizingError`."""
        given = {w: v for w, v in zip(WAYS, (tokens, gb, utilization, fraction), strict=True) if v}
        if len(given) > 1:
            raise SizingError(
                f"{' and '.join(FLAGS[w] for w in given)} each set the KV capacity per replica: give one of them"
            )
        way, values = next(iter(given.items()), ("tokens", default))
        return cls(way, tuple(dict.fromkeys(values)))

    @property
    def needs_workload(self) -> bool:
        """Whether `cells` needs the workload (a fraction of its working set)."""
        return self.way == "capacity_fraction"

    def cells(
        self, page_size: int, model: str, device: str, workload: Workload | None = None
    ) -> list[tuple[int, dict[str, float]]]:
        """Each capacity in tokens with the CellConfig fields saying how it was given (none
        for tokens); two values that give the same tokens are a `SizingError`. A fraction
        needs the `workload`."""
        if self.way == "tokens":
            return [(int(v), {}) for v in self.values]
        if self.needs_workload and workload is None:
            raise ValueError("a capacity given as a fraction of the working set needs the workload")
        sizing = KvSizing(model_shape(model), page_size)
        pages = working_set_pages(workload, page_size) if workload is not None and self.needs_workload else 0
        out: dict[int, float] = {}
        for v in self.values:
            if self.way == "capacity_fraction":
                tokens = fraction_tokens(v, pages, page_size)
            elif self.way == "capacity_gb":
                tokens = sizing.tokens_for_gb(v)
            else:
                tokens = sizing.tokens_on(device, v)
            if tokens in out:
                raise SizingError(
                    f"{FLAGS[self.way]} {out[tokens]:g} and {v:g} give the same capacity, {tokens:,} tokens "
                    f"(pages of {page_size}): drop one"
                )
            out[tokens] = v
        return [(tokens, {self.way: v}) for tokens, v in out.items()]


def working_set_pages(workload: Workload, page_size: int) -> int:
    """The workload's working set: its distinct full pages at `page_size` (libCacheSim's
    working set size, counted in pages), as the bounds count them."""
    return page_keys(workload.requests, page_size).num_keys


def fraction_tokens(fraction: float, working_set: int, page_size: int) -> int:
    """Tokens of `fraction` × `working_set` pages: whole pages, rounded down, at least one."""
    if working_set == 0:
        raise SizingError(
            f"--capacity-fraction {fraction:g}: the workload has no full page of {page_size} tokens, so no working "
            "set to take a fraction of; give --capacity-tokens"
        )
    return max(1, math.floor(fraction * working_set)) * page_size
