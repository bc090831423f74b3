"""Server-side counters, latency histograms and the host's CPU use, for `stats`, for the
benchmark and for the Prometheus exporter (hostctl/serving/prometheus.py, docs/metrics.md).

CPU time is read for the whole process (what a deployment pays: time.process_time, the kernel's
CLOCK_PROCESS_CPUTIME_ID, in nanoseconds) and per thread from /proc/self/task/<tid>/schedstat
(nanoseconds on CPU; the clock ticks of .../stat where schedstat is missing), so the cost of
the IO and completion threads can be told apart from the CPU backend's compute thread, even
over a benchmark run of a second or two (a 10-ms tick cannot).  The process's resident set
(/proc/self/statm) is reported too, so a soak run can watch a server it did not start.

The histograms are ringleader.ipc.histogram.Histogram (a bisect and three adds; nothing from
prometheus_client is touched on the per-token path), all written under ServerMetrics' one lock:
the completion thread takes it once per CQ batch (`routed`), and either thread once per `done`
(`finished`); `snapshot_with_histograms` reads under the same lock, so what one scrape sees is
consistent.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from ringleader.ipc import protocol
from ringleader.ipc.histogram import TTFT_BUCKETS, Histogram, HistogramSnapshot, buckets_125

__all__ = [
    "Histogram",
    "HistogramSnapshot",
    "ServerMetrics",
    "pid_cpu_seconds",
    "process_cpu_seconds",
    "process_rss_bytes",
    "thread_cpu_seconds",
]

# Bucket bounds in seconds (TTFT's are ipc/histogram.py's, shared with the gateway): vLLM's, with
# finer ones below its smallest where a GPU server lands (histogram_quantile works on any bounds).
TOKEN_LATENCY_BUCKETS = (  # inter-token latency and time per output token
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (  # end to end, and queue time
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS = buckets_125(1_000_000)

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_cpu_seconds() -> float:
    """User + system CPU of this process, every thread of it (ended ones too), not its children:
    what os.times() user + system counts, at the scheduler's nanoseconds instead of 10-ms ticks."""
    return time.process_time()


def process_rss_bytes() -> int | None:
    """Resident set size of this process (None where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def thread_cpu_seconds(native_id: int | None) -> float | None:
    """CPU seconds of one thread of this process (threading.get_native_id()): the first field of
    /proc/self/task/<tid>/schedstat (nanoseconds on CPU, user + system), else utime + stime of
    .../stat in clock ticks (a kernel without schedstats); None where neither can be read."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    return _stat_ticks_seconds(f"/proc/self/task/{native_id}/stat")


def pid_cpu_seconds(pid: int) -> float | None:
    """User + system CPU of another live process (all its threads), in nanoseconds where the C
    library gives its CPU clock (clock_getcpuclockid), else from /proc/<pid>/stat in clock ticks;
    None when neither works (the process is gone, not Linux)."""
    clock = _cpu_clock_of(pid)
    if clock is not None:
        try:
            return time.clock_gettime(clock)
        except (OSError, OverflowError, AttributeError):
            pass
    return _stat_ticks_seconds(f"/proc/{pid}/stat")


def _cpu_clock_of(pid: int) -> int | None:
    libc = _libc()
    clock = ctypes.c_int()
    if libc is None or libc.clock_getcpuclockid(ctypes.c_int(pid), ctypes.byref(clock)) != 0:
        return None  # ESRCH: no such process
    return clock.value


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.clock_getcpuclockid  # noqa: B018 (AttributeError where the C library lacks it)
        return libc
    except (OSError, TypeError, AttributeError):
        return None


