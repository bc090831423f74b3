"""What both backends are once built: rings, a model, and an Engine (host_scheduled.HostScheduled
or device_scheduled.DeviceScheduled) chosen in the backend's constructor.  Every Backend method
is answered here through that engine, so no method asks which mode runs: the mode is decided
once, where the backend is built (open_backend's config)."""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np

from ringleader.device.backends.common import StepTimer
from ringleader.device.backends.doorbells import Doorbells
from ringleader.ipc import layout
from ringleader.ipc.backend import Backend, EngineDead
from ringleader.ipc.histogram import HistogramSnapshot

log = logging.getLogger("ringleader.engine")


class Engine(Protocol):
    """Where the scheduler runs and how the steps are driven."""

    def start(self) -> None: ...

    def failure(self, stopping: bool) -> str | None:
        """Why the engine is dead, or None; `stopping`: shutdown was asked (an exit is expected)."""

    def wait_stopped(self, deadline: float) -> list[str]:
        """What still runs at `deadline` (monotonic), shutdown having been requested."""

    def timeline(self) -> np.ndarray | None:
        """The steps' device-stamped rows (device_timeline.py); None where there is no device."""

    def stats(self, timeline_after_seq: int) -> dict: ...

    def thread_ids(self) -> dict[str, int]: ...

    def step_histograms(self) -> dict[str, HistogramSnapshot]: ...

    def stopped(self) -> None:
        """After a clean stop, before release(): what is written once (a chrome trace)."""

    def release(self) -> None:
        """Frees what the engine holds on a device, once nothing of it runs."""


class EngineBackend(Doorbells, Backend):
    """The subclass's constructor builds the model, the memory, `rings`, `model`, `description`,
    `_timer` and `_engine`, and sets `_stop_timeout_s`; `_release()` frees its device memory."""

    _engine: Engine
    _timer: StepTimer
    _stop_timeout_s: float

    def __init__(self):
        Doorbells.__init__(self)
        self._failure: str | None = None  # set by stop() when something would not end
        self._stopping = False
        self._released = False

    def start(self) -> None:
        try:
            self._engine.start()
        except BaseException as exc:
            self._abandon_start(exc)
            raise

    def _abandon_start(self, exc: BaseException) -> None:
        """start() failed, perhaps after a launch: ask everything launched to end and wait,
        bounded, so nothing outlives the failure and the process can exit.  The original error
        is re-raised by start()."""
        try:
            self.stop()
        except Exception as other:  # a second failure must not hide the first
            log.error("start() failed (%s), and the engine did not stop either: %s", exc, other)

    def failure(self) -> str | None:
        return self._failure or self._engine.failure(self._stopping)

    def stats(self, timeline_after_seq: int = 0) -> dict:
        """timeline_after_seq: where the engine has a device timeline, only the steps after it
        are summarised (Backend.stats)."""
        out = self.rings.counters()
        out.update(self._timer.summary())
        out.update(self._engine.stats(timeline_after_seq))
        out.update(self._events.figures())  # the completion thread's wake-ups and their latency
        return out

    def thread_ids(self) -> dict[str, int]:
        return self._engine.thread_ids()

    def step_histograms(self) -> dict[str, HistogramSnapshot]:
        return self._engine.step_histograms()

    def stop(self) -> None:
        """Asks the scheduler to stop and waits, bounded, for everything of the engine to end.
        Raises EngineDead (and failure() says why) if any did not.  Once it has returned, calling
        it again does nothing (a server stops a backend whose start() already cleaned up)."""
        if self._released:
            return
        self._stopping = True
        self.rings.request_shutdown()
        self._doorbell.set()
        stuck = self._engine.wait_stopped(time.monotonic() + self._stop_timeout_s)
        if stuck:
            state = int(self.rings.control[0]["state"])
            self._failure = (
                f"stop: {', '.join(stuck)} still running {self._stop_timeout_s:.1f} s after shutdown "
                f"(scheduler state {layout.STATE_NAMES.get(state, state)})"
            )
            log.error(self._failure)
            raise EngineDead(self._failure)
        self._engine.stopped()
        self._released = True
        self._engine.release()
        self._release()

    def _release(self) -> None:
        """The backend's own memory, once the engine has released its part."""
