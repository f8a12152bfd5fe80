"""Critical sections that Ctrl-C and SIGTERM cannot split.

`with DeferredInterrupts():` holds SIGINT and SIGTERM back; one that arrives inside is
delivered, through the handler that was in place, when the block ends. Two mechanisms,
both needed:
- the Python handlers are replaced by one that only records the signal: a process-directed
  signal may land on any thread (numpy's BLAS threads exist before we run), and CPython then
  runs the handler in the main thread whatever the main thread's signal mask is;
- the main thread's mask blocks them too, so a child process started inside the block
  (spawn keeps the mask across exec; multiprocessing's fork server, started inside the
  first such block, keeps it for every child it forks) is born with them blocked and can
  choose to ignore them before it unblocks them (experiments/runs/cell_pool.py).
Outside the main thread (where handlers cannot be set) the block defers nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DeferredInterrupts:
    """A context manager deferring SIGINT/SIGTERM to its end."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self._handlers: dict[int, object] = {}
        self._mask: set[signal.Signals] = set()

    def __enter__(self) -> DeferredInterrupts:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._handlers = {s: signal.signal(s, self._hold) for s in SIGNALS}
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        return self

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self.pending = signum

    def __exit__(self, *exc: object) -> None:
        if not self._handlers:
            return
        for s, handler in self._handlers.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._handlers = {}
        # handlers first: a signal the mask held is delivered now, to the restored handler
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        if self.pending is not None:
            self._deliver(self.pending)

    def _deliver(self, signum: int) -> None:
        handler = signal.getsignal(signum)
        if callable(handler):
            handler(signum, None)  # default_int_handler raises KeyboardInterrupt
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), signum)
