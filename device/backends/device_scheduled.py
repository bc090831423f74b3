"""The scheduler as a persistent kernel on its own stream (`--scheduler device`): the step graphs
launched by a WHILE/SWITCH graph that stays resident (`--launch resident`), or relaunched by a
host thread that only keeps two launches queued (`--launch pump`).  The host's part is a CQ poller
that wakes the completion thread; the steps' timings come from the device trace at scrape time.

Built by CudaBackend once its step graphs are captured: this module loads the scheduler module,
makes the streams and the launch graph, and launches nothing until start().  Hand-over: `turn` in
device memory, SCHED -> COMPUTE by the scheduler kernel, COMPUTE -> SCHED by the step graph's
signal kernel; EXIT ends both.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from ringleader.device.backends import cuda_driver as drv
from ringleader.device.backends.common import StepTimer
from ringleader.device.backends.cq_poller import CqPoller
from ringleader.device.backends.device_timeline import (
    TimelineFeed,
    TimelineReader,
    timeline_summary,
    write_chrome_trace,
)
from ringleader.device.backends.doorbells import CompletionSignal
from ringleader.device.backends.launch_graph import LaunchGraph
from ringleader.device.sched.build import KERNEL_NAME
from ringleader.ipc import layout
from ringleader.ipc.histogram import HistogramSnapshot

log = logging.getLogger("ringleader.cuda")

START_TIMEOUT_S = 10.0  # the scheduler kernel reports RUNNING (or FAILED) within this


class LaunchUnavailable(RuntimeError):
    """The asked launch mode cannot run here; the message carries the CUDA error."""


class ResidentLaunch:
    """One WHILE/SWITCH graph launched once, which runs every step until EXIT: the host has
    nothing to do after the launch."""

    def __init__(self, graph: LaunchGraph, stream):
        self.graph, self._stream = graph, stream

    def first(self) -> None:
        self.graph.launch(self._stream)  # nothing may be queued behind the endless launch

    def host_threads(self, scheduler_ended) -> list[tuple[str, object]]:
        return []

    def release(self) -> None:
        self.graph.destroy()


class PumpedLaunch:
    """A graph of a few steps, relaunched by a host thread that keeps at most two launches
    queued; it never reads slot state, only whether the kernel exited (it keeps launching
    through a stop, so a step the scheduler has handed over still runs)."""

    def __init__(self, graph: LaunchGraph, stream):
        self.graph, self._stream = graph, stream
        self._events = [drv.BlockingEvent(), drv.BlockingEvent()]

    def first(self) -> None:
        self.graph.launch(self._stream)
        self._events[0].record(self._stream)

    def host_threads(self, scheduler_ended) -> list[tuple[str, object]]:
        def pump() -> None:
            """Launch k records event k % 2, and waits for launch k - 2 (the same event) first."""
            k = 1  # first() made launch 0
            while not scheduler_ended():
                ev = self._events[k % 2]
                if k >= 2:
                    ev.synchronize()  # sleeps in the driver: blocking-sync event
                self.graph.launch(self._stream)
                ev.record(self._stream)
                k += 1

        return [("rl-pump", pump)]

    def release(self) -> None:
        for ev in self._events:
            ev.destroy()
        self.graph.destroy()


class DeviceScheduled:
    def __init__(
        self,
        *,
        launch: str,
        rings,
        device_memory,
        graphs,
        functions: dict,
        cu_ctx,
        sched_threads: int,
        timer: StepTimer,
        doorbell: threading.Event,
        events: CompletionSignal,
        stop_grace_s: float,
        run_budget_s: float | None,
        trace_path: str | None,
    ):
        """Module loaded (functions), graphs captured: makes the streams and the launch graph,
        and `description`'s launch fields (launch, launch_fallback, step_graph_nodes)."""
        graphs.check_embeddable()  # raises naming the bucket and node type; no mode can embed it
        self._rings, self._fn, self._ctx = rings, functions, cu_ctx
        self._timer, self._doorbell, self._events = timer, doorbell, events
        self._sched_threads = sched_threads
        self._stop_grace_s, self._run_budget_s, self._trace_path = stop_grace_s, run_budget_s, trace_path
        self._sched_stream = drv.create_stream(highest_priority=True)
        self._graph_stream = drv.create_stream(highest_priority=False)
        self._sched_args = drv.KernelArgs(device_memory.context_bytes())
        self.description: dict = {}
        graph = self._build_launch_graph(launch, graphs, device_memory)
        launcher = ResidentLaunch if graph.mode == "resident" else PumpedLaunch
        self._launch: ResidentLaunch | PumpedLaunch | None = launcher(graph, self._graph_stream)
        self._timeline = TimelineReader(device_memory)
        self._feed = TimelineFeed()  # its step histograms, at scrape time
        self._threads: list[threading.Thread] = []
        self._poller: CqPoller | None = None  # made by its thread (_event_poller)
        self.failure_of_threads: str | None = None
        self.description.update(launch=graph.mode, step_graph_nodes=graphs.describe())

    def _build_launch_graph(self, launch: str, graphs, device_memory) -> LaunchGraph:
        def build(mode):
            return LaunchGraph(
                mode, graphs, self._fn, device_memory.context_bytes(), self._ctx, self._graph_stream
            )

        if launch == "pump":
            return build("pump")
        try:
            return build("resident")
        except drv.CudaError as exc:
            if launch == "resident":
                raise LaunchUnavailable(
                    f"--launch resident: the WHILE/SWITCH graph could not be "
                    f"built or instantiated: {exc}; --launch pump or auto runs "
                    f"without it"
                ) from exc
            log.warning("--launch auto: resident launch unavailable, running pump instead", exc_info=True)
            self.description["launch_fallback"] = str(exc)
            return build("pump")

    # ---- start ----------------------------------------------------------------------------
    def start(self) -> None:
        ctl = self._rings.control[0]
        ctl["stop_grace_ns"] = int(self._stop_grace_s * 1e9)
        ctl["run_budget_ns"] = int((self._run_budget_s or 0) * 1e9)
        assert self._launch is not None, "start() after release()"
        # The graph first: its wait kernel spins until the scheduler hands over a step, and a
        # launch made beside a running persistent kernel is the one that risks waiting on it.
        self._launch.first()
        drv.launch(self._fn[KERNEL_NAME], self._sched_args, self._sched_stream, block=self._sched_threads)
        self._wait_until_running(ctl)
        log.info("device scheduler running: launch %s", self._launch.graph.mode)
        for name, loop in self._launch.host_threads(self._scheduler_ended):
            self._spawn(loop, name)
        self._spawn(self._event_poller, "rl-cq-poll")

    def _wait_until_running(self, ctl) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while int(ctl["state"]) == layout.SchedulerState.INIT and time.monotonic() < deadline:
            time.sleep(0.001)
        state = int(ctl["state"])
        if state == layout.SchedulerState.FAILED:
            raise RuntimeError(
                f"the scheduler kernel rejected its configuration: "
                f"{layout.init_error_name(int(ctl['error_code']))}"
            )
        if state != layout.SchedulerState.RUNNING:
            raise RuntimeError(f"the scheduler kernel did not start within {START_TIMEOUT_S} s")

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=self._guard(target), name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _guard(self, target):
        def run():
            drv.bind_context(self._ctx)
            try:
                target()
            except Exception as exc:  # becomes engine_dead for every request
                self.failure_of_threads = f"{threading.current_thread().name} failed: {exc!r}"
                log.exception("backend thread failed")
            finally:
                self._events.set()

        return run

    # ---- the host thread ---------------------------------------------------------------------
    def _event_poller(self) -> None:
        """Wakes the completion thread when the kernel has published CQ events, polling only
        when one is due (cq_poller.py); the frontend's doorbell marks submissions."""
        ctl = self._rings.control
        self._poller = CqPoller(
            lambda: int(ctl[0]["cq_tail"]), self._scheduler_ended, self._events.set, self._doorbell
        )
        self._poller.run()

    def _scheduler_ended(self) -> bool:
        """The scheduler kernel will run no more steps (it exited, or its init failed)."""
        return int(self._rings.control[0]["state"]) in (
            layout.SchedulerState.EXITED,
            layout.SchedulerState.FAILED,
        )

    # ---- the Engine interface ----------------------------------------------------------------
    def failure(self, stopping: bool) -> str | None:
        if self.failure_of_threads is not None:
            return self.failure_of_threads
        ctl = self._rings.control[0]
        if not stopping and int(ctl["state"]) == layout.SchedulerState.EXITED:
            why = layout.EXIT_REASON_NAMES.get(int(ctl["exit_reason"]), ctl["exit_reason"])
            return f"the scheduler kernel exited on its own (exit reason: {why})"
        return None

    def wait_stopped(self, deadline: float) -> list[str]:
        """What still runs at `deadline`, shutdown having been requested: the kernel, the step
        graph's launch, our threads."""
        stuck = self._wait_for_device_exit(deadline)
        for t in self._threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        return stuck + [f"thread {t.name}" for t in self._threads if t.is_alive()]

    def _wait_for_device_exit(self, deadline: float) -> list[str]:
        ctl = self._rings.control[0]
        streams = {"the scheduler kernel": self._sched_stream, "the step graph launch": self._graph_stream}
        streams = {name: s for name, s in streams.items() if s is not None}  # none once released
        while time.monotonic() < deadline:
            busy = [n for n, s in streams.items() if not drv.stream_done(s)]
            if not busy and int(ctl["state"]) != layout.SchedulerState.RUNNING:
                return []
            time.sleep(0.001)
        return [n for n, s in streams.items() if not drv.stream_done(s)] or [
            "the scheduler kernel (state never reached EXITED)"
        ]

    def timeline(self) -> np.ndarray:
        """[trace_len, TRACE_FIELDS] stamps, copied on a stream of our own into pinned memory
        allocated at start-up (no allocation, no device-wide synchronisation)."""
        return self._timeline.read()

    def stats(self, timeline_after_seq: int) -> dict:
        out = timeline_summary(self.timeline(), timeline_after_seq, one_clock=True)
        out["timeline_stalled_reads"] = self._timeline.stalled_reads  # copies that missed their bounded wait
        if self._poller is not None:  # the host's per-step work in this mode: its reads and lag
            out.update(self._poller.figures())
        out["threads"] = {t.name: t.native_id for t in self._threads}
        return out

    def thread_ids(self) -> dict[str, int]:
        return {t.name: t.native_id for t in self._threads if t.is_alive() and t.native_id is not None}

    def step_histograms(self) -> dict[str, HistogramSnapshot]:
        """The timeline rows that are new since the last call (TimelineFeed), so nothing is done
        per step on the host; the bubble is measured, tokens per step are not (the trace row does
        not carry them)."""
        hist = self._timer.histograms
        trace = self.timeline()  # no rows once release() has closed the reader
        with hist.lock:
            self._feed.feed(trace, hist.critical, hist.overlapped, hist.bubble)
        return hist.snapshot(bubble=True, tokens=False)

    def stopped(self) -> None:
        """After a clean stop, before the device buffer is freed: the chrome trace, if asked."""
        if self._trace_path:
            write_chrome_trace(self._trace_path, self.timeline())

    def release(self) -> None:
        """Only once nothing persistent runs."""
        if self._launch is not None:
            self._launch.release()
            self._launch = None  # the step graphs its graph holds go with the backend's
            drv.destroy_stream(self._sched_stream)
            drv.destroy_stream(self._graph_stream)
            self._sched_stream = self._graph_stream = None  # nothing runs on them any more
        self._timeline.close()  # before the buffer it copies from is freed
