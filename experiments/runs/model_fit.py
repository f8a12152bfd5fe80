"""Checks of `--executor model` before any work: torch is installed (the `model` extra), the
workload's token ids lie in the model's vocabulary, and the model and its KV cache fit the
memory of the device it would run on.

The memory estimate is a floor: weights (every parameter × its dtype's bytes) plus the KV
cache the executor allocates (the largest capacity's pages × the model's KV bytes per
token), once per model held at the same time (a cluster builds one per replica, `--jobs`
runs that many cells at once). Activations, the fp32 copy each weight is drawn through and
the allocator's slack come on top, so a run refused here would not have fitted, and one
admitted can still be tight. Available memory is the GPU's free memory
(`torch.cuda.mem_get_info`) where the model runs on CUDA, otherwise the host's
`MemAvailable` (/proc/meminfo; the physical pages sysconf reports elsewhere). A run is
refused when the estimate passes `HEADROOM` of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from attention.config import PRESETS, ModelConfig
from experiments.errors import InputError
from experiments.workloads.generators import Workload
from experiments.workloads.registry import knobs_of

#: the share of available memory a run may plan to take
HEADROOM = 0.9
GB = 10**9
INSTALL_HINT = "pip install 'prefix-cache-lab[model]' (or install torch yourself)"


class ModelFitError(InputError):
    """`--executor model` cannot run this: no torch, token ids past the vocabulary, or too little memory."""


def check_torch() -> None:
    """torch is importable; a `ModelFitError` naming the extra otherwise."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise ModelFitError(
            f"--executor model needs torch, which is not installed ({exc}): {INSTALL_HINT}; "
            "--executor cost or fixed run without it"
        ) from None


def check_vocabulary(model: str, workload: Workload) -> None:
    """Every prompt and forced-output token id is below the model's vocabulary size; the error
    names the knob that bounds the ids, where the workload has one."""
    vocab = PRESETS[model].vocab_size
    top = max(_max_id(workload), -1)
    if top < vocab:
        return
    if "vocab_size" in _knobs(workload.name):
        fix = f"--knob vocab_size={vocab} (the workload draws its ids from [0, vocab_size))"
    else:
        fix = "a model with a larger vocabulary, or --executor cost (its ids come from its input file)"
    raise ModelFitError(
        f"workload {workload.name!r} has token ids up to {top:,}, but model {model!r} has a vocabulary of "
        f"{vocab:,} ids: use {fix}"
    )


def _knobs(name: str) -> dict:
    try:
        return knobs_of(name)
    except ValueError:
        return {}


def _max_id(workload: Workload) -> int:
    top = -1
    for spec in workload.requests:
        prompt = spec.prompt
        if prompt.size:
            top = max(top, int(np.max(prompt)))
        if spec.forced_output is not None and spec.forced_output.size:
            top = max(top, int(np.max(spec.forced_output)))
    return top


def model_bytes(cfg: ModelConfig, kv_tokens: int) -> tuple[int, int]:
    """(weight bytes, KV bytes for `kv_tokens` tokens) of one model."""
    return cfg.num_params() * cfg.dtype_bytes, kv_tokens * cfg.kv_bytes_per_token()


def available_bytes(device: str) -> int | None:
    """Free memory of `device` ("cuda" or "cpu"); None when it cannot be read."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(model: str, device: str, capacities: Sequence[int], page_size: int, copies: int) -> None:
    """The model and its largest KV cache, `copies` times, fit `HEADROOM` of `device`'s free memory."""
    cfg = PRESETS[model]
    kv_tokens = max(capacities) // page_size * page_size
    weights, kv = model_bytes(cfg, kv_tokens)
    need = (weights + kv) * copies
    free = available_bytes(device)
    if free is None or need <= HEADROOM * free:
        return
    raise ModelFitError(
        f"--executor model --model {model} needs at least {need / GB:.1f} GB on {device} "
        f"({weights / GB:.2f} GB of {cfg.dtype} weights + {kv / GB:.2f} GB of KV for {kv_tokens:,} tokens"
        + (f", x{copies} models at once" if copies > 1 else "")
        + f"), but {device} has {free / GB:.1f} GB available: use --model tiny, smaller --capacity-tokens, "
        "fewer --jobs or --replicas, or --executor cost (the roofline cost model, no weights)"
    )
