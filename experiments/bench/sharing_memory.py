"""Memory saved by sharing, as in PagedAttention §6.3, on every registered backend.

    python -m experiments.bench.sharing_memory [--requests 200] [--concurrency 16]
        [--page-size 16] [--datasets alpaca sharegpt] [--backend none apc ...]
        [--output bench-results/sharing_memory.json]

Writes the JSON to `--output` and a markdown table beside it (the same name, `.md`); the
committed report is `--output reports/bench/sharing_memory.json`.

Parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) from
`experiments.workloads.sampling`, driven through `fork` and `release` only, so the same
schedule runs on every backend in `cachelib.available_backends()`: `none` copies every
page on fork, `apc` shares full blocks and copies the partial last one, `paged` shares
every block and copies on write, `radix` forks as its module documents.

Up to `concurrency` requests are in flight; one engine step advances each of them by one
decode token (continuous batching without memory pressure: the pool is sized so nothing
is ever refused, and it is the same for every backend). After every step we sample
  logical  = sum over live sequences of len(page_table)   (blocks needed without sharing)
  physical = stats().pages_pinned                           (blocks actually held)
and report saving = (sum logical - sum physical) / sum logical over all steps (the paper's
"blocks saved by sharing / blocks needed without sharing", averaged over the run, weighted
by blocks x steps), and the peak of `physical` against the peak of the same run on `none`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from cachelib import Sequence, available_backends, create_cache
from experiments.bench import RESULTS, HelpFormatter, write_output
from experiments.engine.cache_client import CacheClient
from experiments.engine.executors import FreshTokens
from experiments.workloads.sampling import SamplingRequest, describe, generate

WIDTHS = (2, 4, 6)
PAPER = {  # PagedAttention §6.3, OPT-13B: memory saving (%) over n / beam width 2..6
    "alpaca": {"parallel": (6.1, 9.8), "beam": (37.6, 55.2)},
    "sharegpt": {"parallel": (16.2, 30.5), "beam": (44.3, 66.3)},
}
DEFINITIONS = {
    "saving_pct": "100 * (sum_t logical_t - sum_t physical_t) / sum_t logical_t over engine steps t; "
    "logical_t = sum of len(page_table) over live sequences, physical_t = stats().pages_pinned",
    "peak_pages": "max_t physical_t: pages pinned (held by a live sequence) after any engine step",
    "peak_saving_vs_none_pct": "100 * (1 - peak_pages / peak_pages of the same run on 'none')",
    "copied_pages": "stats().copied_pages: pages copied by fork or copy-on-write",
}


class _Run:
    """Drives one request's decoding schedule (its spec's plan) through fork/release, one
    engine step per `next(steps)`; tracks its live sequences. Cache calls go through the
    shared `CacheClient` (call order checked), generated ids come from the shared counter."""

    def __init__(self, client: CacheClient, req: SamplingRequest, tokens: FreshTokens) -> None:
        self.client, self.req, self.tokens = client, req, tokens
        self.live: list[Sequence] = []
        self.steps = self._beam() if req.mode == "beam" else self._parallel()

    def _ok(self, result: object, what: str) -> None:
        if result is None:
            raise RuntimeError(f"{self.client.cache.name}: {what} did not fit; the pool is sized too small")

    def _prefill(self) -> Sequence:
        spec = self.req.spec
        seq = Sequence(spec.request_id, spec.prompt, spec.extra)
        self._ok(self.client.admit(seq, self.client.match(seq), len(seq)), "admit")
        self.client.commit(seq, len(seq))
        return seq

    def _fork(self, parent: Sequence, name: str) -> Sequence:
        child = parent.fork(name)
        self._ok(self.client.fork(parent, child), "fork")
        return child

    def _decode(self, seq: Sequence) -> None:
        seq.append([self.tokens.take_one()])
        self._ok(self.client.grow(seq, len(seq)), "grow")
        self.client.commit(seq, len(seq))

    def _parallel(self) -> Iterator[None]:
        # token 1 of every sample comes from the prompt's logits; token t's KV is written at
        # step t + 1 and the last token's never (as the engine does): output_len - 1 writes
        root = self._prefill()
        lens = self.req.spec.output_lens
        self.live = [root] + [self._fork(root, f"{root.request_id}/s{i}") for i in range(1, len(lens))]
        remaining = dict(zip([s.request_id for s in self.live], [n - 1 for n in lens], strict=True))
        yield
        while self.live:
            for seq in list(self.live):
                if remaining[seq.request_id] == 0:
                    self.client.release(seq)
                    self.live.remove(seq)
                else:
                    self._decode(seq)
                    remaining[seq.request_id] -= 1
            yield

    def _beam(self) -> Iterator[None]:
        root = self._prefill()
        beams = self.live = [root]
        yield
        forks = 0
        for t, parents in enumerate(self.req.spec.beam_parents):
            counts = [int((parents == i).sum()) for i in range(len(beams))]
            for beam, k in zip(beams, counts, strict=True):
                if k == 0:
                    self.client.release(beam)  # pruned: free its blocks before forking others
            kept: list[Sequence] = []
            for beam, k in zip(beams, counts, strict=True):
                if k:
                    kept.append(beam)
                for _ in range(k - 1):
                    forks += 1
                    kept.append(self._fork(beam, f"{root.request_id}/b{forks}"))
            beams = kept
            self.live = beams
            if t + 1 < len(self.req.spec.beam_parents):  # the last step's tokens are never fed back
                for beam in beams:
                    self._decode(beam)
            yield
        for beam in beams:
            self.client.release(beam)
        self.live = []


def run(backend: str, requests: list[SamplingRequest], *, page_size: int, concurrency: int) -> dict:
    """Run the requests on a fresh `backend` cache; returns the sharing measurements."""
    worst = max(r.width * -(-(r.spec.prompt.size + r.spec.output_len) // page_size) for r in requests)
    cache = create_cache(backend, num_pages=concurrency * worst + 1, page_size=page_size)
    client = CacheClient(cache)
    counter = FreshTokens()
    pending = list(reversed(requests))
    active: list[_Run] = []
    sum_logical = sum_physical = peak = steps = 0
    t0 = time.perf_counter()
    while pending or active:
        while pending and len(active) < concurrency:
            active.append(_Run(client, pending.pop(), counter))
        for r in list(active):
            if next(r.steps, StopIteration) is StopIteration:
                active.remove(r)
        logical = sum(len(s.page_table) for r in active for s in r.live)
        physical = cache.stats().pages_pinned
        sum_logical += logical
        sum_physical += physical
        peak = max(peak, physical)
        steps += 1
    seconds = time.perf_counter() - t0
    cache.check_invariants()
    s = cache.stats()
    if s.pages_pinned:
        raise RuntimeError(f"{backend}: {s.pages_pinned} pages still pinned after every request finished")
    return {
        "backend": backend,
        "saving_pct": 100.0 * (sum_logical - sum_physical) / sum_logical if sum_logical else 0.0,
        "peak_pages": peak,
        "copied_pages": s.copied_pages,
        "block_steps_logical": sum_logical,
        "block_steps_physical": sum_physical,
        "engine_steps": steps,
        "num_pages": cache.num_pages,
        "seconds": round(seconds, 3),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.bench.sharing_memory",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--requests", type=int, default=200, help="sampling requests per dataset, mode and width")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page (the paper's block size is 16)")
    ap.add_argument(
        "--datasets", nargs="+", default=["alpaca", "sharegpt"], help="prompt/output length distributions to sample"
    )
    ap.add_argument(
        "--backend",
        "--backends",
        dest="backends",
        metavar="BACKEND",
        nargs="+",
        default=None,
        help="backends to run (default: every registered backend; --backends is an older spelling)",
    )
    ap.add_argument("--parent-decay", type=float, default=0.5, help="beam parent weight per rank")
    ap.add_argument(
        "--sensitivity",
        nargs="*",
        default=["1.0:0", "0.5:0.5", "0.5:0.9"],
        help="also run beam search on 'paged' with these DECAY:STAY beam schedules",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampled requests")
    ap.add_argument(
        "--output",
        default=str(RESULTS / "sharing_memory.json"),
        help="JSON file to write; the markdown table goes beside it with the suffix .md",
    )
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    backends = args.backends or available_backends()
    rows: list[dict] = []
    workloads: dict[str, dict] = {}
    for dataset in args.datasets:
        for mode in ("parallel", "beam"):
            for width in WIDTHS:
                reqs = generate(dataset, mode, width, args.requests, seed=args.seed, parent_decay=args.parent_decay)
                workloads[f"{dataset}/{mode}/{width}"] = describe(dataset, reqs)
                results = {b: run(b, reqs, page_size=args.page_size, concurrency=args.concurrency) for b in backends}
                none_peak = results["none"]["peak_pages"] if "none" in results else None
                for res in results.values():
                    res["peak_saving_vs_none_pct"] = 100.0 * (1 - res["peak_pages"] / none_peak) if none_peak else None
                    rows.append({"dataset": dataset, "mode": mode, "width": width, **res})
                print(_line(rows[-len(backends) :]), flush=True)
    sensitivity = []
    for item in args.sensitivity:
        decay, stay = map(float, item.split(":"))
        for dataset in args.datasets:
            for width in WIDTHS:
                reqs = generate(dataset, "beam", width, args.requests, seed=args.seed, parent_decay=decay, stay=stay)
                res = run("paged", reqs, page_size=args.page_size, concurrency=args.concurrency)
                sensitivity.append({"dataset": dataset, "width": width, "schedule": f"{decay}:{stay}", **res})
                print(f"sensitivity {decay}:{stay} {dataset} beam {width}: paged {res['saving_pct']:.1f}%", flush=True)
    report = {
        "benchmark": "memory saved by sharing (PagedAttention §6.3)",
        "command": " ".join(["python -m experiments.bench.sharing_memory", *(sys.argv[1:] if argv is None else argv)]),
        "config": vars(args) | {"backends": backends},
        "definitions": DEFINITIONS,
        "paper_saving_pct_range_n_or_width_2_to_6": PAPER,
        "workloads": workloads,
        "results": rows,
        "beam_parent_decay_sensitivity_paged": sensitivity,
    }
    out = Path(args.output)
    write_output(out, json.dumps(report, indent=2) + "\n")
    md = markdown(rows, backends) + sensitivity_markdown(rows, sensitivity, f"{args.parent_decay}:0.0")
    write_output(out.with_suffix(".md"), md)
    print(md)
    return report


def sensitivity_markdown(rows: list[dict], sens: list[dict], main: str) -> str:
    """Beam-search saving on paged as the beam schedule's free parameters change."""
    if not sens:
        return ""
    table = {
        (r["dataset"], r["width"], main): r["saving_pct"]
        for r in rows
        if r["mode"] == "beam" and r["backend"] == "paged"
    }
    table |= {(r["dataset"], r["width"], r["schedule"]): r["saving_pct"] for r in sens}
    decays = list(dict.fromkeys([main] + [r["schedule"] for r in sens]))
    lines = [
        "",
        "Beam search on `paged`: saving (%) per beam schedule DECAY:STAY (a survivor's parent is the rank-r beam "
        "with weight DECAY^r, or with probability STAY its own rank's beam; 1.0:0 = uniform parents).",
        "",
        "| dataset | width | " + " | ".join(decays) + " |",
        "|" + "---|" * (2 + len(decays)),
    ]
    for dataset, width in sorted({(d, w) for d, w, _ in table}):
        cells = [f"{table[(dataset, width, d)]:.1f}" if (dataset, width, d) in table else "" for d in decays]
        lines.append(f"| {dataset} | {width} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _line(rows: list[dict]) -> str:
    r0 = rows[0]
    cells = ", ".join(f"{r['backend']} {r['saving_pct']:.1f}% (peak {r['peak_pages']})" for r in rows)
    return f"{r0['dataset']:>8} {r0['mode']:>8} {r0['width']}: {cells}"


def markdown(rows: list[dict], backends: list[str]) -> str:
    """Saving (%) per backend, with the peak-pages saving vs none in parentheses."""
    head = "| dataset | mode | n / width | " + " | ".join(backends) + " | paper (2..6) |"
    lines = [
        "Memory saved by sharing, % of blocks needed without sharing (block-steps over the run); "
        "in parentheses: peak pages saved vs `none`.",
        "",
        head,
        "|" + "---|" * (4 + len(backends)),
    ]
    keyed = {(r["dataset"], r["mode"], r["width"], r["backend"]): r for r in rows}
    for dataset, mode, width in sorted(
        {(r["dataset"], r["mode"], r["width"]) for r in rows}, key=lambda k: (k[0], k[1] != "parallel", k[2])
    ):
        cells = []
        for b in backends:
            r = keyed[(dataset, mode, width, b)]
            peak = r["peak_saving_vs_none_pct"]
            cells.append(f"{r['saving_pct']:.1f} ({peak:.1f})" if peak is not None else f"{r['saving_pct']:.1f}")
        lo, hi = PAPER[dataset][mode]
        lines.append(f"| {dataset} | {mode} | {width} | " + " | ".join(cells) + f" | {lo}–{hi} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
