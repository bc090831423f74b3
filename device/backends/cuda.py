"""CUDA backend: the scheduler as a persistent kernel on its own stream (`--scheduler device`),
or the CPU build on a host thread with the layout copied every step (`--scheduler host`, the
baseline); the model step as CUDA graphs captured per token-count bucket before anything starts.

UNVERIFIED: written and compiled (NVRTC) on a machine without a GPU; no line of the launch,
graph or memory code below has run on a GPU yet.  See the GPU backend issue for what remains.

Memory: the host-shared rings (ctl, sq, arena, cq) live in pinned host memory that the kernel
reaches at system scope; everything else (config copy, slots, pending queue, the step layout,
next_token, turn, trace) lives in one torch-allocated device buffer, so the step graphs read the
layout in place.  Hand-over: `turn` in device memory, SCHED -> COMPUTE by the scheduler kernel,
COMPUTE -> SCHED by the step graph's signal kernel; EXIT ends both.
"""
from __future__ import annotations

import ctypes
import json
import logging
import threading
import time

import numpy as np
import torch

from device.backends import cuda_driver as drv
from device.backends.cpu import POLICIES, StepTimer, model_info, ring_config_for
from device.backends.doorbells import Doorbells
from device.backends.host_memory import HostMemory, context_table
from device.model import LlamaModel
from device.sched.build import KERNEL_NAME, KERNELS, CpuScheduler, compile_kernel
from ipc import layout
from ipc.backend import Backend
from ipc.rings import ALIGN, HostRings, RingConfig, map_arrays, plan_memory, write_config

log = logging.getLogger("ringleader.cuda")

SCHED_THREADS = 256
PINNED = ("ctl", "sq", "arena", "cq")
PUMP_STEPS_PER_LAUNCH = 8


def default_buckets(token_budget: int) -> tuple[int, ...]:
    b, out = 1, []
    while b < token_budget and len(out) < layout.MAX_BUCKETS - 1:
        out.append(b)
        b *= 2
    return tuple(out) + (token_budget,)


def device_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


class DeviceMemory:
    """Pinned host arrays for the rings, one device buffer for the rest, and the RlContext."""

    def __init__(self, cfg: RingConfig):
        names = [n for n, _, _ in layout.ARRAYS]
        pinned_plan = plan_memory(cfg, set(PINNED))
        self.pinned = drv.PinnedBuffer(pinned_plan.total)
        self.host = map_arrays(self.pinned.array, pinned_plan, cfg)
        dev_plan = plan_memory(cfg, set(names) - set(PINNED))
        self.buffer = torch.zeros(dev_plan.total + ALIGN, dtype=torch.uint8, device="cuda")
        base = (-self.buffer.data_ptr()) % ALIGN
        self.device_offsets = {n: base + off for n, off in dev_plan.offsets.items()}
        self.device_nbytes = dev_plan.nbytes
        cfg_host = np.zeros(1, dtype=layout.CONFIG.numpy_dtype())
        write_config(cfg_host, cfg)
        self.tensor("cfg", torch.uint8).copy_(torch.from_numpy(cfg_host.view(np.uint8)))
        ctl = self.host["ctl"][0]
        ctl["magic"], ctl["version"] = layout.MAGIC, layout.LAYOUT_VERSION
        addresses = {n: self.pinned.device_ptr + pinned_plan.offsets[n] for n in PINNED}
        addresses.update({n: self.buffer.data_ptr() + off for n, off in self.device_offsets.items()})
        self.context = context_table(addresses)
        self.rings = HostRings(self.host, cfg)
        self.config = cfg
        torch.cuda.synchronize()  # allowed: nothing persistent runs yet

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        off, n = self.device_offsets[name], self.device_nbytes[name]
        return self.buffer[off:off + n].view(dtype)

    def context_bytes(self) -> bytes:
        return bytes(self.context)

    def free(self) -> None:
        self.pinned.free()
        self.buffer = None


