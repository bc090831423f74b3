"""The two host-side signals every backend has: the frontend rings `doorbell` after publishing SQ
entries, and the backend sets `events` when CQ events may be ready for the completion thread."""

from __future__ import annotations

import threading


class Doorbells:
    def __init__(self):
        self._doorbell = threading.Event()
        self._events = threading.Event()

    def wake(self) -> None:
        self._doorbell.set()

    def wait_for_events(self, timeout: float) -> None:
        self._events.wait(timeout)
        self._events.clear()
