"""The host-driven engine loop, written once for the CPU backend and CUDA's `--scheduler host`:
schedule (the critical phase) -> step (launched) -> the overlapped phase -> complete (wake the
completion thread) -> the step's end.  What differs between the two is only how a step runs, the
StepRunner chosen when the backend is built:

- EagerStepRunner (CPU): launch() notes the rows, finish() runs the eager step; so the overlapped
  phase and the wake happen first, and the completion thread streams the last step's tokens
  while this one computes;
- GraphStepRunner (CUDA): launch() queues the layout's upload, the bucket's graph and next_token's
  download on the compute stream, finish() sleeps on a blocking-sync event; the overlapped phase
  runs on the CPU while the GPU computes.

The scheduler's two phases are the CPU build of the one scheduler source (sched/build.py); each
releases the GIL.  The loop sleeps on the doorbell when both phases report idle; the frontend rings
it after publishing SQ entries.  The device-scheduled launches drive the same phases from a
persistent kernel instead (device_scheduled.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from typing import Protocol

import numpy as np

from ringleader.device.backends.common import StepTimer
from ringleader.device.backends.doorbells import CompletionSignal
from ringleader.ipc import layout

log = logging.getLogger("ringleader.engine")

IDLE_WAIT_S = 0.05  # also bounds how stale the heartbeat gets while idle


class StepRunner(Protocol):
    """How a host-driven engine runs the step the critical phase laid out."""

    overlaps_host: bool  # the step computes while the overlapped phase runs (a GPU does, a CPU does not)

    def bound(self) -> contextlib.AbstractContextManager:
        """What the engine thread holds for its whole life (CUDA: the context and the stream)."""

    def launch(self) -> None:
        """The step laid out in the step header: queue it (or note it, where it runs in finish())."""

    def finish(self) -> None:
        """Returns once the launched step's next_token is readable by the next critical phase."""

    def cancel(self) -> None:
        """Shutdown after a launch: the step's output will not be read; a queued step is waited
        for (device work cannot be dropped), a noted one is not run."""

    def timeline(self) -> np.ndarray | None:
        """The steps' rows where the device stamps them (device_timeline.py); None: no timeline."""

    @property
    def stalled_reads(self) -> int:
        """Timeline copies that missed their bounded wait."""

    def release(self) -> None:
        """Frees what the runner holds on a device, once the engine thread has ended."""


class HostLoop:
    """One engine thread's loop over the CPU scheduler and a StepRunner; a failure is kept in
    `failure` (the backend turns it into engine_dead for every request) and ends the loop."""

    def __init__(
        self,
        scheduler,
        context_address: int,
        arrays: dict,
        runner: StepRunner,
        timer: StepTimer,
        doorbell,
        events,
    ):
        self._scheduler, self._ctx = scheduler, context_address
        self._control, self._step_header = arrays["ctl"], arrays["step"]
        self._runner, self._timer = runner, timer
        self._doorbell: threading.Event = doorbell
        self._events: CompletionSignal = events
        self.failure: str | None = None

    def run(self) -> None:
        try:
            with self._runner.bound():
                self._loop()
        except Exception:
            self.failure = f"{threading.current_thread().name} failed: " + traceback.format_exc(limit=3)
            log.error(self.failure)
        finally:
            self._events.set()

    def _loop(self) -> None:
        scheduler, ctx, runner, timer = self._scheduler, self._ctx, self._runner, self._timer
        control, step_header = self._control, self._step_header
        while True:
            self._doorbell.clear()
            tail_before = int(control[0]["cq_tail"])
            # 1. the critical phase: the last step's samples in, the next step's layout out
            t0 = time.perf_counter()
            built = scheduler.critical(ctx) == layout.StepStatus.RUN
            t1 = time.perf_counter()
            # 2. the step, launched (queued on a GPU; noted on a CPU, which runs it in 5)
            if built:
                runner.launch()
            t2 = time.perf_counter()
            # 3. the overlapped phase: aborts, SQ, events, admission
            following = scheduler.overlapped(ctx, built)
            t3 = time.perf_counter()
            rows = int(step_header[0]["n_tokens"]) if built else 0
            timer.add_sched((t1 - t0) * 1e6, (t3 - t2) * 1e6, rows)
            # 4. wake the completion thread if events were published
            if int(control[0]["cq_tail"]) != tail_before:
                self._events.set()
            if following == layout.StepStatus.SHUTDOWN:
                if built:
                    runner.cancel()
                return
            # 5. the step's end (the next critical phase reads its next_token); else, idle, sleep
            if built:
                runner.finish()
                hidden = 0.0 if runner.overlaps_host else t3 - t2  # a serial step starts after phase 3
                timer.model_us.append((time.perf_counter() - t1 - hidden) * 1e6)
            elif following == layout.StepStatus.IDLE:
                self._doorbell.wait(IDLE_WAIT_S)
