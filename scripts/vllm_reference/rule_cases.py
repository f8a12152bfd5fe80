"""The expectations of tests/test_vllm_rules.py, from the real vLLM 0.33.

Runs every case of tests/test_vllm_rules.py (`CASES`: requests, capacity, budget, max_seqs,
sync/async) through `run_vllm.run` (vLLM's own Scheduler / AsyncScheduler, fake runner, 20 ms
steps) and compares vLLM's records with the case's literal `expect` rows; also runs each case's
`shows` check on vLLM's rows. Run with the side venv (needs vLLM, not the project):

    /work/vllm-venv/bin/python scripts/vllm_reference/rule_cases.py            # check; exit 1 on a difference
    /work/vllm-venv/bin/python scripts/vllm_reference/rule_cases.py --print    # fresh Row(...) lines per case
    /work/vllm-venv/bin/python scripts/vllm_reference/rule_cases.py --write    # rewrite the Row(...) numbers in place
    /work/vllm-venv/bin/python scripts/vllm_reference/rule_cases.py --mutants  # which cases each rule guards
    ... [--case NAME ...]

`--mutants` reruns the cases on copies of vLLM's scheduler.py with one rule changed (text
replacements listed in `MUTANTS`; vLLM's installed files are not touched) and checks that each
mutant changes the outcome of the cases written for that rule: evidence that those cases
really depend on the rule. `--write` replaces the numbers inside each case's `Row(...)` lines only (comments kept): re-read
the comments that derive them afterwards.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import signal
import sys
import types
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TEST = REPO / "tests" / "test_vllm_rules.py"


def load_cases():
    """tests/test_vllm_rules.py as a module; pytest replaced by a stub if the venv lacks it."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        stub = types.ModuleType("pytest")
        stub.mark = types.SimpleNamespace(parametrize=lambda *a, **k: lambda f: f)
        sys.modules["pytest"] = stub
    spec = importlib.util.spec_from_file_location("vllm_rule_cases", TEST)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod


def vllm_rows(mod, case):
    sys.path.insert(0, str(HERE))
    import run_vllm

    reqs = [(q.tokens(), q.output_len, q.arrival) for q in case.reqs]
    rec, _, _ = run_vllm.run(
        reqs,
        case.capacity,
        block_size=mod.BLOCK,
        budget=case.budget,
        max_seqs=case.max_seqs,
        async_sched=case.async_sched,
    )
    return [
        mod.Row(
            r["hit_tokens_first"],
            r["preemptions"],
            r["first_token_step"],
            r["finish_step"],
            r["first_token_ms"],
            r["finish_ms"],
        )
        for r in rec
    ]


# Rule mutants of vLLM 0.33.0: name -> (what changes, replacements (file, old, new) in
# vllm/v1/core/sched/scheduler.py ("sched") or vllm/v1/core/kv_cache_manager.py ("kv"), cases whose
# outcome it must change).
_GATE = "if not preempted_reqs and self._pause_state != PauseState.PAUSED_ALL:"
_FIT_FAIL = """                        self.encoder_cache_manager.free(request)
                    break"""
_NO_CHUNKING = """                        not self.scheduler_config.enable_chunked_prefill
                        and num_new_tokens > request_token_budget"""
