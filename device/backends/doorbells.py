"""The two host-side signals every backend has: the frontend rings `doorbell` after publishing SQ
entries, and the backend sets `events` (a CompletionSignal) when CQ events may be ready for the
completion thread."""

from __future__ import annotations

import threading
import time

from ringleader.device.backends.common import RecentValues, percentile


class CompletionSignal:
    """threading.Event's set/wait for the completion thread's wake-up, which also counts the
    wake-ups and keeps their latency: from the first set() since the last wake-up to the waiter
    running again.  set() from the engine thread or the CQ poller; wait() by the completion
    thread alone; stats read the figures (as StepTimer's, whose RecentValues they share)."""

    def __init__(self):
        self._event = threading.Event()
        self._set_ns = 0  # when the pending wake-up was first asked for (0: none pending)
        self.wakes = 0  # wait() calls that returned because of a set()
        self.latency_us = RecentValues(4096)

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
        if not self._event.wait(timeout):
            return False
        now = time.perf_counter_ns()
        set_ns, self._set_ns = self._set_ns, 0
        self._event.clear()
        self.wakes += 1
        if set_ns:
            self.latency_us.append((now - set_ns) / 1e3)
        return True

    def figures(self) -> dict:
        """completion_wakes and the wake latency's p50/p99 (µs, over the last 4096 wake-ups)."""
        return {
            "completion_wakes": self.wakes,
            "wake_latency_us_p50": percentile(self.latency_us, 50),
            "wake_latency_us_p99": percentile(self.latency_us, 99),
        }


class Doorbells:
    def __init__(self):
        self._doorbell = threading.Event()
        self._events = CompletionSignal()

    def wake(self) -> None:
        self._doorbell.set()

    def wait_for_events(self, timeout: float) -> None:
        self._events.wait(timeout)
