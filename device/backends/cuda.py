"""CUDA backend: the scheduler as a persistent kernel on its own stream (`--scheduler device`),
or the CPU build on a host thread with the layout copied every step (`--scheduler host`, the
baseline); the model step as CUDA graphs captured per token-count bucket before anything starts.

Written and compiled (NVRTC) on machines without a GPU; every mode proven on an H100 and an
H200 by the bring-up (bench/lab/gpu_bringup.py, bench/results/).

Construction does everything that can fail or synchronise: refuses settings that break a
persistent kernel, sizes the KV page pool from free memory, captures, checks, instantiates and
uploads every graph (the launch graph too) and loads the scheduler module.  start() only
launches; after it nothing allocates or frees device memory until stop().

Memory: the host-shared rings (ctl, sq, arena, cq) live in pinned host memory that the kernel
reaches at system scope; everything else (config copy, slots, pending queue, the step layout,
next_token, turn, trace) lives in one torch-allocated device buffer, so the step graphs read the
layout in place.  Hand-over: `turn` in device memory, SCHED -> COMPUTE by the scheduler kernel,
COMPUTE -> SCHED by the step graph's signal kernel; EXIT ends both.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time

import numpy as np
import torch

from ringleader.device.backends import cuda_driver as drv
from ringleader.device.backends.common import (
    StepTimer,
    describe_weights,
    load_model,
    model_info,
    ring_config_for,
    weight_fields,
)
from ringleader.device.backends.cq_poller import CqPoller
from ringleader.device.backends.cuda_preflight import (
    MemoryPlan,
    plan_model_kv_cache,
    refuse_unsafe_environment,
)
from ringleader.device.backends.device_memory import DeviceMemory, PackedLayoutCopy
from ringleader.device.backends.device_timeline import (
    TimelineFeed,
    TimelineReader,
    host_mode_rows,
    timeline_summary,
    write_chrome_trace,
)
from ringleader.device.backends.doorbells import Doorbells
from ringleader.device.backends.host_memory import HostMemory
from ringleader.device.backends.kv_pool import plan_pool
from ringleader.device.backends.launch_graph import HostStampedGraphs, LaunchGraph
from ringleader.device.backends.step_graphs import StepGraphs
from ringleader.device.engine_config import EngineConfig, cuda_unavailable_reason
from ringleader.device.model import LlamaModel
from ringleader.device.null.null_model import NullModel
from ringleader.device.null.null_step import NullStep
from ringleader.device.sched.build import KERNEL_NAME, KERNELS, CpuScheduler, compile_kernel
from ringleader.device.step.kv_cache import KVCache
from ringleader.ipc import layout
from ringleader.ipc.backend import Backend, EngineDead
from ringleader.ipc.histogram import HistogramSnapshot
from ringleader.ipc.rings import RingConfig

log = logging.getLogger("ringleader.cuda")

SCHED_THREADS = 256
DEVICE_MAX_CONNECTIONS = 32  # the most hardware queues CUDA gives a context
START_TIMEOUT_S = 10.0  # the scheduler kernel reports RUNNING (or FAILED) within this
STOP_MARGIN_S = 3.0  # beyond the kernel's own grace, before stop() calls it stuck


class LaunchUnavailable(RuntimeError):
    """The asked launch mode cannot run here; the message carries the CUDA error."""


def default_buckets(token_budget: int) -> tuple[int, ...]:
    b, out = 1, []
    while b < token_budget and len(out) < layout.MAX_BUCKETS - 1:
        out.append(b)
        b *= 2
    return tuple(out) + (token_budget,)


def device_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


class CudaBackend(Doorbells, Backend):
    def __init__(self, config: EngineConfig | str | None = None, /, **fields):
        """config: an EngineConfig, or a model spec; fields: EngineConfig fields by name
        (CudaBackend("tiny", scheduler="host")).  threads is not used here."""
        from ringleader.device.step.static_step import StaticStep
        from ringleader.device.step.step_layout import StepLayout

        cfg = self.config = EngineConfig.of(config, **fields).resolved("cuda")  # validated there
        scheduler, launch, n_slots = cfg.scheduler, cfg.launch, cfg.n_slots
        dtype = getattr(torch, cfg.dtype)
        if scheduler == "device":
            refuse_unsafe_environment()  # before CUDA is touched: some of these hang at once
            # Hardware queues, read when the context is made: with the default 8, streams share
            # queues, and work can queue falsely behind the launch that never ends.
            if not torch.cuda.is_initialized():
                os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", str(DEVICE_MAX_CONNECTIONS))
        if not torch.cuda.is_available():
            raise RuntimeError(cuda_unavailable_reason())
        torch.cuda.init()
        if scheduler == "device":
            refuse_unsafe_environment(allocator_backend=torch.cuda.get_allocator_backend())
        self._model = load_model(cfg, dtype, "cuda")
        drv.check(drv.cu.cuInit(0), "cuInit")
        self._ctx = drv.current_context()  # torch's primary context, current after its first allocation
        self._memory_plan = self._plan_memory(cfg, dtype)
        self.kv_pool = pool = self._memory_plan.pool
        max_ctx = pool.max_ctx
        self._model.prepare(max_ctx)
        if isinstance(self._model, LlamaModel):
            # the pool's pages and one more, the scratch page pad rows write into
            self._kv = StaticStep.new_kv_cache(self._model, pool.n_pages, pool.page_size)
        ring_cfg = ring_config_for(self._model, cfg, max_ctx, pool)
        ring_cfg = RingConfig(**{**ring_cfg.__dict__, "buckets": default_buckets(ring_cfg.token_budget)})
        self._scheduler_mode = scheduler
        self._trace_path = cfg.trace_path
        self._stop_grace_s, self._run_budget_s = cfg.stop_grace_s, cfg.run_budget_s
        self._mem = DeviceMemory(ring_cfg)
        self._compute = torch.cuda.Stream(priority=0)
        self._compute_cu = drv.cu.CUstream(self._compute.cuda_stream)
        if scheduler == "host":  # the baseline: the CPU build schedules over pinned host arrays
            self._host_mem = HostMemory(ring_cfg, pinned=drv.PinnedBuffer)
            self._layout_copy = PackedLayoutCopy(self._host_mem, self._mem)
            self.rings = self._host_mem.rings
            self._cpu_scheduler = CpuScheduler()
        else:
            self.rings = self._mem.rings
        self.model = model_info(cfg.model, self._model, max_ctx)
        self._layout = StepLayout.over_buffer(self._mem.tensor)
        self._step: StaticStep | NullStep
        if isinstance(self._model, NullModel):
            self._step = NullStep(self._model, n_slots)  # one Triton launch: a one-node graph
        else:
            self._step = StaticStep(
                self._model, self._kv, n_slots, max_ctx, ring_cfg.token_budget, attention=cfg.attention
            )
        try:
            self._graphs = StepGraphs(self._step, self._layout, ring_cfg.buckets, self._compute)
        except torch.OutOfMemoryError as exc:
            raise MemoryError(
                f"capturing the step graphs ran out of device memory after the KV "
                f"cache took {self._memory_plan.kv_bytes / 2**30:.2f} GiB; lower "
                f"--kv-cache-memory, --gpu-memory-fraction or --slots ({exc})"
            ) from exc
        self._graphs.replay_each_once()
        torch.cuda.empty_cache()  # the warm-up's eager memory; safe: nothing persistent runs yet
        self.description = {
            "device": torch.cuda.get_device_name(),
            "scheduler": scheduler,
            "launch": "host-loop",
            "launch_requested": launch,
            "dtype": cfg.dtype,
            **weight_fields(cfg, self._model),
            "n_slots": n_slots,
            "max_ctx": max_ctx,
            "token_budget": ring_cfg.token_budget,
            "policy": cfg.policy,
            "prefix_caching": cfg.prefix_caching,
            "buckets": list(ring_cfg.buckets),
            **pool.as_description(),
            "gpu_memory_fraction": cfg.gpu_memory_fraction,
            "device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8 (CUDA's default)"),
        }
        if scheduler == "device":
            self._prepare_device_scheduler(launch)
        else:
            self._prepare_host_stamps()
        self._failure: str | None = None
        self._timer = StepTimer()
        self._timeline_feed = TimelineFeed()  # device scheduler: its step histograms, at scrape time
        Doorbells.__init__(self)
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._released = False  # stop() has freed the device memory

    # ---- construction helpers --------------------------------------------------------------
    def _plan_memory(self, cfg: EngineConfig, dtype: torch.dtype):
        c = self._model.config
        if isinstance(self._model, NullModel):  # no weights, no KV bytes: the pages are ids only
            max_ctx = min(cfg.max_ctx or c.max_position_embeddings, c.max_position_embeddings)
            pool = plan_pool(
                pool_bytes=0, bytes_per_token=0, page_size=cfg.page_size, max_ctx=max_ctx, n_slots=cfg.n_slots
            )
            log.info("null model: no weights, no KV cache; %s", pool.describe())
            return MemoryPlan(pool, kv_bytes=0, budget_bytes=0, workspace_bytes=0)
        free, total = torch.cuda.mem_get_info()
        plan = plan_model_kv_cache(
            c,
            n_slots=cfg.n_slots,
            max_ctx=cfg.max_ctx,
            token_budget=cfg.token_budget,
            dtype_bytes=torch.empty((), dtype=dtype).element_size(),
            bytes_per_token=KVCache.bytes_per_token(c, dtype),
            page_size=cfg.page_size,
            kv_cache_memory=cfg.kv_cache_memory,
            free_bytes=free,
            total_bytes=total,
            fraction=cfg.gpu_memory_fraction,
        )
        log.info("weights: %s", describe_weights(cfg.weights, self._model.weights_description()))
        log.info(
            "%s (%.2f GiB left after weights and workspace at --gpu-memory-fraction %.2f)",
            plan.pool.describe(),
            plan.budget_bytes / 2**30,
            cfg.gpu_memory_fraction,
        )
        return plan

    def _load_scheduler_module(self) -> str:
        """The scheduler module's kernels into self._fn; returns how the module loaded."""
        build = compile_kernel(device_arch(), threads=SCHED_THREADS)
        module, loaded_as = drv.load_module(build)
        self._fn = {name: drv.get_function(module, name) for name in KERNELS}
        return loaded_as

    def _prepare_host_stamps(self) -> None:
        """Host mode: each bucket's graph between the two stamp kernels, so its GPU idle time
        between steps is read from the device trace like device mode's (device_timeline.py)."""
        self.description["module"] = self._load_scheduler_module()
        self._stamped = HostStampedGraphs(self._graphs, self._fn, self._mem.context_bytes(), self._compute_cu)
        self._timeline = TimelineReader(self._mem)

    def _prepare_device_scheduler(self, launch: str) -> None:
        """Module, kernels, streams and the launch graph: everything but the launches."""
        self._graphs.check_embeddable()  # raises naming the bucket and node type; no mode can embed it
        loaded_as = self._load_scheduler_module()
        self._sched_stream = drv.create_stream(highest_priority=True)
        self._graph_stream = drv.create_stream(highest_priority=False)
        self._sched_args = drv.KernelArgs(self._mem.context_bytes())
        self._launch_graph = self._build_launch_graph(launch)
        self._pump_events = [drv.BlockingEvent(), drv.BlockingEvent()]
        self._timeline = TimelineReader(self._mem)
        self.description.update(
            launch=self._launch_graph.mode, module=loaded_as, step_graph_nodes=self._graphs.describe()
        )

    def _build_launch_graph(self, launch: str) -> LaunchGraph:
        def build(mode):
            return LaunchGraph(
                mode, self._graphs, self._fn, self._mem.context_bytes(), self._ctx, self._graph_stream
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

    # ---- Backend ---------------------------------------------------------------------------
    def start(self) -> None:
        ctl = self.rings.control[0]
        if self._scheduler_mode == "host":
            err = self._cpu_scheduler.init(self._host_mem.context_address)
            if err != layout.InitError.NONE:
                raise RuntimeError(f"scheduler rejected its configuration: {layout.init_error_name(err)}")
            self._spawn(self._host_loop, "rl-host-sched")
            return
        ctl["stop_grace_ns"] = int(self._stop_grace_s * 1e9)
        ctl["run_budget_ns"] = int((self._run_budget_s or 0) * 1e9)
        # The graph first: its wait kernel spins until the scheduler hands over a step, and a
        # launch made beside a running persistent kernel is the one that risks waiting on it.
        self._launch_graph.launch(self._graph_stream)
        try:
            if self._launch_graph.mode == "pump":  # resident: nothing queued behind the endless launch
                self._pump_events[0].record(self._graph_stream)
            drv.launch(self._fn[KERNEL_NAME], self._sched_args, self._sched_stream, block=SCHED_THREADS)
            self._wait_until_running(ctl)
        except BaseException as exc:
            self._abandon_start(exc)
            raise
        log.info(
            "device scheduler running: launch %s, module from %s",
            self._launch_graph.mode,
            self.description["module"],
        )
        if self._launch_graph.mode == "pump":
            self._spawn(self._pump_loop, "rl-pump")
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

    def _abandon_start(self, exc: BaseException) -> None:
        """start() failed after the graph launch: ask everything launched to end (shutdown; the
        step graph's wait also ends on a FAILED scheduler) and wait, bounded, so no launch
        outlives the failure and the process can exit.  The original error is re-raised."""
        try:
            self.stop()
        except Exception as other:  # a second failure must not hide the first
            log.error("start() failed (%s), and the device did not stop either: %s", exc, other)

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
                self._failure = f"{threading.current_thread().name} failed: {exc!r}"
                log.exception("backend thread failed")
            finally:
                self._events.set()

        return run

    def _pump_loop(self) -> None:
        """At most two launches queued; never reads slot state, only whether the kernel exited
        (it keeps launching through a stop, so a step the scheduler has handed over still runs).
        Launch k records event k % 2, and waits for launch k - 2 (the same event) first."""
        k = 1  # start() made launch 0
        while not self._scheduler_ended():
            ev = self._pump_events[k % 2]
            if k >= 2:
                ev.synchronize()  # sleeps in the driver: blocking-sync event
            self._launch_graph.launch(self._graph_stream)
            ev.record(self._graph_stream)
            k += 1

    def _event_poller(self) -> None:
        """Device mode: wakes the completion thread when the kernel has published CQ events,
        polling only when one is due (cq_poller.py); the frontend's doorbell marks submissions."""
        ctl = self.rings.control
        CqPoller(
            lambda: int(ctl[0]["cq_tail"]), self._scheduler_ended, self._events.set, self._doorbell
        ).run()

    def _scheduler_ended(self) -> bool:
        """The scheduler kernel will run no more steps (it exited, or its init failed)."""
        return int(self.rings.control[0]["state"]) in (
            layout.SchedulerState.EXITED,
            layout.SchedulerState.FAILED,
        )

    def _host_loop(self) -> None:
        """The classic host-driven design, given the same overlap as the kernel: the critical
        phase on the CPU, the packed layout copied in (one async copy from pinned memory), the
        step graph replayed and next_token copied back into pinned memory; the overlapped phase
        runs on the CPU while the GPU computes; then a wait on a blocking-sync event (no
        spinning core)."""
        a = self._host_mem.arrays
        ctx = self._host_mem.context_address
        io, stream = self._layout_copy, self._compute_cu
        with torch.cuda.stream(self._compute):
            while True:
                self._doorbell.clear()
                tail = int(a["ctl"][0]["cq_tail"])
                # 1. the critical phase on the CPU
                t0 = time.perf_counter()
                built = self._cpu_scheduler.critical(ctx) == layout.StepStatus.RUN
                t1 = time.perf_counter()
                # 2. layout up, step graph, next_token down: all queued, none waited for
                if built:
                    io.upload(stream)
                    self._stamped.replay(int(a["step"][0]["bucket"]), stream)
                    io.download(stream)
                t2 = time.perf_counter()
                # 3. the overlapped phase on the CPU while the GPU computes
                following = self._cpu_scheduler.overlapped(ctx, built)
                rows = int(a["step"][0]["n_tokens"]) if built else 0
                self._timer.add_sched((t1 - t0) * 1e6, (time.perf_counter() - t2) * 1e6, rows)
                # 4. wake the completion thread; wait for the step (the next critical reads next_token)
                if int(a["ctl"][0]["cq_tail"]) != tail:
                    self._events.set()
                if built:
                    io.wait()
                    self._timer.model_us.append((time.perf_counter() - t1) * 1e6)
                if following == layout.StepStatus.SHUTDOWN:
                    return
                if not built and following == layout.StepStatus.IDLE:
                    self._doorbell.wait(0.05)

    def failure(self) -> str | None:
        if self._failure is None and self._scheduler_mode == "device" and not self._stopping:
            ctl = self.rings.control[0]
            if int(ctl["state"]) == layout.SchedulerState.EXITED:
                why = layout.EXIT_REASON_NAMES.get(int(ctl["exit_reason"]), ctl["exit_reason"])
                return f"the scheduler kernel exited on its own (exit reason: {why})"
        return self._failure

    def device_timeline(self) -> np.ndarray:
        """[trace_len, RL_TRACE_FIELDS] stamps, copied on a stream of our own into pinned memory allocated
        at start-up (no allocation, no device-wide synchronisation).  Host mode: the CPU
        scheduler's rows (host clock) with each step's start and end from the device trace."""
        if self._scheduler_mode == "host":
            return host_mode_rows(
                self._host_mem.arrays["trace"].reshape(-1, layout.TRACE_FIELDS), self._timeline.read()
            )
        return self._timeline.read()

    def stats(self, timeline_after_seq: int = 0) -> dict:
        out = self.rings.counters()
        out.update(self._timer.summary())
        out.update(
            timeline_summary(
                self.device_timeline(), timeline_after_seq, one_clock=self._scheduler_mode == "device"
            )
        )
        out["timeline_stalled_reads"] = self._timeline.stalled_reads  # copies that missed their bounded wait
        out["threads"] = {t.name: t.native_id for t in self._threads}
        return out

    def thread_ids(self) -> dict[str, int]:
        return {t.name: t.native_id for t in self._threads if t.is_alive() and t.native_id is not None}

    def step_histograms(self) -> dict[str, HistogramSnapshot]:
        """--scheduler host: the host thread's timer per built step, as on the CPU.  --scheduler
        device: the timeline rows that are new since the last call (TimelineFeed), so nothing is
        done per step on the host; the bubble is measured, tokens per step are not (the trace
        row does not carry them)."""
        hist = self._timer.histograms
        if self._scheduler_mode == "host":
            return hist.snapshot(bubble=False, tokens=True)
        trace = self.device_timeline()  # no rows once stop() has released the device buffer
        with hist.lock:
            self._timeline_feed.feed(trace, hist.critical, hist.overlapped, hist.bubble)
        return hist.snapshot(bubble=True, tokens=False)

    def stop(self) -> None:
        """Asks the scheduler to stop and waits, bounded, for the kernel, the step graph and our
        threads to end.  Raises EngineDead (and failure() says why) if any did not.  Once it
        has returned, calling it again does nothing (a server stops a backend whose start()
        already cleaned up after a failure)."""
        if self._released:
            return
        self._stopping = True
        self.rings.request_shutdown()
        self._doorbell.set()
        deadline = time.monotonic() + self._stop_grace_s + STOP_MARGIN_S
        stuck = self._wait_for_device_exit(deadline) if self._scheduler_mode == "device" else []
        for t in self._threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        stuck += [f"thread {t.name}" for t in self._threads if t.is_alive()]
        if stuck:
            ctl = self.rings.control[0]
            self._failure = (
                f"stop: {', '.join(stuck)} still running {self._stop_grace_s + STOP_MARGIN_S:.1f} s "
                f"after shutdown (scheduler state "
                f"{layout.STATE_NAMES.get(int(ctl['state']), ctl['state'])})"
            )
            log.error(self._failure)
            raise EngineDead(self._failure)
        if self._trace_path and self._scheduler_mode == "device":  # host mode's rows mix two clocks
            write_chrome_trace(self._trace_path, self.device_timeline())
        self._release()

    def _wait_for_device_exit(self, deadline: float) -> list[str]:
        ctl = self.rings.control[0]
        streams = {
            "the scheduler kernel": getattr(self, "_sched_stream", None),
            "the step graph launch": getattr(self, "_graph_stream", None),
        }
        while time.monotonic() < deadline:
            busy = [n for n, s in streams.items() if s is not None and not drv.stream_done(s)]
            if not busy and int(ctl["state"]) != layout.SchedulerState.RUNNING:
                return []
            time.sleep(0.001)
        return [n for n, s in streams.items() if s is not None and not drv.stream_done(s)] or [
            "the scheduler kernel (state never reached EXITED)"
        ]

    def _release(self) -> None:
        """Frees device memory once nothing persistent runs (a later backend in this process
        sizes its KV cache from what is free)."""
        self._released = True
        for ev in getattr(self, "_pump_events", []):
            ev.destroy()
        if getattr(self, "_launch_graph", None) is not None:
            self._launch_graph.destroy()
        if getattr(self, "_stamped", None) is not None:
            self._stamped.destroy()
        if getattr(self, "_timeline", None) is not None:
            self._timeline.close()  # before the buffer it copies from is freed
        self._graphs = self._step = self._layout = self._kv = self._launch_graph = self._stamped = None
        self._model = None
        self._mem.release_device()
        gc.collect()
        torch.cuda.empty_cache()