MUTANTS = {
    "no_chunk_for_waiting": (
        "rule 1: a waiting request is admitted only if its whole prompt fits in the budget left",
        [("sched", _NO_CHUNKING, "num_new_tokens > request_token_budget")],
        ("budget_split_running_first",),
    ),
    "victim_first_running": (
        "rule 2: the FIRST running request is the victim, not the last",
        [("sched", "preempted_req = self.running.pop()", "preempted_req = self.running.pop(0)")],
        ("preempt_last_running", "preempt_self"),
    ),
    "victim_to_back": (
        "rule 2: a preempted request goes to the BACK of the waiting queue",
        [("sched", "        self.waiting.prepend_request(request)\n", "        self.waiting.add_request(request)\n")],
        ("preempt_last_running",),
    ),
    "no_gate": (
        "rule 3: waiting requests are admitted in a step that preempted",
        [("sched", _GATE, "if self._pause_state != PauseState.PAUSED_ALL:")],
        ("async_no_admission_in_preempting_step",),
    ),
    "fit_skips": (
        "rule 4: a waiting request that does not fit is skipped, the next one tried",
        [("sched", _FIT_FAIL, _FIT_FAIL.replace("break", "skip_request(request_queue)\n                    continue"))],
        ("fit_stops_the_pass",),
    ),
    "fit_first_chunk": (
        "rule 4: only the first chunk must fit, not the whole prompt",
        [("sched", "full_sequence_must_fit=self.scheduler_reserve_full_isl", "full_sequence_must_fit=False")],
        ("fit_whole_prompt_not_chunk",),
    ),
    "cache_when_computed": (
        "rule 5: a chunk's blocks become hittable only once computed (next allocation), not when allocated",
        [
            (
                "kv",
                "            total_computed_tokens + num_new_tokens,\n            request.num_tokens,",
                "            total_computed_tokens,\n            request.num_tokens,",
            )
        ],
        ("same_step_hit",),
    ),
    "hit_uncapped": (
        "rule 6: the hit may cover the whole prompt (no prompt - 1 cap)",
        [
            (
                "kv",
                "            max_cache_hit_length = request.num_tokens - 1\n        computed_blocks, num_new",
                "            max_cache_hit_length = request.num_tokens\n        computed_blocks, num_new",
            )
        ],
        ("hit_capped_below_prompt",),
    ),
    "drop_stale_output": (
        "rule 7: a preempted request's in-flight output is dropped, not delivered",
        [("sched", "if output_is_stale and request.drop_stale_output:", "if output_is_stale:")],
        ("async_stale_token_delivered", "async_preempted_with_last_token_in_flight"),
    ),
}


def _mutated(module, replacements, name, inject=None):
    """A copy of `module` compiled from its source with `replacements`; `inject` overrides names
    its imports bind (set on the imported modules while it executes)."""
    src = Path(module.__file__).read_text()
    for old, new in replacements:
        if src.count(old) != 1:
            raise SystemExit(f"mutant text found {src.count(old)} times in {module.__file__}: {old!r}")
        src = src.replace(old, new)
    m = types.ModuleType(name)
    m.__dict__.update(__package__=module.__package__, __file__=module.__file__)
    sys.modules[name] = m  # dataclasses look their module up
    saved = []
    for (target, attr), value in (inject or {}).items():
        saved.append((target, attr, getattr(target, attr)))
        setattr(target, attr, value)
    try:
        exec(compile(src, module.__file__, "exec"), m.__dict__)
    finally:
        for target, attr, value in saved:
            setattr(target, attr, value)
    return m


def mutant_classes(replacements):
    """(Scheduler, AsyncScheduler) of vLLM with `replacements` applied to copies of its files."""
    import vllm.v1.core.kv_cache_manager as kv_mod
    import vllm.v1.core.sched.async_scheduler as async_mod
    import vllm.v1.core.sched.scheduler as sched_mod

    kv_repl = [(o, n) for f, o, n in replacements if f == "kv"]
    inject = {}
    if kv_repl:
        kv = _mutated(kv_mod, kv_repl, "vllm.v1.core._rule_mutant_kv")
        inject = {(kv_mod, "KVCacheManager"): kv.KVCacheManager, (kv_mod, "KVCacheBlocks"): kv.KVCacheBlocks}
    sm = _mutated(
        sched_mod, [(o, n) for f, o, n in replacements if f == "sched"], "vllm.v1.core.sched._rule_mutant", inject
    )
    am = _mutated(async_mod, [], "vllm.v1.core.sched._rule_mutant_async", {(sched_mod, "Scheduler"): sm.Scheduler})
    return sm.Scheduler, am.AsyncScheduler


class _Stuck(BaseException):
    """A case still running after 10 s under a mutant (some request never finishes)."""


