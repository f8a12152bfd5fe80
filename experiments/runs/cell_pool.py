"""Run tasks (cells, the bounds) in child processes, at most `jobs` at once, one process per task.

One process per task, rather than a `ProcessPoolExecutor`, because of how tasks fail:
- a task whose process is killed (SIGKILL from the out-of-memory killer) is named exactly,
  with its signal, and only that task fails: a process pool would break as a whole
  (`BrokenProcessPool`) without saying which task killed it, and fail the others too;
- on Ctrl-C or SIGTERM the parent kills every child at once (`Process.kill`, a public
  API) instead of waiting for the running tasks to finish.
Children are forked by multiprocessing's fork server where the platform has one (POSIX):
a clean single-threaded process, started once per parent, that has imported what a task
and `python -m experiments` need (`_PRELOAD`), so a child starts in milliseconds instead of
a fresh interpreter's 0.3–0.5 s of imports (21 tasks in `make mooncake`); the parent, which
may hold threads, is never forked. Elsewhere they start with `spawn`. Either way a child
runs in the parent's environment as it is when the task starts (sent with the task: the
server's own is the parent's at the server's start), with SIGINT blocked from birth (the
server itself starts with it blocked), then ignores it: Ctrl-C in a terminal reaches the
whole process group, and the parent alone answers it, without a child's traceback.

`CellPool.results(tasks)` yields `(index, result)` as tasks finish, so the caller saves each
one at once; after the last, `TasksFailed` names every task that raised or died.
`TaskBeside(task)` runs one task in a child process while the caller goes on with its own
work (a report's largest figure while the rest is written); its failure is a `TasksFailed`
too. `PickledOnce(value)` is an argument many tasks share, pickled once for all of them.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import signal
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from cachelib.hashing import numba_installed
from experiments.runs.interrupts import SIGNALS, DeferredInterrupts

#: what the fork server imports once for every child: the cell tasks (experiments.runs.cell_runs,
#: under the command line) and the command line itself, which a child of `python -m
#: experiments` imports again as its `__mp_main__`; where the `fast` extra is installed, the
#: compiled loops every serving cell and every apc cache load (numba and the code from its
#: cache: ~0.3 s a process, paid once here instead of in each child)
_PRELOAD = [
    "experiments.cli.main",
    *(["experiments.engine.precompiled", "cachelib.xxh3_chain"] if numba_installed() else []),
]


def _context() -> multiprocessing.context.BaseContext:
    """The fork server's context, preloaded and reaped at exit, where the platform has one;
    else spawn's."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    atexit.register(_reap_fork_server)
    return ctx


def _reap_fork_server() -> None:
    """At exit, stop the fork server and wait for it. It reaps the children it forked, so
    their CPU time and peak memory then reach this process's accounting of its children
    (`RUSAGE_CHILDREN`, what `/usr/bin/time` reports), as spawned children's do; a server
    left to end after us is never waited for, and their usage would be lost. (`_stop` is
    multiprocessing's own way to stop its server, used by its tests; where a version lacks
    it the server ends as it otherwise would.)"""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


_CONTEXT = _context()


@dataclass(frozen=True)
class Task:
    """A picklable module-level function and its arguments; `label` names it in errors."""

    label: str
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


class PickledOnce:
    """An argument that many tasks share (a workload of 12k requests), pickled once here.

    Each task's start-up pickles its arguments for the child again; this one then copies
    bytes (milliseconds) instead of walking every request (0.1 s each time). The child
    unpickles it into the value itself, so the task's function never sees this wrapper."""

    def __init__(self, value: Any) -> None:
        self.data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def __reduce__(self) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
        return pickle.loads, (self.data,)


@dataclass(frozen=True)
class Failure:
    """How one task failed: the exception it raised, or the signal that killed its process."""

    label: str
    error: BaseException | None = None
    signal_name: str | None = None
    exitcode: int | None = None
    trace: str | None = None  # the formatted traceback of `error`, shown when it is a bug

    def text(self) -> str:
        if self.error is not None:
            return f"{self.label}: {type(self.error).__name__}: {self.error}"
        if self.signal_name is not None:
            hint = " (out of memory?)" if self.signal_name == "SIGKILL" else ""
            return f"{self.label}: its process was killed by {self.signal_name}{hint}"
        return f"{self.label}: its process exited with code {self.exitcode} without a result"


class TasksFailed(Exception):
    """One or more tasks raised or died; the others ran to the end."""

    def __init__(self, failures: list[Failure], note: str = "") -> None:
        self.failures = failures
        self.note = note  # what the caller kept, how to resume
        super().__init__("; ".join([*(f.text() for f in failures), *([note] if note else [])]))

    def raised_only(self, kinds: tuple[type[BaseException], ...]) -> bool:
        """Every failure is an exception of one of `kinds` (none died)."""
        return all(f.error is not None and isinstance(f.error, kinds) for f in self.failures)

    def tracebacks(self, expected: tuple[type[BaseException], ...]) -> list[str]:
        """The tracebacks of the failures that raised an error not of the `expected` kinds (bugs)."""
        return [f.trace for f in self.failures if f.trace and not isinstance(f.error, expected)]


