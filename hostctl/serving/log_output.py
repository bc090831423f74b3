"""The server's log output: the threads that log never wait for stderr.

The completion thread logs a line per finished request (hostctl/serving/finisher.py).  Written straight
to stderr, a reader that stops reading (a full pipe, a stopped terminal) would stop that thread
and with it every stream.  So records go into a bounded queue, and one daemon thread formats them
and writes them with os.write to the stderr descriptor; a full queue drops the line and counts it
(`dropped`).  The writer holds no Python lock while it waits in write(2), so even a writer stuck
on a pipe that is never read lets the process exit."""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUEUE_LINES = 10_000


class _Enqueue(logging.Handler):
    def __init__(self, lines: queue.Queue):
        super().__init__()
        self._lines = lines
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.put_nowait(record)
        except queue.Full:
            self.dropped += 1


class LogOutput:
    """Installs itself as the root logger's only handler at `level`; stop() at exit."""

    def __init__(self, level: str | int, fd: int | None = None):
        self._fd = sys.stderr.fileno() if fd is None else fd
        self._formatter = logging.Formatter(LOG_FORMAT)
        self._lines: queue.Queue = queue.Queue(QUEUE_LINES)
        self._handler = _Enqueue(self._lines)
        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        root.addHandler(self._handler)
        root.setLevel(level)
        self._thread = threading.Thread(target=self._write_lines, name="rl-log", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self._handler.dropped

    def _write_lines(self) -> None:
        while True:
            record = self._lines.get()
            if record is None:
                return
            try:
                data = (self._formatter.format(record) + "\n").encode("utf-8", "replace")
                while data:
                    data = data[os.write(self._fd, data) :]
            except Exception:  # a log line must never take the writer down
                pass

    def stop(self, timeout: float = 2.0) -> None:
        """Writes what is queued (for at most `timeout` s), then detaches from the root logger."""
        try:
            self._lines.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        logging.getLogger().removeHandler(self._handler)
        if self.dropped:
            print(f"ringleader: {self.dropped} log lines were dropped (stderr was not read)", file=sys.stderr)
