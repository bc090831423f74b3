"""The clients' liveness clock: when a client with work outstanding pings its server, and when it
gives the server up (ClientCore.tick asks it; both shells drive it with monotonic times)."""

from __future__ import annotations

from collections.abc import Callable


class Liveness:
    """When a client with work outstanding pings the server, and when it gives up on it.

    Driven with monotonic times.  Idle clients are never woken by it: `poll_interval` is None
    while nothing is outstanding.
    """

    def __init__(self, address: str, connect_timeout: float | None, reply_timeout: float | None, now: float):
        self.address = address
        self.connect_timeout = connect_timeout
        self.reply_timeout = reply_timeout
        self.connected = False
        self._quiet_since = now  # start of the current wait with nothing heard
        self._pinged = False
        self._busy = False

    def heard(self, now: float) -> None:
        self._quiet_since, self._pinged = now, False

    def on_connected(self, now: float) -> None:
        self.connected = True
        self.heard(now)

    def on_disconnected(self, now: float) -> None:
        self.connected = False
        self.heard(now)

    def poll_interval(self, busy: bool) -> float | None:
        limits = [t for t in (self.connect_timeout, self.reply_timeout) if t is not None]
        if not busy or not limits:
            return None
        return min(1.0, max(0.05, min(limits) / 4))

    def check(
        self, now: float, busy: bool, longest_wait: Callable[[], float | None] | None = None
    ) -> str | None:
        """ "ping" when a keep-alive ping is due, a failure message when the server is given up, else None.

        longest_wait: the longest a caller with work outstanding said it would wait for a reply
        (a stream's timeout), asked only once reply_timeout has passed: the server is not given
        up before that caller's own time-out (a server still loading its model answers nothing,
        not even pings, and `generate --timeout 300` must wait the 300 s)."""
        if busy and not self._busy:
            self.heard(now)  # the clock starts when work starts, not at the last reply of long ago
        self._busy = busy
        if not busy:
            return None
        quiet = now - self._quiet_since
        if not self.connected:
            if self.connect_timeout is not None and quiet > self.connect_timeout:
                self.heard(now)
                return f"no connection to the server at {self.address} within {self.connect_timeout:g} s"
            return None
        if self.reply_timeout is None:
            return None
        if quiet > self.reply_timeout:
            limit = self.reply_timeout
            wait = longest_wait() if longest_wait is not None else None
            if wait is not None and wait > limit:
                if quiet <= wait:
                    return None
                limit = wait
            self.heard(now)
            return f"no reply from the server at {self.address} within {limit:g} s"
        if quiet > self.reply_timeout / 3 and not self._pinged:
            self._pinged = True
            return "ping"
        return None