def _child(conn: Connection, fn: Callable[..., Any], args: tuple[Any, ...], environ: dict[str, str]) -> None:
    """A child's body: run the task in the parent's `environ`, send ("ok", result) or
    ("raised", (exception, traceback))."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent answers Ctrl-C and kills us
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # blocked since birth, see CellPool._start
    if os.environ != environ:  # forked by the server: its environment is the parent's of then
        os.environ.clear()
        os.environ.update(environ)
    try:
        message: tuple[str, Any] = ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - every error goes back to the parent, named
        message = ("raised", (exc, traceback.format_exc()))
    try:
        conn.send(message)
    except Exception as exc:  # noqa: BLE001 - an exception that does not pickle
        conn.send(("raised", (RuntimeError(f"{type(exc).__name__}: {exc}"), traceback.format_exc())))
    conn.close()


@dataclass
class _Running:
    index: int
    task: Task
    process: multiprocessing.process.BaseProcess
    conn: Connection


class CellPool:
    """At most `jobs` tasks at once, each in its own child process."""

    def __init__(self, jobs: int) -> None:
        self.jobs = max(1, jobs)

    def results(self, tasks: list[Task]) -> Iterator[tuple[int, Any]]:
        """Yield `(index, result)` as tasks finish; then raise `TasksFailed` if any failed.

        If the caller stops early (an exception, Ctrl-C), every running child is killed."""
        waiting = list(enumerate(tasks))
        waiting.reverse()  # pop() from the end starts tasks in order
        running: dict[Any, _Running] = {}
        failures: list[Failure] = []
        try:
            while waiting or running:
                while waiting and len(running) < self.jobs:
                    index, task = waiting.pop()
                    # an interrupt in the middle of start() would cut the child's start-up
                    # data short (a traceback in the child) or leave it unregistered (not killed)
                    with DeferredInterrupts():
                        run = _start(index, task)
                        running[run.conn] = run
                ready = wait([*running, *(r.process.sentinel for r in running.values())])
                for run in [r for r in running.values() if r.conn in ready or r.process.sentinel in ready]:
                    outcome = _collect(run)
                    del running[run.conn]
                    if isinstance(outcome, Failure):
                        failures.append(outcome)
                    else:
                        yield run.index, outcome[0]
        finally:
            for run in running.values():
                run.process.kill()
                run.process.join()
                run.conn.close()
        if failures:
            raise TasksFailed(failures)


class TaskBeside:
    """One task in a child process while the caller works: `with TaskBeside(task) as t:`,
    then `t.result()` waits for it (`TasksFailed` naming it if it raised or died). Leaving
    the block before that (an error, Ctrl-C) kills the child."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self._run: _Running | None = None

    def __enter__(self) -> TaskBeside:
        with DeferredInterrupts():  # as in CellPool.results: no half-started child
            self._run = _start(0, self.task)
        return self

    def result(self) -> Any:
        run = self._run
        if run is None:
            raise RuntimeError(f"{self.task.label}: result() called twice or outside the block")
        wait([run.conn, run.process.sentinel])  # interrupted here: __exit__ still kills the child
        outcome = _collect(run)
        self._run = None
        if isinstance(outcome, Failure):
            raise TasksFailed([outcome])
        return outcome[0]

    def __exit__(self, *exc: object) -> None:
        if self._run is not None:
            self._run.process.kill()
            self._run.process.join()
            self._run.conn.close()
            self._run = None


def _start(index: int, task: Task) -> _Running:
    """Start `task`'s child; to be called with SIGINT/SIGTERM blocked (`DeferredInterrupts`):
    the child inherits that mask (through spawn's exec, or from the fork server, which the
    first start makes here and so inherits it too), so it never sees a Ctrl-C before it has
    chosen to ignore it."""
    recv, send = _CONTEXT.Pipe(duplex=False)
    args = (send, task.fn, task.args, dict(os.environ))
    process = _CONTEXT.Process(target=_child, args=args, name=f"cell-{index}", daemon=True)
    process.start()
    send.close()  # the child holds the only write end: EOF once it is gone
    return _Running(index, task, process, recv)


def _collect(run: _Running) -> tuple[Any] | Failure:
    """The finished task's result (as a 1-tuple), or how it failed."""
    message = None
    try:
        if run.conn.poll():
            message = run.conn.recv()
    except (EOFError, OSError):
        message = None
    run.process.join()
    run.conn.close()
    if message is not None and message[0] == "ok":
        return (message[1],)
    if message is not None:
        error, trace = message[1]
        return Failure(run.task.label, error=error, trace=trace)
    code = run.process.exitcode
    if code is not None and code < 0:
        return Failure(run.task.label, signal_name=signal.Signals(-code).name, exitcode=code)
    return Failure(run.task.label, exitcode=code)
