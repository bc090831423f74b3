"""CUDA backend: the model step as CUDA graphs captured per token-count bucket before anything
starts, and the scheduler driven by one of two engines chosen here, once:

- `--scheduler device`: the scheduler as a persistent kernel on its own stream, the step graphs
  launched ping-pong, resident or pumped (device_scheduled.DeviceScheduled);
- `--scheduler host` (the baseline): the CPU build on a host thread, the packed layout copied up
  each step and the bucket's graph replayed (host_scheduled.HostScheduled with a GraphStepRunner,
  the same loop as the CPU backend's: engine_loop.py).

Every mode proven on an H100 and an H200 by the bring-up (bench/lab/gpu_bringup.py, bench/results/).

Construction does everything that can fail or synchronise: refuses settings that break a
persistent kernel, sizes the KV page pool from free memory, captures, checks, instantiates and
uploads every graph (the launch graph too) and loads the scheduler module.  start() only
launches; after it nothing allocates or frees device memory until stop().

Memory: the host-shared rings (ctl, sq, arena, cq) live in pinned host memory that the kernel
reaches at system scope (host mode: all of the scheduler's arrays, copied up as one packed
layout); everything else (config copy, slots, pending queue, the step layout, next_token, turn,
trace) lives in one torch-allocated device buffer, so the step graphs read the layout in place.
"""

from __future__ import annotations

import gc
import logging
import os

import numpy as np
import torch

from ringleader.device.backends import cuda_driver as drv
from ringleader.device.backends.common import (
    StepTimer,
    describe_weights,
    load_model,
    model_info,
    ring_config_for,
)
from ringleader.device.backends.cuda_preflight import (
    MemoryPlan,
    plan_model_kv_cache,
    refuse_unsafe_environment,
)
from ringleader.device.backends.device_memory import DeviceMemory
from ringleader.device.backends.device_scheduled import DeviceScheduled, LaunchUnavailable
from ringleader.device.backends.engine_backend import EngineBackend
from ringleader.device.backends.graph_runner import GraphStepRunner
from ringleader.device.backends.host_memory import HostMemory
from ringleader.device.backends.host_scheduled import HostScheduled
from ringleader.device.backends.kv_pool import plan_pool
from ringleader.device.backends.step_graphs import StepGraphs
from ringleader.device.engine_config import EngineConfig, cuda_unavailable_reason
from ringleader.device.sched.build import KERNELS, compile_kernel
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.static_step import GRAPH_SCORE_ROWS
from ringleader.device.step.step_layout import StepLayout
from ringleader.device.step.triton_gemv import FUSED_MAX_ROWS
from ringleader.device.step.triton_launch import pdl_supported
from ringleader.ipc import layout
from ringleader.ipc.automaton import GrammarArena
from ringleader.ipc.rings import RingConfig

log = logging.getLogger("ringleader.cuda")

SCHED_THREADS = 256
DEVICE_MAX_CONNECTIONS = 32  # the most hardware queues CUDA gives a context
STOP_MARGIN_S = 3.0  # beyond the kernel's own grace, before stop() calls it stuck

__all__ = ["CudaBackend", "LaunchUnavailable", "default_buckets", "device_arch"]


def default_buckets(token_budget: int) -> tuple[int, ...]:
    b, out = 1, []
    while b < token_budget and len(out) < layout.MAX_BUCKETS - 1:
        out.append(b)
        b *= 2
    return tuple(out) + (token_budget,)


def cuda_score_rows(cfg: EngineConfig) -> int:
    """RlConfig.score_rows on CUDA: --prompt-logprobs-rows, else GRAPH_SCORE_ROWS; 0 for the null
    model, whose one-kernel Triton step computes no logits to score."""
    if cfg.is_null_model:
        return 0
    return GRAPH_SCORE_ROWS if cfg.prompt_logprobs_rows is None else cfg.prompt_logprobs_rows


def device_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


