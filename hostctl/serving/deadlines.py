"""When requests time out: each request's own timeout_ms (its whole life) and the server's
max_queue_ms (its wait for a batch slot), in one heap; the frontend thread alone uses it.

max_queue_ms counts waiting, not computing: when it comes due the server sends an IF_QUEUED
abort, which the device applies only to a request still in the SQ or its pending queue; one
whose prefill has started (it holds a slot) runs on, however long its prompt takes.

An entry is (perf_counter_ns, handle, kind); entries of requests that ended, or that started
in time, are skipped when they come due, and swept when they outnumber the live ones.
"""

from __future__ import annotations

import heapq
import time

from ringleader.hostctl.serving.inflight import InFlight, RequestTable

_QUEUE_DEADLINE, _REQUEST_DEADLINE = 0, 1


class Deadlines:
    def __init__(self, table: RequestTable, max_queue_ms: float | None):
        self._table = table
        self._max_queue_ns = int(max_queue_ms * 1e6) if max_queue_ms else 0
        self._heap: list[tuple[int, int, int]] = []

    def __len__(self) -> int:
        """Deadlines kept (ended requests' ones included until they come due or are swept)."""
        return len(self._heap)

    def arm(self, req: InFlight, timeout_ms: int | None) -> None:
        """Sets the request's deadlines from its arrival."""
        if self._max_queue_ns:
            req.queue_deadline_ns = req.arrival_ns + self._max_queue_ns
            heapq.heappush(self._heap, (req.queue_deadline_ns, req.handle, _QUEUE_DEADLINE))
        if timeout_ms is not None:
            req.deadline_ns = req.arrival_ns + timeout_ms * 1_000_000
            heapq.heappush(self._heap, (req.deadline_ns, req.handle, _REQUEST_DEADLINE))
        if len(self._heap) > 2 * len(self._table) + 64:  # most belong to ended requests
            self._heap = [d for d in self._heap if self._table.get(d[1]) is not None]
            heapq.heapify(self._heap)

    def next_ns(self) -> int | None:
        """When the next deadline comes due (perf_counter_ns), None when none is set."""
        return self._heap[0][0] if self._heap else None

    def rearm_queue(self, req: InFlight) -> None:
        """Gives a request its queue limit anew from now (one held on the host by admission's
        gate, waiting for its family's prompt or its constraint, has not begun to wait for a slot)."""
        if self._max_queue_ns:
            req.queue_deadline_ns = time.perf_counter_ns() + self._max_queue_ns
            heapq.heappush(self._heap, (req.queue_deadline_ns, req.handle, _QUEUE_DEADLINE))

    def expired(self) -> list[tuple[InFlight, str, bool]]:
        """The requests whose deadline passed, each with its timeout's message and whether it is
        the queue limit (which ends it only while it waits for a slot); the caller ends them."""
        if self._heap and not len(self._table):
            # only the frontend thread adds to the table, so an empty one means every entry is stale
            self._heap.clear()
            return []
        out = []
        now = time.perf_counter_ns()
        while self._heap and self._heap[0][0] <= now:
            when, handle, kind = heapq.heappop(self._heap)
            req = self._table.get(handle)
            if req is None:
                continue
            if kind == _QUEUE_DEADLINE and when == req.queue_deadline_ns and not req.started:
                message = (
                    f"timeout: waited {(now - req.arrival_ns) / 1e6:.0f} ms for a batch slot and its "
                    f"prefill never started (the server's --max-queue-ms is {self._max_queue_ns / 1e6:.0f})"
                )
                out.append((req, message, True))
            elif kind == _REQUEST_DEADLINE and when == req.deadline_ns:
                message = f"timeout: timeout_ms of {(req.deadline_ns - req.arrival_ns) / 1e6:.0f} ms passed"
                out.append((req, message, False))
            # else: started in time, or the handle now belongs to another request
        return out