def _stuck(signum, frame):
    raise _Stuck()


def run_mutants(mod, cases) -> int:
    """Rerun `cases` under each mutant; 1 if a mutant leaves a case written for its rule unchanged."""
    import vllm.v1.core.sched.async_scheduler as async_mod
    import vllm.v1.core.sched.scheduler as sched_mod

    orig = (sched_mod.Scheduler, async_mod.AsyncScheduler)
    signal.signal(signal.SIGALRM, _stuck)
    names = {c.name for c in mod.CASES}
    bad = 0
    for mname, (what, repl, guards) in MUTANTS.items():
        assert set(guards) <= names, guards
        sched_mod.Scheduler, async_mod.AsyncScheduler = mutant_classes(repl)  # run_vllm imports them per run
        try:
            changed = []
            for case in cases:
                signal.setitimer(signal.ITIMER_REAL, 10)  # a mutant may never finish a request
                try:
                    rows = vllm_rows(mod, case)
                    if list(rows) != list(case.expect):
                        changed.append(case.name)
                except (Exception, _Stuck) as exc:  # vLLM's own asserts may fail: a change too
                    changed.append(f"{case.name} ({type(exc).__name__})")
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            sched_mod.Scheduler, async_mod.AsyncScheduler = orig
        missed = [g for g in guards if g in {c.name for c in cases} and not any(x.split(" ")[0] == g for x in changed)]
        bad += bool(missed)
        print(f"{mname} ({what}): changes {', '.join(changed) or 'nothing'}", flush=True)
        if missed:
            print(f"    NOT CHANGED although written for this rule: {', '.join(missed)}")
    return 1 if bad else 0


def fmt(row) -> str:
    return (
        f"Row({row.hit}, {row.preemptions}, {row.first_step}, {row.finish_step}, {row.first_ms!r}, {row.finish_ms!r})"
    )


def rewrite(text: str, name: str, rows) -> str:
    """Replace the Row(...) lines of case `name`'s expect block by `rows`."""
    m = re.search(r'name="' + re.escape(name) + r'"', text)
    if m is None:
        raise SystemExit(f"case {name} not found in {TEST}")
    e = text.index("expect=(", m.end())
    pos = e
    for row in rows:
        r = re.compile(r"Row\([^()]*\)").search(text, pos)
        new = fmt(row)
        text = text[: r.start()] + new + text[r.end() :]
        pos = r.start() + len(new)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--print", action="store_true", help="print fresh Row(...) lines")
    ap.add_argument("--write", action="store_true", help="rewrite the Row(...) numbers in tests/test_vllm_rules.py")
    ap.add_argument("--mutants", action="store_true", help="check each case changes under its rule's vLLM mutant")
    ap.add_argument("--case", action="append", help="only these cases")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    mod = load_cases()
    cases = [c for c in mod.CASES if not a.case or c.name in a.case]
    if a.mutants:
        return run_mutants(mod, cases)
    text = TEST.read_text()
    bad = 0
    for case in cases:
        rows = vllm_rows(mod, case)
        same = list(rows) == list(case.expect)
        try:
            case.shows(rows)
            shown = "shows its rule"
        except AssertionError as exc:
            shown = f"DOES NOT SHOW ITS RULE ({exc!r})"
            bad += 1
        bad += not same
        print(f"{case.name} [{case.rule}]: {'literals match' if same else 'LITERALS DIFFER'}; {shown}")
        if a.print or not same:
            for i, (row, exp) in enumerate(zip(rows, case.expect, strict=False)):
                mark = "" if row == exp else f"   # literal: {fmt(exp)}"
                print(f"    {fmt(row)},  # {chr(65 + i)}{mark}")
        if a.write and not same:
            text = rewrite(text, case.name, rows)
    if a.write:
        TEST.write_text(text)
        print(f"wrote {TEST}")
    return 1 if bad and not a.write else 0


if __name__ == "__main__":
    sys.exit(main())
