"""The wake pipe: how another thread gets the frontend thread out of its poll at once, instead of
at its next timeout (up to 100 ms later)."""

from __future__ import annotations

import threading

import zmq


class WakePipe:
    """An inproc PUSH/PULL pair on the frontend's ZeroMQ context.  notify() is called from any
    thread (the completion thread when the Outbox has frames, whichever thread opens a Family's
    gate); the frontend thread polls `receiver` and calls drain() when it is readable.

    Wake-ups coalesce: at most one message sits in the pipe, so a busy completion thread costs
    the frontend one wake-up per poll.  `_pending` says one is there; both threads read and
    write it under `_lock`, and the PUSH socket is only touched under that lock too."""

    def __init__(self, context: zmq.Context):
        address = f"inproc://rl-wake-{id(self)}"
        self.receiver = context.socket(zmq.PULL)  # the frontend thread's: its poller holds it
        self.receiver.bind(address)
        self._sender = context.socket(zmq.PUSH)
        self._sender.connect(address)
        self._lock = threading.Lock()
        self._pending = False  # under _lock (both threads)

    def notify(self) -> None:
        """Wakes the frontend thread, unless a wake-up is already on its way.  Any thread."""
        with self._lock:
            if self._pending:
                return
            self._pending = True
            try:
                self._sender.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the pipe is full or closing: the frontend polls again within 100 ms anyway

    def drain(self) -> None:
        """Takes every wake-up out of the pipe; the next notify() sends one again.  Frontend thread."""
        with self._lock:
            if not self._pending:
                return  # nothing was sent since the last drain (a failed send sends nothing either)
            self._pending = False
            try:  # at most one wake-up is in the pipe (notify sends only while none is pending)
                self.receiver.recv(zmq.NOBLOCK)
            except zmq.Again:
                pass  # its send failed (the pipe full or closing)

    def close(self) -> None:
        """Closes both ends (the server's shutdown, or a server that never served)."""
        self.receiver.close(0)
        self._sender.close(0)
