"""The scheduler as a persistent kernel on its own stream (`--scheduler device`): the step graphs
launched by two WHILE graphs that take turns by seq parity, each resident on a stream of its own
(`--launch pingpong`), by one WHILE/SWITCH graph that stays resident (`--launch resident`), or
relaunched by a host thread that only keeps two launches queued (`--launch pump`).  The host's
part is a CQ poller that wakes the completion thread; the steps' timings come from the device
trace at scrape time.

Built by CudaBackend once its step graphs are captured: this module loads the scheduler module,
makes the streams and the launch graphs, writes what the launch reads on the device (the config's
plan_ahead, the launch words), sizes the scheduler's shared memory, and launches nothing until
start().  Hand-over: `turn` in device memory, SCHED -> COMPUTE by the scheduler kernel, COMPUTE ->
SCHED by the step graph's signal kernel; EXIT ends both (device/sched/sched_loop.h).
"""

from __future__ import annotations

import dataclasses
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
from ringleader.ipc.rings import RingConfig

log = logging.getLogger("ringleader.cuda")

START_TIMEOUT_S = 10.0  # the scheduler kernel reports RUNNING (or FAILED) within this
# what every launch may use without the function's opt-in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
DEFAULT_SHARED_LIMIT = 48 << 10
# auto's order: the first whose graphs build and instantiate runs
AUTO_ORDER = ("pingpong", "resident", "pump")


def scheduler_shared_bytes(cfg: RingConfig, room: int) -> dict[str, int]:
    """The scheduler kernel's dynamic shared memory: `wanted` holds all of its working state
    (layout.SHARED_PLACEMENT, each array rounded up to 16 bytes as rl_place_in_shared places
    them), `given` is what fits in `room` (the device's opt-in maximum per block less the
    kernel's static shared memory); the kernel places what fits and keeps the rest in device
    memory."""
    ctypes_of = {name: ctype for name, ctype, _ in layout.ARRAYS}
    wanted = 0
    for name, count in layout.SHARED_PLACEMENT:
        n = 1 if count == "1" else getattr(cfg, count.removeprefix("cfg."))
        wanted += (layout.array_dtype(ctypes_of[name]).itemsize * int(n) + 15) // 16 * 16
    return {"wanted": wanted, "given": max(0, min(wanted, room))}


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


class PingPongLaunch:
    """Two WHILE graphs launched once each, graph p on stream p, which run the steps of seq
    parity p until EXIT: the host has nothing to do after the launches."""

    def __init__(self, graph: LaunchGraph, streams: list):
        self.graph, self._streams = graph, streams

    def first(self) -> None:
        for parity, stream in enumerate(self._streams):  # nothing may be queued behind either
            self.graph.launch(stream, parity)

    def host_threads(self, scheduler_ended) -> list[tuple[str, object]]:
        return []

    def release(self) -> None:
        self.graph.destroy()


Launcher = PingPongLaunch | ResidentLaunch | PumpedLaunch