def _stat_ticks_seconds(path: str) -> float | None:
    """utime + stime of a /proc/.../stat file, in seconds (at the kernel's tick)."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


class ServerMetrics:
    """Counters and histograms of the server.  Each is written by one thread, or under the lock;
    `snapshot` and `snapshot_with_histograms` may run on any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.time()
        self.accepted = 0  # frontend thread
        self.rejected_bad_request = 0  # frontend thread, through rejected()
        self.rejected_overloaded = 0  # frontend thread, through rejected()
        self.rejected_by_code: dict[str, int] = {}  # frontend thread, under the lock: every code
        self.finished_by_reason: dict[str, int] = {}  # both threads, under the lock (Finisher.end)
        self.errors_by_code: dict[str, int] = {}  # both threads, under the lock (Finisher.end)
        self.output_tokens = 0  # completion thread, under the lock
        self.prompt_tokens = 0  # completion thread, under the lock: at each request's first token
        self.bad_frames = 0  # frontend thread
        # under the lock: the completion thread (routed) and both threads (finished)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.inter_token = Histogram(TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = Histogram(TOKEN_LATENCY_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = Histogram(TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = Histogram(TOKEN_COUNT_BUCKETS)

    def routed(
        self,
        n_tokens: int,
        prompt_tokens: int,
        ttft_s: list[float],
        gaps_ns: Sequence[float] | np.ndarray,
        gap_tokens: Sequence[int] | np.ndarray,
    ) -> None:
        """One CQ batch, from the completion thread, under one lock: its output tokens, the
        prompt tokens of the requests that got their first token, those requests' TTFTs, and
        for every other chunk the gap per token since its request's last one (ns) and its
        tokens (the inter-token latency)."""
        with self._lock:
            self.output_tokens += n_tokens
            self.prompt_tokens += prompt_tokens
            observe = self.ttft.observe
            for v in ttft_s:
                observe(v)
            self.inter_token.observe_many(gaps_ns, gap_tokens, scale=1e-9)

    def rejected(self, code: str) -> None:
        """Counts a generate that was never accepted: by code, every one; in the two older
        fields, shutdown and engine_dead are not counted."""
        with self._lock:
            self.rejected_by_code[code] = self.rejected_by_code.get(code, 0) + 1
            if code == protocol.ERR_OVERLOADED:
                self.rejected_overloaded += 1
            elif code in (protocol.ERR_BAD_REQUEST, protocol.ERR_DUPLICATE_ID):
                self.rejected_bad_request += 1

    def finished(self, req, reason: str, code: str | None = None, timing: dict | None = None) -> None:
        """Counts an accepted request's one `done` (Finisher.end); timing: the `done`'s own
        (finisher.server_timing), so the histograms and the frame agree to the nanosecond."""
        with self._lock:
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
            if code is not None:
                self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1
            if timing is None:
                return
            self.e2e.observe(timing["e2e_ms"] / 1e3)
            queue_ms = timing.get("queue_ms")
            if queue_ms is not None:
                self.queue.observe(queue_ms / 1e3)
            n = req.completion_tokens
            if n >= 2 and req.first_token_ns and req.last_token_ns:
                self.time_per_output_token.observe((req.last_token_ns - req.first_token_ns) / 1e9 / (n - 1))
            self.request_prompt_tokens.observe(req.prompt_len)
            self.request_generation_tokens.observe(n)

    def snapshot(self) -> dict:
        with self._lock:
            out = self._snapshot_locked()
        # read outside the lock: a /proc read must not hold up the completion thread
        out.update(process_cpu_s=process_cpu_seconds(), process_rss_bytes=process_rss_bytes())
        return out

    def snapshot_with_histograms(self) -> tuple[dict, dict[str, HistogramSnapshot]]:
        """snapshot() and every histogram, from one moment (the exporter's view: a scrape never
        sees a `done` counted whose latencies are not, or the reverse)."""
        with self._lock:
            return self._snapshot_locked(), {
                "ttft_s": self.ttft.snapshot(),
                "inter_token_s": self.inter_token.snapshot(),
                "time_per_output_token_s": self.time_per_output_token.snapshot(),
                "e2e_s": self.e2e.snapshot(),
                "queue_s": self.queue.snapshot(),
                "request_prompt_tokens": self.request_prompt_tokens.snapshot(),
                "request_generation_tokens": self.request_generation_tokens.snapshot(),
            }

    def _snapshot_locked(self) -> dict:
        return {
            "uptime_s": time.time() - self.started,
            "accepted": self.accepted,
            "rejected_bad_request": self.rejected_bad_request,
            "rejected_overloaded": self.rejected_overloaded,
            "rejected_by_code": dict(self.rejected_by_code),
            "bad_frames": self.bad_frames,
            "finished": dict(self.finished_by_reason),
            "errors_by_code": dict(self.errors_by_code),
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
        }
