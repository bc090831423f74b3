"""The device timeline: per step, the scheduler's and the step graph's %globaltimer stamps
(ringleader.ipc.layout RL_TRACE_*), summarised as bubble, step and scheduler time (timeline_summary holds
the bubble's definition), fed into the metrics' histograms (TimelineFeed), or written as a
Chrome trace."""

from __future__ import annotations

import json
import threading
import time

import numpy as np

from ringleader.ipc import layout
from ringleader.ipc.histogram import Histogram


class TimelineReader:
    """Copies the device's trace ring into pinned memory allocated once, on a stream of its own,
    so reading it while the persistent kernel runs neither allocates nor waits on other work.

    The copy's end is polled for at most `wait_s`, never waited for without a bound: should the
    copy land behind the never-ending launch after all (a hardware queue shared with it), a
    read returns no rows and counts a stalled read instead of hanging stats() for good.  The next
    read first checks whether that copy has landed since, and copies again only then."""

    def __init__(self, device_memory, *, wait_s: float = 2.0, driver=None):
        """driver: the CUDA driver helpers (device/backends/cuda_driver), or a stand-in (tests)."""
        if driver is None:
            from ringleader.device.backends import cuda_driver as driver
        self._drv = driver
        self._src = device_memory.address("trace")
        self._nbytes = device_memory.device_nbytes["trace"]
        self._host = driver.PinnedBuffer(self._nbytes)
        self._stream = driver.create_stream(highest_priority=False)
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._closed = False  # under _lock: the device buffer is gone, read() returns no rows
        self._in_flight = False  # under _lock: a copy that did not land within wait_s
        self.stalled_reads = 0

    def read(self) -> np.ndarray:
        with self._lock:
            if self._closed:
                return _no_rows()
            if not self._in_flight:
                self._drv.copy_to_host(self._host.host_ptr, self._src, self._nbytes, self._stream)
                self._in_flight = True
            deadline = time.monotonic() + self._wait_s
            while not self._drv.stream_done(self._stream):
                if time.monotonic() >= deadline:
                    self.stalled_reads += 1
                    return _no_rows()
                time.sleep(50e-6)
            self._in_flight = False
            return self._host.array.view(np.uint64).reshape(-1, layout.TRACE_FIELDS).copy()

    def close(self) -> None:
        """Before the device buffer is freed: a read (a metrics scrape, say) racing with the
        backend's stop then finds no rows instead of copying from freed memory."""
        with self._lock:
            self._closed = True


def _no_rows() -> np.ndarray:
    return np.zeros((0, layout.TRACE_FIELDS), dtype=np.uint64)


def complete_rows(trace: np.ndarray) -> np.ndarray:
    """Rows whose step finished (both phases and both step stamps written), ordered by seq;
    a row still being written, or never reached, has a zero stamp."""
    core = [
        layout.TraceField.SCHED_BEGIN,
        layout.TraceField.SCHED_END,
        layout.TraceField.STEP_BEGIN,
        layout.TraceField.STEP_END,
        layout.TraceField.SEQ,
    ]
    rows = trace[(trace[:, core] != 0).all(axis=1)].astype(np.int64)
    return rows[np.argsort(rows[:, layout.TraceField.SEQ])]


def host_mode_rows(host_trace: np.ndarray, device_trace: np.ndarray) -> np.ndarray:
    """Host-scheduled mode's timeline: the CPU scheduler's rows (its phases on the host's clock,
    flags, seq) with each step's start and end from the device trace row of the same seq (the
    stamp kernels around each replay, on the device's clock); a row whose device stamps are
    missing or belong to another step keeps zeros there, so complete_rows leaves it out."""
    f = layout.TraceField
    rows = host_trace.astype(np.uint64, copy=True)
    if len(device_trace) != len(rows):  # no device rows (the buffer is gone): no step stamps
        rows[:, [f.STEP_BEGIN, f.STEP_END]] = 0
        return rows
    same_step = (device_trace[:, f.SEQ] == rows[:, f.SEQ]) & (rows[:, f.SEQ] != 0)
    for field in (f.STEP_BEGIN, f.STEP_END):
        rows[:, field] = np.where(same_step, device_trace[:, field], 0)
    return rows


