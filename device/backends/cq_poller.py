"""Watching the CQ tail that the device scheduler publishes in pinned memory, for the completion
thread: the host's only per-step work in device mode, so what it costs is what device mode costs.

The first H100 run (bench/results/2026-11-25-h100-bringup) polled every 20 µs whatever happened:
about 20 wake-ups per 1.57 ms step, 0.157 CPU-s per 1k tokens at one stream, more than the whole
host scheduler's thread (0.089).  Steps are regular, and CQ events arrive once per step, so this
poller sleeps through most of a step:

- after an event it sleeps until the next one is due, the shortest of the recent intervals less a
  margin, then polls every FINE_S until it comes; an event already there when it wakes means the
  steps got shorter, and the next interval is measured afresh;
- with nothing due (no event or submission for IDLE_AFTER_S) it waits on the doorbell the
  frontend rings after it publishes SQ entries, IDLE_S at a time, so a new request is watched
  from the moment it is submitted and an idle engine costs a few hundred wake-ups a second.

`figures()` says what it cost and how late it saw the CQ move: reads per change and, per change,
the time since the read before (the change happened in between), in the server's stats.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from ringleader.device.backends.common import RecentValues, percentile


class CqPoller:
    FINE_S = 20e-6  # the poll interval while an event is due
    IDLE_S = 2e-3  # the doorbell wait while nothing is due: exit and device-side ends seen within it
    IDLE_AFTER_S = 0.05  # no event or submission this long: idle
    MARGIN_FRAC = 0.1  # wake this share of the expected interval early ...
    MIN_MARGIN_S = 150e-6  # ... and at least this early: a fine poll's lag plus a sleep's overshoot
    RECENT = 8  # intervals remembered; their minimum is the expected one

    def __init__(
        self,
        read_tail: Callable[[], int],
        ended: Callable[[], bool],
        wake: Callable[[], None],
        doorbell: threading.Event,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self._read_tail = read_tail
        self._ended = ended
        self._wake = wake
        self._doorbell = doorbell
        self._clock = clock
        self._sleep = sleep
        self._intervals: collections.deque[float] = collections.deque(maxlen=self.RECENT)
        self.polls = 0  # tail reads: what the loop costs, for tests and benchmarks
        self.changes = 0  # reads that found the tail moved (each wakes the completion thread once)
        # µs between the read that found the tail moved and the read before it: a bound on how
        # late the change was seen (it happened between the two); the last 4096 of them
        self.seen_lag_us = RecentValues(4096)

    def figures(self) -> dict:
        """cq_polls, cq_polls_per_change and the seen-lag bound's p50/p99 (µs), for stats."""
        changes = self.changes
        return {
            "cq_polls": self.polls,
            "cq_polls_per_change": self.polls / changes if changes else None,
            "cq_seen_lag_us_p50": percentile(self.seen_lag_us, 50),
            "cq_seen_lag_us_p99": percentile(self.seen_lag_us, 99),
        }

    def expected_interval(self) -> float | None:
        return min(self._intervals) if self._intervals else None

    def run(self) -> None:
        last_tail = self._read_tail()
        last_event: float | None = None
        active_since = self._clock()  # an event or a submission: the time an event may be due from
        slept = False  # the last read was the first after sleeping until an event was due
        last_read = self._clock()
        while not self._ended():
            tail = self._read_tail()
            self.polls += 1
            now = self._clock()
            previous_read, last_read = last_read, now
            if tail != last_tail:
                self.changes += 1
                self.seen_lag_us.append((now - previous_read) * 1e6)
                if slept:  # it came before we woke: steps got shorter; measure the next one afresh
                    self._intervals.clear()
                elif last_event is not None and now - last_event < self.IDLE_AFTER_S:
                    self._intervals.append(now - last_event)
                last_tail, last_event, active_since = tail, now, now
                self._wake()
                slept = self._sleep_until_due()
                continue
            slept = False
            if self._doorbell.is_set():
                self._doorbell.clear()
                active_since = now
            if now - active_since < self.IDLE_AFTER_S:
                self._sleep(self.FINE_S)
            elif self._doorbell.wait(self.IDLE_S):
                self._doorbell.clear()
                active_since = self._clock()

    def _sleep_until_due(self) -> bool:
        """Sleeps until the next event is due, less the margin; False when no interval is known."""
        expected = self.expected_interval()
        if expected is None:
            return False
        pause = expected - max(self.MIN_MARGIN_S, self.MARGIN_FRAC * expected)
        if pause <= self.FINE_S:
            return False
        self._sleep(pause)
        return True
