"""The two host-side signals every backend has: the frontend rings `doorbell` after publishing SQ
entries, and the backend sets `events` (a CompletionSignal) when CQ events may be ready for the
completion thread."""

from __future__ import annotations

import threading
import time

from ringleader.ipc.histogram import Histogram

# µs from the engine (or the CQ poller) setting the signal to the completion thread running
WAKE_LATENCY_BUCKETS = (5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 20000)


class CompletionSignal:
    """threading.Event's set/wait for the completion thread's wake-up, which also counts the
    wake-ups and measures their latency: from the first set() since the last wake-up to the
    waiter running again.  set() from the engine thread or the CQ poller; wait() by the
    completion thread alone; the figures under `_lock`, read by stats from any thread."""

    def __init__(self):
        self._event = threading.Event()
        self._set_ns = 0  # when the pending wake-up was first asked for (0: none pending)
        self._lock = threading.Lock()
        self.wakes = 0  # wait() calls that returned because of a set()
        self.latency_us = Histogram(WAKE_LATENCY_BUCKETS)

    def set(self) -> None:
        if not self._event.is_set():
            self._set_ns = time.perf_counter_ns()
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def clear(self) -> None:
        self._event.clear()

    def wait(self, timeout: float) -> bool:
        """Blocks until set() or `timeout` seconds; clears the signal; True when it was set."""
        woke = self._event.wait(timeout)
        if not woke:
            return False
        now = time.perf_counter_ns()
        set_ns, self._set_ns = self._set_ns, 0
        self._event.clear()
        with self._lock:
            self.wakes += 1
            if set_ns:
                self.latency_us.observe((now - set_ns) / 1e3)
        return True

    def figures(self) -> dict:
        """completion_wakes and the wake latency's p50/p99 (µs, from the buckets' bounds)."""
        with self._lock:
            snap = self.latency_us.snapshot()
            wakes = self.wakes
        out: dict = {"completion_wakes": wakes}
        for name, q in (("wake_latency_us_p50", 0.5), ("wake_latency_us_p99", 0.99)):
            out[name] = bucket_quantile(snap.bounds, snap.counts, q)
        return out


def bucket_quantile(bounds: tuple[float, ...], counts: tuple[int, ...], q: float) -> float | None:
    """The upper bound of the bucket holding quantile q (None without observations; the last
    bound doubled for the +Inf bucket)."""
    total = sum(counts)
    if not total:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return bounds[i] if i < len(bounds) else 2 * bounds[-1]
    return 2 * bounds[-1]


class Doorbells:
    def __init__(self):
        self._doorbell = threading.Event()
        self._events = CompletionSignal()

    def wake(self) -> None:
        self._doorbell.set()

    def wait_for_events(self, timeout: float) -> None:
        self._events.wait(timeout)
