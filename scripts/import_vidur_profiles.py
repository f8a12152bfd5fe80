"""Write the shipped step profiles (experiments/timing/profiles/) from vidur's measurements.

vidur (github.com/microsoft/vidur, MIT license) ships operator times measured on A100 and
H100 GPUs under `data/profiling/`: `compute/<gpu>/<model>/mlp.csv` (every operator of a
decoder layer outside attention, by token count and tensor-parallel degree) and
`network/<gpu>_dgx/all_reduce.csv` (NCCL all-reduce by message size and GPU count). This
script sums a layer's operators (medians) into the `linear` rows and converts message sizes
to tokens (bytes / hidden / 2, as vidur does) for the `all_reduce` rows. vidur's
attention tables (`attention.csv`) are stored with Git LFS and were not available, so the
shipped tables have no attention rows: the profile executor takes attention from the
roofline, and says so.

    python scripts/import_vidur_profiles.py --vidur PATH   (a checkout, or a bare git directory)
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "experiments" / "timing" / "profiles"
sys.path.insert(0, str(ROOT))  # (run as a script: the project on the path)

#: (vidur's model directory, the zoo's name) and the GPUs vidur measured it on
MODELS = {
    "meta-llama/Meta-Llama-3-8B": ("llama3-8b", ("a100",)),
    "meta-llama/Meta-Llama-3-70B": ("llama3-70b", ("a100",)),
    "meta-llama/Llama-2-7b-hf": ("llama2-7b", ("a100", "h100")),
    "meta-llama/Llama-2-70b-hf": ("llama2-70b", ("a100", "h100")),
    "Qwen/Qwen-72B": ("qwen-72b", ("a100", "h100")),
}
#: a decoder layer's operators outside attention, as vidur's ExecutionTime sums them
LINEAR_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)


def read(vidur: Path, rel: str) -> str:
    path = vidur / rel
    if path.is_file():
        return path.read_text()
    return subprocess.run(
        ["git", "--git-dir", str(vidur), "show", f"HEAD:{rel}"], capture_output=True, text=True, check=True
    ).stdout


def commit_of(vidur: Path) -> str:
    git_dir = vidur / ".git" if (vidur / ".git").exists() else vidur
    return subprocess.run(
        ["git", "--git-dir", str(git_dir), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def linear_rows(text: str) -> list[tuple[int, int, float]]:
    at: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in csv.DictReader(io.StringIO(text)):
        ms = sum(float(r[f"time_stats.{op}.median"]) for op in LINEAR_OPS)
        at[(int(r["num_tensor_parallel_workers"]), int(r["num_tokens"]))].append(ms)
    # a token count measured twice (vidur's grid repeats a few): the median of its runs
    return sorted((tp, tokens, statistics.median(v)) for (tp, tokens), v in at.items())


def all_reduce_rows(text: str, hidden: int) -> list[tuple[int, int, float]]:
    at: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in csv.DictReader(io.StringIO(text)):
        if r["collective"] != "all_reduce" or r["devices_per_node"] != r["num_workers"]:
            continue  # (as vidur: the tensor-parallel group on one node; the other rows span nodes)
        size = int(r["size"])
        if size % (2 * hidden):
            continue  # not a whole number of tokens' hidden states
        at[(int(r["num_workers"]), size // (2 * hidden))].append(float(r["time_stats.all_reduce.median"]))
    # every other point on a 2^(k/4) ladder: vidur's sizes step by a few tokens, finer than
    # the noise between neighbours (which the interpolation would otherwise follow)
    ladder = {round(2 ** (k / 4)) for k in range(4 * 20)}
    return sorted((tp, tokens, statistics.median(v)) for (tp, tokens), v in at.items() if tokens in ladder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vidur", required=True, type=Path, help="vidur checkout or bare git directory")
    args = ap.parse_args()
    commit = commit_of(args.vidur)
    OUT.mkdir(parents=True, exist_ok=True)
    from experiments.timing.zoo import resolve_model

    for vidur_name, (name, gpus) in MODELS.items():
        hidden = resolve_model(name).hidden
        for gpu in gpus:
            mlp = f"data/profiling/compute/{gpu}/{vidur_name}/mlp.csv"
            net = f"data/profiling/network/{gpu}_dgx/all_reduce.csv"
            lines = [
                f"# model: {name}",
                f"# device: {gpu}",
                f"# source: vidur (github.com/microsoft/vidur at {commit[:12]}), {mlp} (linear: the median of each "
                f"operator, summed as vidur's ExecutionTime sums them) and {net} (all_reduce: message bytes / hidden / 2)",
                "# engine: vidur's profiler (PyTorch operators, NCCL collectives on a DGX node), as published with vidur",
                "# license: MIT (vidur)",
                "# attention: none measured here (vidur's attention.csv is stored with Git LFS); the executor takes it from the roofline",
                "op,tp,tokens,context,ms",
            ]
            lines += [f"linear,{tp},{t},0,{ms:.6g}" for tp, t, ms in linear_rows(read(args.vidur, mlp))]
            lines += [
                f"all_reduce,{tp},{t},0,{ms:.6g}"
                for tp, t, ms in all_reduce_rows(read(args.vidur, net), hidden)
                if tp > 1
            ]
            (OUT / f"{name}__{gpu}.csv").write_text("\n".join(lines) + "\n")
            print(f"wrote {name}__{gpu}.csv ({len(lines) - 7} rows)")


if __name__ == "__main__":
    main()