class CudaBackend(EngineBackend):
    def __init__(self, config: EngineConfig | str | None = None, /, **fields):
        """config: an EngineConfig, or a model spec; fields: EngineConfig fields by name
        (CudaBackend("tiny", scheduler="host")).  threads is not used here."""
        super().__init__()
        cfg = self.config = EngineConfig.of(config, **fields).resolved("cuda")  # validated there
        on_device = cfg.scheduler == "device"
        dtype = getattr(torch, cfg.dtype)
        self._open_cuda(persistent_kernel=on_device)
        self._model = load_model(cfg, dtype, "cuda")
        drv.check(drv.cu.cuInit(0), "cuInit")
        self._ctx = drv.current_context()  # torch's primary context, current after its first allocation
        self._memory_plan = self._plan_memory(cfg, dtype)
        self.kv_pool = pool = self._memory_plan.pool
        max_ctx = pool.max_ctx
        self._model.prepare(max_ctx)
        ring_cfg = ring_config_for(self._model, cfg, max_ctx, pool, cuda_score_rows(cfg))
        ring_cfg = RingConfig(**{**ring_cfg.__dict__, "buckets": default_buckets(ring_cfg.token_budget)})
        self._mem = DeviceMemory(ring_cfg)
        # host mode: the CPU build schedules over pinned host arrays planned like the device's
        host_mem = None if on_device else HostMemory(ring_cfg, pinned=drv.PinnedBuffer)
        self.rings = self._mem.rings if host_mem is None else host_mem.rings
        self.rings.grammar = self._grammar_arena(ring_cfg, host_mem)
        self.model = model_info(cfg.model, self._model, max_ctx)
        self._compute = torch.cuda.Stream(priority=0)
        self._graphs = self._capture_graphs(cfg, ring_cfg, max_ctx)
        self.description = {
            "device": torch.cuda.get_device_name(),
            "scheduler": cfg.scheduler,
            "launch": "host-loop",
            "launch_requested": cfg.launch,
            "dtype": cfg.dtype,
            **self._model.description_fields(cfg.weights),
            "n_slots": cfg.n_slots,
            "max_ctx": max_ctx,
            "token_budget": ring_cfg.token_budget,
            "policy": cfg.policy,
            "prefix_caching": cfg.prefix_caching,
            # the most draft tokens a request verifies per step (0: speculative decoding off)
            "spec_tokens": ring_cfg.spec_tokens,
            "buckets": list(ring_cfg.buckets),
            **self._step_kernels_description(cfg),
            **pool.as_description(),
            "gpu_memory_fraction": cfg.gpu_memory_fraction,
            "device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8 (CUDA's default)"),
        }
        self._timer = StepTimer()
        functions = self._load_scheduler_module()
        if host_mem is None:
            self._engine = self._device_scheduled(cfg, functions)
        else:
            runner = GraphStepRunner(host_mem, self._mem, self._graphs, functions, self._ctx, self._compute)
            self._engine = HostScheduled(
                host_mem,
                runner,
                self._timer,
                self._doorbell,
                self._events,
                thread_name="rl-host-sched",
                thread_key="rl-host-sched",
            )
        self._stop_timeout_s = cfg.stop_grace_s + STOP_MARGIN_S

    # ---- construction helpers --------------------------------------------------------------
    @staticmethod
    def _open_cuda(persistent_kernel: bool) -> None:
        if persistent_kernel:
            refuse_unsafe_environment()  # before CUDA is touched: some of these hang at once
            # Hardware queues, read when the context is made: with the default 8, streams share
            # queues, and work can queue falsely behind the launch that never ends.
            if not torch.cuda.is_initialized():
                os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", str(DEVICE_MAX_CONNECTIONS))
        if not torch.cuda.is_available():
            raise RuntimeError(cuda_unavailable_reason())
        torch.cuda.init()
        if persistent_kernel:
            refuse_unsafe_environment(allocator_backend=torch.cuda.get_allocator_backend())

    def _plan_memory(self, cfg: EngineConfig, dtype: torch.dtype) -> MemoryPlan:
        c = self._model.config
        bytes_per_token = KVCache.bytes_per_token(c, dtype)
        if not bytes_per_token:  # a model without layers (the null model): the pages are ids only
            max_ctx = min(cfg.max_ctx or c.max_position_embeddings, c.max_position_embeddings)
            pool = plan_pool(
                pool_bytes=0, bytes_per_token=0, page_size=cfg.page_size, max_ctx=max_ctx, n_slots=cfg.n_slots
            )
            log.info("no weights, no KV cache; %s", pool.describe())
            return MemoryPlan(pool, kv_bytes=0, budget_bytes=0, workspace_bytes=0)
        free, total = torch.cuda.mem_get_info()
        plan = plan_model_kv_cache(
            c,
            n_slots=cfg.n_slots,
            max_ctx=cfg.max_ctx,
            token_budget=cfg.token_budget,
            dtype_bytes=torch.empty((), dtype=dtype).element_size(),
            bytes_per_token=bytes_per_token,
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

    def _capture_graphs(self, cfg: EngineConfig, ring_cfg: RingConfig, max_ctx: int) -> StepGraphs:
        """The model's static step over the step layout in the device buffer, captured per bucket,
        each replayed once (warm-up), with the warm-up's eager memory given back."""
        pool = self.kv_pool
        step = self._model.static_step(
            cfg.n_slots,
            pool.n_pages,
            pool.page_size,
            max_ctx,
            ring_cfg.token_budget,
            cfg.attention,
            step_kernels=cfg.step_kernels,
            score_rows=ring_cfg.score_rows,
            spec_tokens=ring_cfg.spec_tokens,
        )
        layout = StepLayout.over_buffer(self._mem.tensor)
        self._try_fused_kernels(step, layout, ring_cfg.buckets)
        try:
            graphs = StepGraphs(step, layout, ring_cfg.buckets, self._compute)
        except torch.OutOfMemoryError as exc:
            raise MemoryError(
                f"capturing the step graphs ran out of device memory after the KV "
                f"cache took {self._memory_plan.kv_bytes / 2**30:.2f} GiB; lower "
                f"--kv-cache-memory, --gpu-memory-fraction or --slots ({exc})"
            ) from exc
        graphs.replay_each_once()
        torch.cuda.empty_cache()  # safe: nothing persistent runs yet
        return graphs

    def _try_fused_kernels(self, step, layout: StepLayout, buckets) -> None:
        """Runs the fused step's buckets once, eagerly, before any capture: a kernel that fails
        to compile or launch on this GPU and Triton leaves the layered step in its place (said
        in the log and `step_kernels_off`) instead of failing the start."""
        if getattr(step, "fused_decode", None) is None:
            return
        small = [b for b in buckets if b <= FUSED_MAX_ROWS]
        try:
            with torch.cuda.stream(self._compute):
                step.warmup(layout, small)
            self._compute.synchronize()
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # a compile or launch failure: the layered kernels still serve
            step.fused_decode, step.fused_off = None, f"the fused kernels failed here: {exc}"[:500]

    def _grammar_arena(self, ring_cfg: RingConfig, host_mem: HostMemory | None) -> GrammarArena:
        """Structured output's automata: the step's sampler reads the device copy; in host mode
        the CPU scheduler reads the host one, so both are written."""
        device_write = self._mem.grammar_writer(self._ctx)
        if host_mem is None:
            return GrammarArena(ring_cfg.grammar_words, device_write)

        def write_both(offset: int, words: np.ndarray) -> None:
            host_mem.write_grammar(offset, words)
            device_write(offset, words)

        return GrammarArena(ring_cfg.grammar_words, write_both)

    def _step_kernels_description(self, cfg: EngineConfig) -> dict:
        """Which kernels run the small buckets (fused_step.py or the layered step), and why not
        the fused ones where they were asked for and did not build."""
        step = self._graphs.step if self._graphs is not None else None
        fused = getattr(step, "fused_decode", None) is not None
        out = {"step_kernels": "fused" if fused else "layered", "step_kernels_requested": cfg.step_kernels}
        off = getattr(step, "fused_off", None)
        if not fused and cfg.step_kernels == "fused" and off:
            out["step_kernels_off"] = off
            log.warning("--step-kernels fused: the layered step runs instead (%s)", off)
        return out

    def _load_scheduler_module(self) -> dict:
        """The scheduler module's kernels by name (the persistent kernel, host mode's stamps)."""
        build = compile_kernel(device_arch(), threads=SCHED_THREADS)
        module, self.description["module"] = drv.load_module(build)
        return {name: drv.get_function(module, name) for name in KERNELS}

    def _device_scheduled(self, cfg: EngineConfig, functions: dict) -> DeviceScheduled:
        engine = DeviceScheduled(
            launch=cfg.launch,
            step_signal=cfg.step_signal,
            programmatic=pdl_supported(torch.device("cuda")),
            rings=self.rings,
            device_memory=self._mem,
            graphs=self._graphs,
            functions=functions,
            cu_ctx=self._ctx,
            sched_threads=SCHED_THREADS,
            timer=self._timer,
            doorbell=self._doorbell,
            events=self._events,
            stop_grace_s=cfg.stop_grace_s,
            run_budget_s=cfg.run_budget_s,
            trace_path=cfg.trace_path,
        )
        self.description.update(engine.description)
        return engine

    def _release(self) -> None:
        """Frees device memory once nothing persistent runs (a later backend in this process
        sizes its KV cache from what is free); the pinned rings stay readable."""
        self._graphs = None
        self._model = None
        self._mem.release_device()
        gc.collect()
        torch.cuda.empty_cache()