class DeviceScheduled:
    def __init__(
        self,
        *,
        launch: str,
        step_signal: str = "auto",
        programmatic: bool = False,
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
        """Module loaded (functions), graphs captured: makes the streams and the launch graphs,
        writes the device state the launch reads, sizes the scheduler's shared memory, and fills
        `description` (launch, launch_fallback, step_signal, step_signal_fallback,
        step_graph_nodes, scheduler_shared_bytes).  step_signal: EngineConfig's; programmatic:
        whether an in-step signal may follow the step's last kernels by programmatic edges.
        device_memory: DeviceMemory's interface (config, context_bytes, write_config,
        write_array, the trace's address and size)."""
        graphs.check_embeddable()  # raises naming the bucket and node type; no mode can embed it
        self._rings, self._fn, self._ctx = rings, functions, cu_ctx
        self._timer, self._doorbell, self._events = timer, doorbell, events
        self._sched_threads = sched_threads
        self._stop_grace_s, self._run_budget_s, self._trace_path = stop_grace_s, run_budget_s, trace_path
        self.description: dict = {}
        self._shared = self._size_shared_memory()
        self._sched_stream = drv.create_stream(highest_priority=True)
        self._graph_streams = [drv.create_stream(highest_priority=False)]
        self._sched_args = drv.KernelArgs(device_memory.context_bytes())
        graph = self._build_launch_graph(launch, step_signal, programmatic, graphs, device_memory)
        self._write_launch_state(device_memory, graph.mode)
        self._launch: Launcher | None = self._launcher(graph)
        self._timeline = TimelineReader(device_memory)
        self._feed = TimelineFeed()  # its step histograms, at scrape time
        self._threads: list[threading.Thread] = []
        self._poller: CqPoller | None = None  # made by its thread (_event_poller)
        self.failure_of_threads: str | None = None
        self.description.update(
            launch=graph.mode,
            step_signal=graph.signal,
            programmatic_signals=graph.programmatic_signals,
            step_graph_nodes=graphs.describe(),
        )

    def _build_launch_graph(self, launch: str, signal: str, programmatic: bool, graphs, device_memory):
        """The asked mode's graphs; auto takes the first of AUTO_ORDER that builds, and names
        each mode refused before it, with the CUDA error, in launch_fallback.  Within a mode,
        signal auto takes in-step, else node (step_signal_fallback says why)."""
        context = device_memory.context_bytes()
        modes = AUTO_ORDER if launch == "auto" else (launch,)
        refused: list[str] = []
        for i, mode in enumerate(modes):
            try:
                return self._signal_placed(mode, signal, programmatic, graphs, context)
            except drv.CudaError as exc:
                if mode == "pump":  # no conditional node: its refusal is no launch mode's to answer
                    raise
                if launch != "auto":
                    raise LaunchUnavailable(
                        f"--launch {mode}: its WHILE/SWITCH graphs could not be built or "
                        f"instantiated: {exc}; --launch pump or auto runs without them"
                    ) from exc
                log.warning(
                    "--launch auto: %s launch unavailable, trying %s", mode, modes[i + 1], exc_info=True
                )
                refused.append(f"{mode}: {exc}")
                self.description["launch_fallback"] = "; ".join(refused)
        raise AssertionError(f"launch mode {launch!r}: none built and none raised")

    def _signal_placed(self, mode: str, signal: str, programmatic: bool, graphs, context) -> LaunchGraph:
        """Mode's graphs with the step's signal where asked (auto: in-step, else node)."""
        places = ("in-step", "node") if signal == "auto" else (signal,)
        for place in places:
            try:
                return LaunchGraph(
                    mode, graphs, self._fn, context, self._ctx, self._graph_streams[0],
                    signal=place, programmatic=programmatic,
                )  # fmt: skip
            except drv.CudaError as exc:
                if place == places[-1]:
                    raise
                log.warning("--step-signal auto: no in-step signal, a signal node instead", exc_info=True)
                self.description["step_signal_fallback"] = f"{mode}: {exc}"
        raise AssertionError("unreachable: the last place raised or returned")

    @staticmethod
    def _write_launch_state(device_memory, mode: str) -> None:
        """What the launch reads on the device, written before anything is launched: the config
        with plan_ahead exactly for pingpong (the scheduler reads it once, at start), and the
        launch words (ping-pong graph p's first step is seq p; nothing released or planned)."""
        device_memory.write_config(dataclasses.replace(device_memory.config, plan_ahead=mode == "pingpong"))
        words = np.zeros(1, dtype=layout.LAUNCH.numpy_dtype())
        words[0]["graph_seq"] = (0, 1)
        device_memory.write_array("launch", words)

    def _launcher(self, graph: LaunchGraph) -> Launcher:
        if graph.mode == "pingpong":  # graph 1 on a stream of its own: both stay resident
            self._graph_streams.append(drv.create_stream(highest_priority=False))
            return PingPongLaunch(graph, self._graph_streams)
        launcher = ResidentLaunch if graph.mode == "resident" else PumpedLaunch
        return launcher(graph, self._graph_streams[0])

    def _size_shared_memory(self) -> int:
        """The scheduler kernel's dynamic shared memory (scheduler_shared_bytes), with the
        function's opt-in raised when the launch needs more than every kernel may use."""
        fn = self._fn[KERNEL_NAME]
        static = drv.function_attribute(fn, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES")
        optin = drv.device_attribute(
            drv.current_device(),
            drv.cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )
        shared = scheduler_shared_bytes(self._rings.config, optin - static)
        if static + shared["given"] > DEFAULT_SHARED_LIMIT:
            drv.set_function_attribute(fn, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", shared["given"])
        self.description["scheduler_shared_bytes"] = shared
        return shared["given"]

    # ---- start ----------------------------------------------------------------------------
    def start(self) -> None:
        ctl = self._rings.control[0]
        ctl["stop_grace_ns"] = int(self._stop_grace_s * 1e9)
        ctl["run_budget_ns"] = int((self._run_budget_s or 0) * 1e9)
        assert self._launch is not None, "start() after release()"
        # The graphs first: their wait kernels spin until the scheduler hands over a step, and a
        # launch made beside a running persistent kernel is the one that risks waiting on it.
        self._launch.first()
        drv.launch(
            self._fn[KERNEL_NAME],
            self._sched_args,
            self._sched_stream,
            block=self._sched_threads,
            shared=self._shared,
        )
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
        graphs' launches, our threads."""
        stuck = self._wait_for_device_exit(deadline)
        for t in self._threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        return stuck + [f"thread {t.name}" for t in self._threads if t.is_alive()]

    def _wait_for_device_exit(self, deadline: float) -> list[str]:
        ctl = self._rings.control[0]
        streams = {"the scheduler kernel": self._sched_stream, **self._graph_stream_names()}
        streams = {name: s for name, s in streams.items() if s is not None}  # none once released
        while time.monotonic() < deadline:
            busy = [n for n, s in streams.items() if not drv.stream_done(s)]
            if not busy and int(ctl["state"]) != layout.SchedulerState.RUNNING:
                return []
            time.sleep(0.001)
        return [n for n, s in streams.items() if not drv.stream_done(s)] or [
            "the scheduler kernel (state never reached EXITED)"
        ]

    def _graph_stream_names(self) -> dict[str, object]:
        if len(self._graph_streams) == 1:
            return {"the step graph launch": self._graph_streams[0]}
        return {
            f"the step graph launch of the {p} seqs": s for p, s in zip(("even", "odd"), self._graph_streams)
        }

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
            for stream in (self._sched_stream, *self._graph_streams):
                drv.destroy_stream(stream)
            self._sched_stream, self._graph_streams = None, []  # nothing runs on them any more
        self._timeline.close()  # before the buffer it copies from is freed
