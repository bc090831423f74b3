"""CPU backend: the host-compiled scheduler and the eager model step in torch, on one engine
thread (host_scheduled.HostScheduled over engine_loop.HostLoop with an EagerStepRunner).

The engine thread runs the scheduler's two phases in the order the GPU kernel runs them: the
critical phase (consumes next_token, builds the step layout), then the overlapped phase (reads
the SQ, writes and publishes CQ events, admits), then the model step (reads the layout, writes
next_token).  Each phase releases the GIL.  It sleeps on a doorbell when both phases report
idle; the frontend rings it after publishing SQ entries.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ringleader.device.backends.common import (
    StepTimer,
    describe_weights,
    load_model,
    model_info,
    ring_config_for,
)
from ringleader.device.backends.cpu_features import cpu_features
from ringleader.device.backends.cpu_runtime import release_callers_openmp_team, return_freed_heap
from ringleader.device.backends.cpu_threads import ThreadGovernor
from ringleader.device.backends.eager_runner import EagerStepRunner
from ringleader.device.backends.engine_backend import EngineBackend
from ringleader.device.backends.host_memory import HostMemory
from ringleader.device.backends.host_scheduled import HostScheduled
from ringleader.device.backends.kv_pool import plan_pool
from ringleader.device.engine_config import EngineConfig
from ringleader.device.model import LlamaModel
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.step_layout import StepLayout
from ringleader.device.weights.cpu_weight_choice import choose_cpu_weights
from ringleader.device.weights.gguf_checkpoint import is_gguf

log = logging.getLogger("ringleader.cpu")

STOP_TIMEOUT_S = 30.0  # one model step of a big model on a slow CPU can take seconds


class CpuBackend(EngineBackend):
    runner_class = EagerStepRunner  # how the engine thread runs a step (a test may inject faults here)

    def __init__(self, config: EngineConfig | str | None = None, /, **fields):
        """config: an EngineConfig, or a model spec; fields: EngineConfig fields by name
        (CpuBackend("tiny", n_slots=8)).  The CUDA-only fields are not used here."""
        super().__init__()
        requested = EngineConfig.of(config, **fields)
        cfg = requested.resolved("cpu")  # every field checked before anything loads
        cpu = cpu_features()
        # --threads N fixes the team; by default it follows the cores other processes leave free
        self.thread_governor = ThreadGovernor(
            cfg.threads or min(torch.get_num_threads(), cpu.cores), fixed=cfg.threads is not None
        )
        torch.set_num_threads(self.thread_governor.max_threads)  # the load's team (released before start)
        log.info("cpu: %s; step threads %s", cpu.summary(), self.thread_governor.describe())
        dtype = getattr(torch, cfg.dtype)
        self._model = load_model(cfg, dtype, "cpu")  # auto, GGUF: quantized (resolved("cpu"))
        self.weight_choice = None  # --weights auto, GGUF: the form measured fastest here
        if requested.weights == "auto" and is_gguf(cfg.model):
            assert isinstance(self._model, LlamaModel)
            self.weight_choice = choose_cpu_weights(self._model)
            if self.weight_choice.form != cfg.weights:
                cfg = dataclasses.replace(requested, weights=self.weight_choice.form).resolved("cpu")
                self._model = load_model(cfg, dtype, "cpu")
        self.config = cfg
        assert cfg.max_ctx is not None and isinstance(cfg.kv_cache_memory, int)  # resolved("cpu")
        max_ctx = min(cfg.max_ctx, self._model.config.max_position_embeddings)
        self.kv_pool = plan_pool(
            pool_bytes=cfg.kv_cache_memory,
            bytes_per_token=KVCache.bytes_per_token(self._model.config, dtype),
            page_size=cfg.page_size,
            max_ctx=max_ctx,
            n_slots=cfg.n_slots,
        )
        log.info("%s", self.kv_pool.describe())
        log.info("weights: %s", describe_weights(cfg.weights, self._model.weights_description()))
        self._memory = HostMemory(
            ring_config_for(self._model, cfg, max_ctx, self.kv_pool, cfg.prompt_logprobs_rows)
        )
        step = self._model.eager_step(
            self._memory.config.sample_len, self.kv_pool.n_pages, cfg.page_size, dtype
        )
        self.rings = self._memory.rings
        self.model = model_info(cfg.model, self._model, max_ctx)
        self.description = {
            "device": "cpu",
            "scheduler": "host-thread",
            "launch": "none",
            "dtype": cfg.dtype,
            **self._model.description_fields(cfg.weights),
            "n_slots": cfg.n_slots,
            "max_ctx": max_ctx,
            "token_budget": self._memory.config.token_budget,
            "policy": cfg.policy,
            "prefix_caching": cfg.prefix_caching,
            # the most draft tokens a request verifies per step (0: speculative decoding off)
            "spec_tokens": self._memory.config.spec_tokens,
            "torch_threads": torch.get_num_threads(),
            **({"weights_auto": self.weight_choice.as_description()} if self.weight_choice else {}),
            "step_threads": self.thread_governor.describe(),
            "cpu": {**cpu.as_description(), "aten": torch.backends.cpu.get_cpu_capability()},
            **self.kv_pool.as_description(),
        }
        self._timer = StepTimer()
        # zero-copy views of the scheduler's arrays, built once: the step reads and writes them in place
        runner = self.runner_class(
            step, StepLayout.from_arrays(self._memory.arrays), before_step=self.thread_governor.before_step
        )
        self._engine = HostScheduled(
            self._memory,
            runner,
            self._timer,
            self._doorbell,
            self._events,
            thread_name="rl-engine",
            thread_key="engine",
        )
        self._stop_timeout_s = STOP_TIMEOUT_S
        return_freed_heap()  # the load's temporaries (cpu_runtime.py)

    def stats(self, timeline_after_seq: int = 0) -> dict:
        return {**super().stats(timeline_after_seq), **self.thread_governor.figures()}

    def start(self) -> None:
        release_callers_openmp_team()  # the engine thread's team runs every step: the only one
        super().start()