def timeline_summary(trace: np.ndarray, after_seq: int = 0, one_clock: bool = True) -> dict:
    """The device timeline's figures, in microseconds, over the rows whose SEQ (step + 1) is
    above `after_seq`: a load point's own steps when it is the `steps` counter read before it.
    one_clock=False (host mode's rows, host_mode_rows): the phases and the step are stamped on
    two clocks, so only the bubble and the step (both device stamps) are given.

    Bubble: the GPU's idle time between two consecutive steps while work was ready, from the
    previous step's end (its signal kernel) to the next step's start (the first kernel of its
    SWITCH branch; in host mode, the stamp kernels around each replay).  A gap counts only when the next step's row is chained: the scheduler built
    a step, and no pass since found nothing to do, so idle time and client think time are never
    counted (they show as idle_gaps).  Its parts: handoff (step end -> the critical phase
    starts), device_sched (the critical phase) and launch (critical end -> the step's first
    kernel).  overlap_overruns counts steps whose overlapped phase ended after the step did,
    which delays the next critical phase.  void_steps counts the void steps (TraceFlag.VOID: a
    planned step handed over with pad rows only, every planned row's request having ended).
    They stay in the chained gaps and in step_us: a void step is real GPU time, and the GPU waits
    before and after it as around any step, so dropping those gaps would hide bubble."""
    rows = complete_rows(trace)
    rows = rows[rows[:, layout.TraceField.SEQ] > after_seq]
    out: dict = {}
    if len(rows) == 0:
        return out
    pct = lambda v, q: float(np.percentile(v, q)) if len(v) else None  # noqa: E731
    f = layout
    step = (rows[:, f.TraceField.STEP_END] - rows[:, f.TraceField.STEP_BEGIN]) / 1e3
    sched = (rows[:, f.TraceField.SCHED_END] - rows[:, f.TraceField.SCHED_BEGIN]) / 1e3
    has_overlap = (rows[:, f.TraceField.OVERLAP_BEGIN] != 0) & (rows[:, f.TraceField.OVERLAP_END] != 0)
    overlap = (
        rows[has_overlap, f.TraceField.OVERLAP_END] - rows[has_overlap, f.TraceField.OVERLAP_BEGIN]
    ) / 1e3
    overruns = int(
        (rows[has_overlap, f.TraceField.OVERLAP_END] > rows[has_overlap, f.TraceField.STEP_END]).sum()
    )
    prev, cur = rows[:-1], rows[1:]
    consecutive = cur[:, f.TraceField.SEQ] == prev[:, f.TraceField.SEQ] + 1
    chained = consecutive & ((cur[:, f.TraceField.FLAGS] & f.TraceFlag.CHAINED) != 0)
    p, c = prev[chained], cur[chained]
    bubble = (c[:, f.TraceField.STEP_BEGIN] - p[:, f.TraceField.STEP_END]) / 1e3
    handoff = (c[:, f.TraceField.SCHED_BEGIN] - p[:, f.TraceField.STEP_END]) / 1e3
    launch = (c[:, f.TraceField.STEP_BEGIN] - c[:, f.TraceField.SCHED_END]) / 1e3
    figures = [("bubble_us", bubble), ("step_us", step)]
    if one_clock:  # a difference across the host's and the device's clocks means nothing
        figures += [
            ("device_sched_us", sched),
            ("device_overlap_us", overlap),
            ("handoff_us", handoff),
            ("launch_us", launch),
        ]
    for name, values in figures:
        out[name + "_p50"], out[name + "_p99"] = pct(values, 50), pct(values, 99)
    out.update(
        bubble_gaps=int(chained.sum()),
        idle_gaps=int((consecutive & ~chained).sum()),
        timeline_steps=len(rows),
        void_steps=int(((rows[:, f.TraceField.FLAGS] & f.TraceFlag.VOID) != 0).sum()),
    )
    if one_clock:
        out["overlap_overruns"] = overruns
    return out


