"""The device timeline: per step, the scheduler's and the step graph's %globaltimer stamps
(ipc.layout RL_TRACE_*), summarised as bubble, step and scheduler time, or written as a Chrome
trace."""
from __future__ import annotations

import json
import threading

import numpy as np

from ipc import layout


class TimelineReader:
    """Copies the device's trace ring into pinned memory allocated once, on a stream of its own,
    so reading it while the persistent kernel runs neither allocates nor waits on other work."""

    def __init__(self, device_memory):
        from device.backends import cuda_driver as drv
        self._drv = drv
        self._src = device_memory.address("trace")
        self._nbytes = device_memory.device_nbytes["trace"]
        self._host = drv.PinnedBuffer(self._nbytes)
        self._stream = drv.create_stream(highest_priority=False)
        self._lock = threading.Lock()

    def read(self) -> np.ndarray:
        with self._lock:
            self._drv.copy_to_host(self._host.host_ptr, self._src, self._nbytes, self._stream)
            self._drv.check(self._drv.cu.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
            return self._host.array.view(np.uint64).reshape(-1, layout.RL_TRACE_FIELDS).copy()


def timeline_summary(trace: np.ndarray) -> dict:
    """Bubble = next step's compute start minus this step's compute end, over complete rows."""
    rows = trace[(trace != 0).all(axis=1)].astype(np.int64)
    if len(rows) < 2:
        return {}
    rows = rows[np.argsort(rows[:, layout.RL_TRACE_SCHED_BEGIN])]
    step = (rows[:, layout.RL_TRACE_STEP_END] - rows[:, layout.RL_TRACE_STEP_BEGIN]) / 1e3
    sched = (rows[:, layout.RL_TRACE_SCHED_END] - rows[:, layout.RL_TRACE_SCHED_BEGIN]) / 1e3
    bubble = (rows[1:, layout.RL_TRACE_STEP_BEGIN] - rows[:-1, layout.RL_TRACE_STEP_END]) / 1e3
    bubble = bubble[bubble < 1e6]  # idle gaps between bursts are not bubbles
    pct = lambda v, q: float(np.percentile(v, q)) if len(v) else None  # noqa: E731
    return {"bubble_us_p50": pct(bubble, 50), "bubble_us_p99": pct(bubble, 99),
            "step_us_p50": pct(step, 50), "step_us_p99": pct(step, 99),
            "device_sched_us_p50": pct(sched, 50), "device_sched_us_p99": pct(sched, 99)}


def write_chrome_trace(path: str, trace: np.ndarray) -> None:
    rows = trace[(trace != 0).all(axis=1)].astype(np.int64)
    if not len(rows):
        return
    t0 = rows.min()
    events = []
    for r in rows:
        events.append({"name": "sched_step", "ph": "X", "pid": 0, "tid": "scheduler",
                       "ts": (r[0] - t0) / 1e3, "dur": (r[1] - r[0]) / 1e3})
        events.append({"name": "step", "ph": "X", "pid": 0, "tid": "compute",
                       "ts": (r[2] - t0) / 1e3, "dur": (r[3] - r[2]) / 1e3})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, f)
