"""The scheduler on a host thread: the CPU build of the scheduler source driven by HostLoop
(engine_loop.py) over pinned or plain host memory.  The CPU backend's only engine, and CUDA's
`--scheduler host` baseline (its StepRunner replays the step graphs).  The backend builds it;
EngineBackend (engine_backend.py) reaches it through the Engine interface."""

from __future__ import annotations

import threading
import time

import numpy as np

from ringleader.device.backends.common import StepTimer
from ringleader.device.backends.device_timeline import timeline_summary
from ringleader.device.backends.doorbells import CompletionSignal
from ringleader.device.backends.engine_loop import HostLoop, StepRunner
from ringleader.device.backends.host_memory import HostMemory
from ringleader.device.sched.build import CpuScheduler
from ringleader.ipc import layout
from ringleader.ipc.histogram import HistogramSnapshot


class HostScheduled:
    def __init__(
        self,
        memory: HostMemory,
        runner: StepRunner,
        timer: StepTimer,
        doorbell: threading.Event,
        events: CompletionSignal,
        *,
        thread_name: str,
        thread_key: str,
    ):
        """thread_key: the thread's name in stats and thread_ids (what per-thread CPU time is
        reported under)."""
        self._memory, self._runner, self._timer = memory, runner, timer
        self._scheduler = CpuScheduler()
        self._loop = HostLoop(
            self._scheduler,
            memory.context_address,
            memory.arrays,
            runner,
            timer,
            doorbell,
            events,
        )
        self._thread = threading.Thread(target=self._loop.run, name=thread_name, daemon=True)
        self._thread_key = thread_key

    def start(self) -> None:
        err = self._scheduler.init(self._memory.context_address)
        if err != layout.InitError.NONE:
            raise RuntimeError(f"scheduler rejected its configuration: {layout.init_error_name(err)}")
        self._thread.start()

    def failure(self, stopping: bool) -> str | None:
        if self._loop.failure is not None:
            return self._loop.failure
        if not stopping and self._thread.ident is not None and not self._thread.is_alive():
            return "engine thread exited"
        return None

    def wait_stopped(self, deadline: float) -> list[str]:
        """What still runs at `deadline`, shutdown having been requested."""
        if self._thread.ident is not None:
            self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        return [f"thread {self._thread.name}"] if self._thread.is_alive() else []

    def timeline(self) -> np.ndarray | None:
        """The steps' rows where the runner stamps them on a device (CUDA); None on the CPU."""
        return self._runner.timeline()

    def stats(self, timeline_after_seq: int) -> dict:
        heartbeat_ns = int(self._memory.rings.control[0]["heartbeat_ns"])
        out: dict = {"heartbeat_age_s": max(0.0, (time.monotonic_ns() - heartbeat_ns) / 1e9)}
        rows = self.timeline()
        if rows is not None:  # the CPU scheduler's rows are host clock, the step's device clock
            out.update(timeline_summary(rows, timeline_after_seq, one_clock=False))
            out["timeline_stalled_reads"] = self._runner.stalled_reads
        out["threads"] = {self._thread_key: self._thread.native_id}
        return out

    def thread_ids(self) -> dict[str, int]:
        tid = self._thread.native_id
        return {self._thread_key: tid} if tid is not None and self._thread.is_alive() else {}

    def step_histograms(self) -> dict[str, HistogramSnapshot]:
        """The loop's own timer around the two phases, per built step; no bubble: on the CPU the
        step follows on the same thread, and on CUDA the gap is read from the timeline instead."""
        return self._timer.histograms.snapshot(bubble=False, tokens=True)

    def stopped(self) -> None:
        """After a clean stop: nothing to write (host mode's rows mix two clocks: no chrome trace)."""

    def release(self) -> None:
        self._runner.release()