class CudaBackend(Doorbells, Backend):
    def __init__(self, spec: str = "llama-1b", *, scheduler: str = "device", launch: str = "resident",
                 n_slots: int = 256, max_ctx: int = 4096, token_budget: int = 512,
                 policy: str = "fifo", aging_steps: int = 64, seed: int = 0, threads=None,
                 sq_size: int = 1024, pending_cap: int = 1024, dtype=torch.bfloat16,
                 trace_path: str | None = None, attention: str = "triton"):
        from device.model.static_step import StaticStep, StepLayout
        if scheduler not in ("device", "host") or launch not in ("resident", "pump"):
            raise ValueError("scheduler: device|host; launch: resident|pump")
        torch.cuda.init()
        self._model = LlamaModel.from_spec(spec, dtype, "cuda", seed)
        drv.check(drv.cu.cuInit(0), "cuInit")
        self._ctx = drv.current_context()  # torch's primary context, current after its first allocation
        max_ctx = min(max_ctx, self._model.config.max_position_embeddings)
        self._model.prepare(max_ctx)
        self._kv = StaticStep.new_kv_cache(self._model, n_slots, max_ctx)  # + a scratch slot for pad rows
        ring_cfg = ring_config_for(self._model, n_slots=n_slots, max_ctx=max_ctx,
                                   token_budget=token_budget, policy=policy,
                                   aging_steps=aging_steps, sq_size=sq_size, pending_cap=pending_cap)
        ring_cfg = RingConfig(**{**ring_cfg.__dict__, "buckets": default_buckets(ring_cfg.token_budget)})
        self._scheduler_mode, self._launch_mode = scheduler, launch
        self._trace_path = trace_path
        self._mem = DeviceMemory(ring_cfg)
        if scheduler == "host":  # the baseline: the CPU build schedules over host arrays
            self._host_mem = HostMemory(ring_cfg)
            self.rings = self._host_mem.rings
            self._cpu_scheduler = CpuScheduler()
        else:
            self.rings = self._mem.rings
        self.model = model_info(spec, self._model, max_ctx)
        self._layout = StepLayout(**self._layout_views(ring_cfg))
        self._step = StaticStep(self._model, self._kv, n_slots, max_ctx, ring_cfg.token_budget,
                                attention=attention)
        self._compute = torch.cuda.Stream(priority=0)
        self._graphs = self._capture_graphs(ring_cfg.buckets)
        self.description = {"device": torch.cuda.get_device_name(), "scheduler": scheduler,
                            "launch": launch if scheduler == "device" else "host-loop",
                            "dtype": str(dtype).replace("torch.", ""), "n_slots": n_slots,
                            "max_ctx": max_ctx, "token_budget": ring_cfg.token_budget,
                            "policy": policy, "buckets": list(ring_cfg.buckets)}
        self._failure: str | None = None
        self._timer = StepTimer()
        Doorbells.__init__(self)
        self._threads: list[threading.Thread] = []

    # ---- construction helpers --------------------------------------------------------------
    def _layout_views(self, cfg: RingConfig) -> dict:
        t = self._mem.tensor
        step_header = t("step", torch.int32)  # RlStepHeader: n_tokens, bucket, n_segments, n_samples, ...
        return dict(
            token_ids=t("token_ids", torch.int32), positions=t("positions", torch.int32),
            slot_of=t("slot_of", torch.int32), sample_row=t("sample_row", torch.int32),
            sample_slot=t("sample_slot", torch.int32),
            sample_temperature=t("sample_temperature", torch.float32),
            sample_top_p=t("sample_top_p", torch.float32), sample_top_k=t("sample_top_k", torch.int32),
            sample_seed=t("sample_seed", torch.int64), sample_counter=t("sample_counter", torch.int32),
            n_samples=step_header[3:4], next_token=t("next_token", torch.int32))

    def _capture_graphs(self, buckets) -> dict[int, torch.cuda.CUDAGraph]:
        """One graph per bucket, captured on our compute stream before any persistent kernel
        (capture may synchronise; nothing persistent runs yet)."""
        graphs, self._graph_outputs = {}, {}
        with torch.cuda.stream(self._compute):
            self._step.warmup(self._layout, buckets)  # compiles kernels, inits libraries
            self._compute.synchronize()
            for b in buckets:
                g = torch.cuda.CUDAGraph(keep_graph=True)
                g.capture_begin(capture_error_mode="thread_local")
                self._graph_outputs[b] = self._step.run(b, self._layout)  # kept alive with g
                g.capture_end()
                graphs[b] = g
        torch.cuda.synchronize()
        return graphs

    # ---- Backend ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._scheduler_mode == "host":
            err = self._cpu_scheduler.init(self._host_mem.context_address)
            if err != layout.RL_ERR_NONE:
                raise RuntimeError(f"scheduler rejected its configuration (error {err})")
            self._spawn(self._host_loop, "rl-host-sched")
            return
        build = compile_kernel(device_arch(), threads=SCHED_THREADS)
        self._module = drv.load_cubin(build.cubin, build.arch)
        fn = {name: drv.get_function(self._module, name) for name in KERNELS}
        self._fn = fn
        self._sched_stream = drv.create_stream(highest_priority=True)
        self._graph_stream = drv.create_stream(highest_priority=False)
        ctx_arg = self._mem.context_bytes()
        self._sched_args = drv.KernelArgs(ctx_arg)
        mode = self._launch_mode
        if mode == "resident":
            try:
                self._exec = self._build_resident_graph(ctx_arg)
            except drv.CudaError as exc:
                log.warning("resident launch unavailable (%s); falling back to pump", exc)
                mode = self._launch_mode = "pump"
                self.description["launch"] = "pump (resident failed: %s)" % exc
        if mode == "pump":
            self._exec = self._build_pump_graph(ctx_arg)
        drv.launch(fn[KERNEL_NAME], self._sched_args, self._sched_stream, block=SCHED_THREADS)
        if mode == "resident":
            drv.check(drv.cu.cuGraphLaunch(self._exec, self._graph_stream), "cuGraphLaunch")
        else:
            self._spawn(self._pump_loop, "rl-pump")
        self._spawn(self._event_poller, "rl-cq-poll")

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=self._guard(target), name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _guard(self, target):
        def run():
            if self._ctx is not None:
                drv.bind_context(self._ctx)
            try:
                target()
            except Exception as exc:  # becomes engine_dead for every request
                self._failure = f"{threading.current_thread().name} failed: {exc!r}"
                log.exception("backend thread failed")
            finally:
                self._events.set()
        return run

    def _step_body(self, graph, deps, ctx_arg, while_handle, use_while: int):
        """[wait -> SWITCH(bucket) -> signal] appended to `graph` after `deps`; returns last node."""
        n = len(self._graphs)
        switch = drv.conditional_handle(graph, self._ctx, n)
        wait_args = drv.KernelArgs(ctx_arg, drv.handle_arg(switch), drv.handle_arg(while_handle or 0),
                                   ctypes.c_uint32(use_while))
        sig_args = drv.KernelArgs(ctx_arg, drv.handle_arg(while_handle or 0), ctypes.c_uint32(use_while))
        self._keep_args += [wait_args, sig_args]
        wait = drv.add_kernel_node(graph, deps, self._fn["rl_step_wait"], wait_args)
        node, bodies = drv.add_conditional_node(
            graph, [wait], switch, drv.cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_SWITCH,
            n, self._ctx)
        for body, bucket in zip(bodies, sorted(self._graphs)):
            raw = self._graphs[bucket].raw_cuda_graph()
            drv.check(drv.cu.cuGraphAddChildGraphNode(body, None, 0, drv.cu.CUgraph(int(raw))),
                      "cuGraphAddChildGraphNode")
        return drv.add_kernel_node(graph, [node], self._fn["rl_step_signal"], sig_args)

    def _build_resident_graph(self, ctx_arg):
        self._keep_args = []
        graph = drv.check(drv.cu.cuGraphCreate(0), "cuGraphCreate")
        loop = drv.conditional_handle(graph, self._ctx, 1)
        _, (body,) = drv.add_conditional_node(
            graph, [], loop, drv.cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE, 1, self._ctx)
        self._step_body(body, [], ctx_arg, loop, 1)
        return drv.check(drv.cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate(resident)")

    def _build_pump_graph(self, ctx_arg):
        self._keep_args = []
        graph = drv.check(drv.cu.cuGraphCreate(0), "cuGraphCreate")
        last = []
        for _ in range(PUMP_STEPS_PER_LAUNCH):
            last = [self._step_body(graph, last, ctx_arg, None, 0)]
        return drv.check(drv.cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate(pump)")

    def _pump_loop(self) -> None:
        """At most two launches queued; never reads slot state, only whether the kernel exited."""
        queued = []
        ctl = self.rings.control
        while int(ctl[0]["state"]) != layout.RL_STATE_EXITED:
            while len(queued) >= 2:
                drv.check(drv.cu.cuEventSynchronize(queued.pop(0)), "cuEventSynchronize")
            drv.check(drv.cu.cuGraphLaunch(self._exec, self._graph_stream), "cuGraphLaunch")
            ev = drv.check(drv.cu.cuEventCreate(drv.cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            drv.check(drv.cu.cuEventRecord(ev, self._graph_stream), "cuEventRecord")
            queued.append(ev)

    def _event_poller(self) -> None:
        """Device mode: wakes the completion thread when the kernel has published CQ events."""
        ctl = self.rings.control
        last = int(ctl[0]["cq_tail"])
        while int(ctl[0]["state"]) != layout.RL_STATE_EXITED:
            tail = int(ctl[0]["cq_tail"])
            if tail != last:
                last = tail
                self._events.set()
            time.sleep(20e-6)

    def _host_loop(self) -> None:
        """The classic host-driven design: schedule on the CPU, copy the layout in, replay the
        step graph, copy the tokens out, synchronise, every step."""
        a = self._host_mem.arrays
        ctx = self._host_mem.context_address
        lay = self._layout
        next_host = torch.from_numpy(a["next_token"])
        with torch.cuda.stream(self._compute):
            while True:
                self._doorbell.clear()
                tail = int(a["ctl"][0]["cq_tail"])
                t0 = time.perf_counter()
                status = self._cpu_scheduler.step(ctx)
                self._timer.sched_us.append((time.perf_counter() - t0) * 1e6)
                if int(a["ctl"][0]["cq_tail"]) != tail:
                    self._events.set()
                if status == layout.RL_STEP_SHUTDOWN:
                    return
                if status == layout.RL_STEP_IDLE:
                    self._doorbell.wait(0.05)
                    continue
                t1 = time.perf_counter()
                lay.copy_from_arrays(a)  # H2D: the layout the CPU just built
                self._graphs[int(a["step"][0]["bucket"])].replay()
                next_host.copy_(lay.next_token)  # D2H; synchronises this stream only
                self._timer.model_us.append((time.perf_counter() - t1) * 1e6)

    def failure(self) -> str | None:
        return self._failure

    def device_timeline(self) -> np.ndarray:
        """[trace_len, 4] ns stamps, read on a side stream (no device-wide synchronisation)."""
        if self._scheduler_mode == "host":
            return np.zeros((0, layout.RL_TRACE_FIELDS), dtype=np.uint64)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            host = self._mem.tensor("trace", torch.int64).to("cpu", non_blocking=False)
        return host.numpy().view(np.uint64).reshape(-1, layout.RL_TRACE_FIELDS)

    def stats(self) -> dict:
        out = self.rings.counters()
        out.update(self._timer.summary())
        out.update(timeline_summary(self.device_timeline()))
        out["threads"] = {t.name: t.native_id for t in self._threads}
        return out

    def stop(self) -> None:
        self.rings.request_shutdown()
        self._doorbell.set()
        deadline = time.monotonic() + 10
        for stream in (getattr(self, "_sched_stream", None), getattr(self, "_graph_stream", None)):
            while stream is not None and not drv.stream_done(stream) and time.monotonic() < deadline:
                time.sleep(0.001)
        for t in self._threads:
            t.join(timeout=5)
        if self._trace_path:
            write_chrome_trace(self._trace_path, self.device_timeline())


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