class TimelineFeed:
    """Feeds histograms from the trace ring incrementally: each feed() observes the rows whose
    SEQ is newer than the last row it fed, so a step is observed once however often the ring
    is read.  Rows the ring overwrote between two feeds (more than trace_len steps) are not
    observed at all.  A row is fed once it is final: its core stamps are written
    (complete_rows) and its overlapped phase has stamped it or a later row exists (the
    overlapped phase of step k ends before the critical phase of step k + 1 begins, or never
    stamps at all when it stops the scheduler).  The caller serialises feed() (one lock)."""

    def __init__(self):
        self.last_seq = 0  # SEQ (step + 1) of the last row fed; 0: none yet
        self._last: np.ndarray | None = None  # that row, to pair with the next row for the bubble

    def feed(self, trace: np.ndarray, critical: Histogram, overlapped: Histogram, bubble: Histogram) -> int:
        """Observes, in seconds, the critical phase, the overlapped phase and the bubble before
        each new row (timeline_summary's definition: only a chained row following its
        predecessor directly has one); returns how many rows were fed."""
        f = layout.TraceField
        rows = complete_rows(trace)
        if len(rows) == 0:
            return 0
        seq = rows[:, f.SEQ]
        has_overlap = (rows[:, f.OVERLAP_BEGIN] != 0) & (rows[:, f.OVERLAP_END] != 0)
        # a row the critical phase is rewriting may be read half old, half new: its step would
        # then seem to begin before its critical phase ended
        ordered = (rows[:, f.STEP_BEGIN] >= rows[:, f.SCHED_END]) & (
            rows[:, f.STEP_END] >= rows[:, f.STEP_BEGIN]
        )
        new = rows[(seq > self.last_seq) & ordered & (has_overlap | (seq < seq[-1]))]
        if len(new) == 0:
            return 0
        critical.observe_array((new[:, f.SCHED_END] - new[:, f.SCHED_BEGIN]) / 1e9)
        stamped = new[(new[:, f.OVERLAP_BEGIN] != 0) & (new[:, f.OVERLAP_END] != 0)]
        overlapped.observe_array((stamped[:, f.OVERLAP_END] - stamped[:, f.OVERLAP_BEGIN]) / 1e9)
        chain = new if self._last is None else np.concatenate([self._last[None, :], new])
        prev, cur = chain[:-1], chain[1:]
        chained = (cur[:, f.SEQ] == prev[:, f.SEQ] + 1) & ((cur[:, f.FLAGS] & layout.TraceFlag.CHAINED) != 0)
        bubble.observe_array((cur[chained, f.STEP_BEGIN] - prev[chained, f.STEP_END]) / 1e9)
        self._last = new[-1].copy()
        self.last_seq = int(new[-1, f.SEQ])
        return len(new)


def write_chrome_trace(path: str, trace: np.ndarray) -> None:
    """Three tracks: the critical phase, the overlapped phase (both on the scheduler's SM) and
    the step on the compute stream."""
    rows = complete_rows(trace)
    if not len(rows):
        return
    f = layout
    t0 = rows[:, [f.TraceField.SCHED_BEGIN, f.TraceField.STEP_BEGIN]].min()
    events = []

    def span(name, tid, begin, end, seq):
        events.append(
            {
                "name": name,
                "ph": "X",
                "pid": 0,
                "tid": tid,
                "ts": (begin - t0) / 1e3,
                "dur": (end - begin) / 1e3,
                "args": {"seq": int(seq) - 1},
            }
        )

    for r in rows:
        seq = r[f.TraceField.SEQ]
        span("critical", "scheduler: critical", r[f.TraceField.SCHED_BEGIN], r[f.TraceField.SCHED_END], seq)
        if r[f.TraceField.OVERLAP_BEGIN] and r[f.TraceField.OVERLAP_END]:
            span(
                "overlapped",
                "scheduler: overlapped",
                r[f.TraceField.OVERLAP_BEGIN],
                r[f.TraceField.OVERLAP_END],
                seq,
            )
        void = bool(r[f.TraceField.FLAGS] & f.TraceFlag.VOID)  # pad rows only: GPU time spent on nothing
        span(
            "void step" if void else "step",
            "compute",
            r[f.TraceField.STEP_BEGIN],
            r[f.TraceField.STEP_END],
            seq,
        )
    with open(path, "w") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, fh)
