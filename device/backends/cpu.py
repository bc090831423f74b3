"""CPU backend: the host-compiled scheduler on an engine thread, the model step in torch.

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

import numpy as np
import torch

from device.backends.doorbells import Doorbells
from device.backends.host_memory import HostMemory
from device.model import LlamaModel, StepBatch, sample
from device.sched.build import CpuScheduler
from device.tokenizer import IncrementalDetokenizer, tokenizer_for
from ipc import layout
from ipc.backend import Backend, EngineDead, ModelInfo
from ipc.rings import RingConfig

log = logging.getLogger("ringleader.cpu")

POLICIES = {"fifo": layout.Policy.FIFO, "priority": layout.Policy.PRIORITY, "static": layout.Policy.STATIC}
IDLE_WAIT_S = 0.05  # also bounds how stale the heartbeat gets while idle
DEFAULT_MAX_CTX = 2048
STOP_TIMEOUT_S = 30.0  # one model step of a big model on a slow CPU can take seconds


def percentile(values, q: float) -> float | None:
    return float(np.percentile(np.fromiter(values, dtype=np.float64), q)) if len(values) else None


class RecentValues:
    """The last `size` values in a preallocated array: appending allocates nothing, so the
    memory held is the same from the first step on (a deque of floats grew for 4096 steps)."""

    def __init__(self, size: int = 4096):
        self._buf = np.zeros(size, dtype=np.float64)
        self._n = 0  # values appended so far

    def append(self, value: float) -> None:
        self._buf[self._n % len(self._buf)] = value
        self._n += 1

    def __len__(self) -> int:
        return min(self._n, len(self._buf))

    def __iter__(self):
        return iter(self._buf[: len(self)].copy())


class StepTimer:
    """Recent durations, for stats (the last 4096 of each): the scheduler's critical phase (what
    the model step waits for), its overlapped phase, both (sched_step), and the model step."""

    def __init__(self):
        self.critical_us = RecentValues(4096)
        self.overlapped_us = RecentValues(4096)
        self.sched_us = RecentValues(4096)
        self.model_us = RecentValues(4096)

    def add_sched(self, critical_us: float, overlapped_us: float) -> None:
        self.critical_us.append(critical_us)
        self.overlapped_us.append(overlapped_us)
        self.sched_us.append(critical_us + overlapped_us)

    def summary(self) -> dict:
        out = {}
        for name, values in (
            ("sched_critical_us", self.critical_us),
            ("sched_overlapped_us", self.overlapped_us),
            ("sched_step_us", self.sched_us),
            ("model_step_us", self.model_us),
        ):
            out[name + "_p50"], out[name + "_p99"] = percentile(values, 50), percentile(values, 99)
        return out


def ring_config_for(
    model: LlamaModel,
    *,
    n_slots: int,
    max_ctx: int,
    token_budget: int,
    policy: str,
    aging_steps: int,
    sq_size: int = 1024,
    pending_cap: int = 1024,
) -> RingConfig:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    arena = 1 << max(20, (4 * max_ctx - 1).bit_length())  # room for several full contexts
    cq = 1 << (2 * n_slots + pending_cap + 4 * n_slots).bit_length()
    return RingConfig(
        n_slots=n_slots,
        max_ctx=max_ctx,
        token_budget=max(token_budget, n_slots),
        sq_size=sq_size,
        cq_size=max(cq, 8192),
        arena_size=arena,
        pending_cap=pending_cap,
        policy=POLICIES[policy],
        aging_steps=aging_steps,
        eos_ids=tuple(model.config.eos_token_ids[: layout.MAX_EOS_IDS]),
    )


def model_info(spec: str, model: LlamaModel, max_ctx: int) -> ModelInfo:
    tokenizer = tokenizer_for(spec)
    return ModelInfo(
        name=str(spec),
        vocab_size=model.config.vocab_size,
        max_context=max_ctx,
        eos_token_ids=tuple(model.config.eos_token_ids),
        tokenizer=tokenizer,
        new_detokenizer=(lambda: IncrementalDetokenizer(tokenizer)) if tokenizer else None,
    )


class CpuBackend(Doorbells, Backend):
    def __init__(
        self,
        spec: str = "tiny",
        *,
        n_slots: int = 32,
        max_ctx: int | None = None,
        token_budget: int = 256,
        policy: str = "fifo",
        aging_steps: int = 64,
        seed: int = 0,
        threads: int | None = None,
        sq_size: int = 1024,
        pending_cap: int = 1024,
    ):
        if threads:
            torch.set_num_threads(threads)
        self._model = LlamaModel.from_spec(spec, torch.float32, "cpu", seed)
        max_ctx = min(max_ctx or DEFAULT_MAX_CTX, self._model.config.max_position_embeddings)
        self._kv = self._model.new_kv_cache(n_slots, max_ctx)
        self._model.prepare(max_ctx)
        self._memory = HostMemory(
            ring_config_for(
                self._model,
                n_slots=n_slots,
                max_ctx=max_ctx,
                token_budget=token_budget,
                policy=policy,
                aging_steps=aging_steps,
                sq_size=sq_size,
                pending_cap=pending_cap,
            )
        )
        self.rings = self._memory.rings
        self.model = model_info(spec, self._model, max_ctx)
        self.description = {
            "device": "cpu",
            "scheduler": "host-thread",
            "launch": "none",
            "dtype": "float32",
            "n_slots": n_slots,
            "max_ctx": max_ctx,
            "token_budget": self._memory.config.token_budget,
            "policy": policy,
            "torch_threads": torch.get_num_threads(),
        }
        self._scheduler = CpuScheduler()
        Doorbells.__init__(self)
        self._failure: str | None = None
        self._timer = StepTimer()
        self._thread = threading.Thread(target=self._run, name="rl-engine", daemon=True)

    # ---- Backend ---------------------------------------------------------------------------
    def start(self) -> None:
        err = self._scheduler.init(self._memory.context_address)
        if err != layout.InitError.NONE:
            raise RuntimeError(f"scheduler rejected its configuration: {layout.init_error_name(err)}")
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

    def stats(self) -> dict:
        out = self.rings.counters()
        out.update(self._timer.summary())
        out["heartbeat_age_s"] = max(0.0, (time.monotonic_ns() - out["heartbeat_ns"]) / 1e9)
        out["threads"] = {"engine": self._thread.native_id}
        return out

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
        try:
            while True:
                self._doorbell.clear()
                tail_before = int(control[0]["cq_tail"])
                t0 = time.perf_counter()
                built = self._scheduler.critical(ctx) == layout.StepStatus.RUN
                t1 = time.perf_counter()
                following = self._scheduler.overlapped(ctx, built)
                t2 = time.perf_counter()
                self._timer.add_sched((t1 - t0) * 1e6, (t2 - t1) * 1e6)
                if int(control[0]["cq_tail"]) != tail_before:
                    self._events.set()
                if following == layout.StepStatus.SHUTDOWN:
                    break
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
        a = self._memory.arrays
        head = a["step"][0]
        n, n_seg, n_samples = int(head["n_tokens"]), int(head["n_segments"]), int(head["n_samples"])
        batch = StepBatch.from_numpy(
            a["token_ids"][:n],
            a["positions"][:n],
            a["slot_of"][:n],
            a["seg_slot"][:n_seg],
            a["seg_row_start"][:n_seg],
            a["seg_n_rows"][:n_seg],
            a["sample_row"][:n_samples],
        )
        logits = self._model.step(batch, self._kv)
        if n_samples == 0:
            return
        tokens = sample(
            logits,
            torch.from_numpy(a["sample_temperature"][:n_samples]),
            torch.from_numpy(a["sample_top_k"][:n_samples]),
            torch.from_numpy(a["sample_top_p"][:n_samples]),
            torch.from_numpy(a["sample_seed"][:n_samples].view(np.int64)),
            torch.from_numpy(a["sample_counter"][:n_samples]),
        )
        a["next_token"][a["sample_slot"][:n_samples]] = tokens.numpy().astype(np.int32)
