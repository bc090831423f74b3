"""Server-side counters and the host's CPU use, for `stats` and for the benchmark.

CPU time is read for the whole process (what a deployment pays) and per thread from
/proc/self/task/<tid>/stat where Linux provides it, so the cost of the IO and completion
threads can be told apart from the CPU backend's compute thread.  The process's resident set
(/proc/self/statm) is reported too, so a soak run can watch a server it did not start.
"""

from __future__ import annotations

import os
import threading
import time

from ipc import protocol

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def process_rss_bytes() -> int | None:
    """Resident set size of this process (None where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def thread_cpu_seconds(native_id: int | None) -> float | None:
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


class ServerMetrics:
    """Counters of the server.  Each is written by one thread; `snapshot` may run on any."""

    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.time()
        self.accepted = 0  # frontend thread
        self.rejected_bad_request = 0  # frontend thread, through rejected()
        self.rejected_overloaded = 0  # frontend thread, through rejected()
        self.finished_by_reason: dict[str, int] = {}  # both threads, under the lock (Finisher.end)
        self.output_tokens = 0  # completion thread, under the lock
        self.bad_frames = 0  # frontend thread

    def tokens(self, n: int) -> None:
        with self._lock:
            self.output_tokens += n

    def rejected(self, code: str) -> None:
        """Counts a generate that was never accepted; shutdown and engine_dead are not counted."""
        with self._lock:
            if code == protocol.ERR_OVERLOADED:
                self.rejected_overloaded += 1
            elif code in (protocol.ERR_BAD_REQUEST, protocol.ERR_DUPLICATE_ID):
                self.rejected_bad_request += 1

    def finished(self, req, reason: str) -> None:
        with self._lock:
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "uptime_s": time.time() - self.started,
                "accepted": self.accepted,
                "rejected_bad_request": self.rejected_bad_request,
                "rejected_overloaded": self.rejected_overloaded,
                "bad_frames": self.bad_frames,
                "finished": dict(self.finished_by_reason),
                "output_tokens": self.output_tokens,
                "process_cpu_s": process_cpu_seconds(),
                "process_rss_bytes": process_rss_bytes(),
            }
