"""CPU backend: the host-compiled scheduler on an engine thread, the eager model step in torch.

The engine thread runs the scheduler's two phases in the order the GPU kernel runs them: the
critical phase (consumes next_token, builds the step layout), then the overlapped phase (reads
the SQ, writes and publishes CQ events, admits), then the model step (reads the layout, writes
next_token).  Each phase releases the GIL.  It sleeps on a doorbell when both phases report
idle; the frontend rings it after publishing SQ entries.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback

import torch

from ringleader.device.backends.common import (
    StepTimer,
    describe_weights,
    load_model,
    model_info,
    ring_config_for,
    weight_fields,
)
from ringleader.device.backends.cpu_runtime import release_callers_openmp_team, return_freed_heap
from ringleader.device.backends.doorbells import Doorbells
from ringleader.device.backends.host_memory import HostMemory
from ringleader.device.backends.kv_pool import plan_pool
from ringleader.device.engine_config import EngineConfig
from ringleader.device.null.null_model import NullModel
from ringleader.device.null.null_step import NullStep
from ringleader.device.sched.build import CpuScheduler
from ringleader.device.step.eager_step import EagerStep
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.step_layout import StepLayout
from ringleader.ipc import layout
from ringleader.ipc.backend import Backend, EngineDead
from ringleader.ipc.histogram import HistogramSnapshot

log = logging.getLogger("ringleader.cpu")

IDLE_WAIT_S = 0.05  # also bounds how stale the heartbeat gets while idle
STOP_TIMEOUT_S = 30.0  # one model step of a big model on a slow CPU can take seconds


class CpuBackend(Doorbells, Backend):
    def __init__(self, config: EngineConfig | str | None = None, /, **fields):
        """config: an EngineConfig, or a model spec; fields: EngineConfig fields by name
        (CpuBackend("tiny", n_slots=8)).  The CUDA-only fields are not used here."""
        cfg = self.config = EngineConfig.of(config, **fields).resolved("cpu")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        dtype = getattr(torch, cfg.dtype)
        self._model = load_model(cfg, dtype, "cpu")
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
        self._step: EagerStep | NullStep
        if isinstance(self._model, NullModel):
            self._step = NullStep(self._model, cfg.n_slots)
        else:
            kv = KVCache.for_model(self._model.config, self.kv_pool.n_pages, cfg.page_size, dtype, "cpu")
            self._step = EagerStep(self._model, kv)
        self._memory = HostMemory(ring_config_for(self._model, cfg, max_ctx, self.kv_pool))
        # zero-copy views of the scheduler's arrays, built once: the step reads and writes them in place
        self._layout = StepLayout.from_arrays(self._memory.arrays)
        self.rings = self._memory.rings
        self.model = model_info(cfg.model, self._model, max_ctx)
        self.description = {
            "device": "cpu",
            "scheduler": "host-thread",
            "launch": "none",
            "dtype": cfg.dtype,
            **weight_fields(cfg, self._model),
            "n_slots": cfg.n_slots,
            "max_ctx": max_ctx,
            "token_budget": self._memory.config.token_budget,
            "policy": cfg.policy,
            "prefix_caching": cfg.prefix_caching,
            "torch_threads": torch.get_num_threads(),
            **self.kv_pool.as_description(),
        }
        self._scheduler = CpuScheduler()
        Doorbells.__init__(self)
        self._failure: str | None = None
        self._timer = StepTimer()
        self._thread = threading.Thread(target=self._run, name="rl-engine", daemon=True)
        return_freed_heap()  # the load's temporaries (cpu_runtime.py)

    # ---- Backend ---------------------------------------------------------------------------
    def start(self) -> None:
        err = self._scheduler.init(self._memory.context_address)
        if err != layout.InitError.NONE:
            raise RuntimeError(f"scheduler rejected its configuration: {layout.init_error_name(err)}")
        release_callers_openmp_team()  # the engine thread's team runs every step: the only one
        self._thread.start()

    def failure(self) -> str | None:
        if (
            self._failure is None
            and self._thread.ident is not None
            and not self._thread.is_alive()
            and int(self.rings.control[0]["shutdown"]) == 0
        ):
            return "engine thread exited"
        return self._failure

    def stats(self, timeline_after_seq: int = 0) -> dict:
        """timeline_after_seq: ignored, there is no device timeline (the step timings are the
        last 4096 passes', StepTimer)."""
        out = self.rings.counters()
        out.update(self._timer.summary())
        out["heartbeat_age_s"] = max(0.0, (time.monotonic_ns() - out["heartbeat_ns"]) / 1e9)
        out["threads"] = {"engine": self._thread.native_id}
        return out

    def thread_ids(self) -> dict[str, int]:
        tid = self._thread.native_id
        return {"engine": tid} if tid is not None and self._thread.is_alive() else {}

    def step_histograms(self) -> dict[str, HistogramSnapshot]:
        """The engine thread's own timer around the two phases, per built step; no bubble (the
        model step runs on the same thread, right after the scheduler: there is no gap to
        measure)."""
        return self._timer.histograms.snapshot(bubble=False, tokens=True)

    def stop(self) -> None:
        self.rings.request_shutdown()
        self._doorbell.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=STOP_TIMEOUT_S)
            if self._thread.is_alive():
                self._failure = f"stop: the engine thread still runs {STOP_TIMEOUT_S:.0f} s after shutdown"
                raise EngineDead(self._failure)

    # ---- the engine loop ---------------------------------------------------------------------
    def _run(self) -> None:
        ctx = self._memory.context_address
        control = self.rings.control
        step_header = self._memory.arrays["step"]
        try:
            while True:
                self._doorbell.clear()
                tail_before = int(control[0]["cq_tail"])
                # 1. the critical phase: the last step's samples in, the next step's layout out
                t0 = time.perf_counter()
                built = self._scheduler.critical(ctx) == layout.StepStatus.RUN
                t1 = time.perf_counter()
                # 2. the overlapped phase (serial here: one thread): aborts, SQ, events, admission
                following = self._scheduler.overlapped(ctx, built)
                t2 = time.perf_counter()
                rows = int(step_header[0]["n_tokens"]) if built else 0
                self._timer.add_sched((t1 - t0) * 1e6, (t2 - t1) * 1e6, rows)
                # 3. wake the completion thread if events were published
                if int(control[0]["cq_tail"]) != tail_before:
                    self._events.set()
                if following == layout.StepStatus.SHUTDOWN:
                    break
                # 4. the model step on the layout the critical phase built; else, idle, sleep
                if built:
                    self._run_model_step()
                    self._timer.model_us.append((time.perf_counter() - t2) * 1e6)
                elif following == layout.StepStatus.IDLE:
                    self._doorbell.wait(IDLE_WAIT_S)
        except Exception:  # the watchdog turns this into engine_dead for every request
            self._failure = "engine thread failed: " + traceback.format_exc(limit=3)
            log.error(self._failure)
        finally:
            self._events.set()

    def _run_model_step(self) -> None:
        """The step the critical phase laid out, exactly: its bucket is its n_tokens."""
        self._step.run(int(self._layout.n_tokens.item()), self._layout)
