"""`VirtualClock`: the serving protocol's time and the requests that have not arrived yet.

One clock is shared by every scheduler of a run (a cluster's replicas too): it holds `now`,
a heap of future arrivals, and the requests that wait for another one to finish (a
conversation's next turn arrives `think_time` after the previous turn finishes).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence as Seq

from experiments.workloads.spec import RequestSpec


class VirtualClock:
    """Time in seconds from 0, and the arrivals scheduled on it (in time, then trace order)."""

    def __init__(self, requests: Seq[RequestSpec] = ()) -> None:
        self.now = 0.0
        self._arrivals: list[tuple[float, int, RequestSpec]] = []  # a heap
        self._blocked: dict[str, list[RequestSpec]] = {}  # request id -> requests that follow it
        self._order = 0  # tie-break for equal times: the order they were scheduled in
        self.schedule(requests)

    def schedule(self, requests: Seq[RequestSpec]) -> None:
        """Arrivals for `requests`; one that follows another request of the same batch
        (`after`) waits until that one finishes (`finished`)."""
        ids = {s.request_id for s in requests}
        for i, s in enumerate(requests, start=self._order):
            if s.after is not None and s.after in ids:
                self._blocked.setdefault(s.after, []).append(s)
            else:
                self._arrivals.append((s.arrival, i, s))
        heapq.heapify(self._arrivals)
        self._order += len(requests)

    def finished(self, request_id: str, at: float) -> None:
        """`request_id` finished at `at`: the requests that follow it arrive their think time later."""
        for dep in self._blocked.pop(request_id, ()):
            self._order += 1
            heapq.heappush(self._arrivals, (at + dep.think_time, self._order, dep))

    def arrived(self) -> list[tuple[float, RequestSpec]]:
        """Pop every arrival due by `now`, in order: `(arrival time, spec)`."""
        out = []
        while self._arrivals and self._arrivals[0][0] <= self.now:
            arrival, _, spec = heapq.heappop(self._arrivals)
            out.append((arrival, spec))
        return out

    def next_arrival(self) -> float | None:
        """When the next request arrives; None when none is scheduled."""
        return self._arrivals[0][0] if self._arrivals else None

    @property
    def has_arrivals(self) -> bool:
        return bool(self._arrivals)
