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
from experiments.engine.executors import DEVICE_PROFILES, ModelShape
from experiments.errors import InputError
from experiments.timing.zoo import MODELS, UnknownName, ZooError, resolve_model
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


def model_shape(name: str, tp: int = 1) -> ModelShape:
    """The shape of model `name` on each of `tp` GPUs: a zoo model (experiments/timing/zoo.py,
    or its Hugging Face id), or a preset of `attention.config.PRESETS` (`tiny`: one device), no torch."""
    try:
        return ModelShape.from_spec(resolve_model(name), tp)
    except UnknownName:
        pass  # not in the zoo: a preset, or unknown (below)
    except ZooError as exc:
        raise SizingError(str(exc)) from None  # (a degree the heads do not allow)
    if name not in PRESETS:
        raise SizingError(f"unknown model {name!r}; choose one of: {', '.join(sorted({*MODELS, *PRESETS}))}")
    if tp != 1:
        raise SizingError(
            f"--tp {tp}: model {name!r} runs on one device (tensor parallelism is for the zoo's models: {', '.join(MODELS)})"
        )
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
        self, page_size: int, model: str, device: str, workload: Workload | None = None, tp: int = 1
    ) -> list[tuple[int, dict[str, float]]]:
        """Each capacity in tokens with the CellConfig fields saying how it was given (none
        for tokens); two values that give the same tokens are a `SizingError`. A fraction
        needs the `workload`."""
        if self.way == "tokens":
            return [(int(v), {}) for v in self.values]
        if self.needs_workload and workload is None:
            raise ValueError("a capacity given as a fraction of the working set needs the workload")
        sizing = KvSizing(model_shape(model, tp), page_size)
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


def check_weights_fit(model: str, device: str, tp: int) -> None:
    """Each of the replica's `tp` GPUs holds its share of the weights; a `SizingError`
    otherwise (not even `--force-capacity` runs a model no such GPU can load)."""
    memory = DEVICE_PROFILES[device].memory_bytes
    shape = model_shape(model, tp)
    if memory is not None and shape.weight_bytes > memory:
        more = -(-shape.weight_bytes * tp // memory)
        raise SizingError(
            f"{model}'s weights take {shape.weight_bytes / GB:.1f} GB on each of {tp} x {device}, which has "
            f"{memory / GB:g} GB: they do not fit (--tp {more} or more, or a larger device)"
        )


def check_fits_device(model: str, device: str, tp: int, capacity_tokens: int, page_size: int) -> None:
    """A KV capacity of `capacity_tokens` per replica fits each of its `tp` GPUs beside its
    share of the weights; a `SizingError` saying by how much it does not (the run would
    model a cache no such GPU holds). A device without a memory size (`cpu`) is not checked."""
    memory = DEVICE_PROFILES[device].memory_bytes
    if memory is None:
        return
    shape = model_shape(model, tp)
    kv = capacity_tokens // page_size * page_size * shape.kv_bytes_per_token
    need = kv + shape.weight_bytes
    if need <= memory:
        return
    per = f"each of {tp} x {device}" if tp > 1 else device
    raise SizingError(
        f"a KV capacity of {capacity_tokens:,} tokens takes {kv / GB:.1f} GB beside {shape.weight_bytes / GB:.1f} GB of "
        f"{model} weights on {per}, which has {memory / GB:g} GB: at most "
        f"{max(memory - shape.weight_bytes, 0) // shape.kv_bytes_per_token:,} tokens fit (a smaller capacity, "
        "--gpu-memory-utilization to size it as vLLM does, more --tp, or --force-capacity to run it anyway)"
    )
