"""Shared probe plumbing: probe numbers, repetition budget, error records, statistics,
kernel-argument values and the rescue list (whatever makes running device work end)."""

from __future__ import annotations

import ctypes
import re
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from ringleader.device.backends.cuda_driver import CudaError

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "results"
SCHEMA = "ringleader.gpu_limits/1"

PROBE_NAMES = {
    1: "doorbell",
    2: "handoff",
    3: "launch",
    4: "torchgraph",
    5: "blocking",
    6: "roofline",
    7: "memops",
    8: "devlaunch",
    9: "graphpair",
    10: "stepwhile",
}
TORCH_PROBES = {4, 5, 6, 10}
# Execution order: a broken conditional-graph builtin would end in a trap (a
# sticky error that ends the context), so the probes that rely on
# cudaGraphSetConditional (3, 9, 4, 10 and the end of 7) run late, and the one
# that relies on device-side cudaGraphLaunch, the least proven builtin, last.
RUN_ORDER = (1, 2, 6, 5, 7, 3, 9, 4, 10, 8)

GIB = 1 << 30
MIB = 1 << 20


# ----------------------------------------------------------------------------
# Repetitions and timeouts


class Budget:
    """Repetition counts (full or --quick) and timeouts (seconds)."""

    def __init__(self, quick: bool, timeout_scale: float = 1.0):
        q = quick
        self.quick = q
        self.scale = timeout_scale
        self.db_warm = 100 if q else 300
        self.db_reps = 1000 if q else 5000
        self.pp_warm = 100 if q else 200
        self.pp_n = 4000 if q else 20000
        self.timer_reads = 500_000 if q else 2_000_000
        self.launch_warm = 50
        self.launch_reps = 500 if q else 3000
        self.sync_reps = 200 if q else 1000
        self.b2b = 500 if q else 3000
        self.chain_nodes = 100
        self.chain_reps = 5 if q else 20
        self.while_small_reps = 3 if q else 7
        self.while_n = 2000 if q else 20000
        self.while_reps = 3 if q else 7
        self.torch_iters = 5 if q else 10
        self.torch_reps = 3 if q else 5
        self.op_timeout = 4.0 if q else 6.0
        self.exit_modes = ("plain",) if q else ("plain", "torch")
        self.child_budget_s = 6.0 if q else 10.0
        self.copy_bytes = 1 * GIB if q else 4 * GIB
        self.copy_reps = 4 if q else 10
        self.mm_n = 8192
        self.mm_reps = 4 if q else 10
        self.memop_batch = 100
        self.memop_batches = 4 if q else 20
        self.dl_reps = 200 if q else 1000  # device launches per mode
        self.dl_loop_n = 1000 if q else 10000  # iterations of the tail self-loop
        self.dl_persistent_n = 200  # beyond the documented cap on fire-and-forget launches per graph run
        self.pair_n = 1000 if q else 5000  # steps per role in the ping-pong graphs
        self.pair_work_ns = 20_000  # a stand-in step long enough to hide a WHILE re-arm
        self.step_iters = 50 if q else 200
        self.step_ctx = 512
        # a persistent kernel's own deadline: it exits by itself after this
        self.kernel_budget_s = 30.0 if q else 60.0
        # probe thread timeouts
        self.probe_timeout = {1: 60, 2: 60, 3: 90, 4: 90, 5: 150, 6: 90, 7: 60, 8: 60, 9: 60, 10: 120}
        self.total_s = 240 if q else 330

    def t(self, seconds: float) -> float:
        return max(0.05, seconds * self.scale)

    @property
    def kernel_budget_ns(self) -> int:
        return int(self.kernel_budget_s * 1e9)


class SkipProbe(Exception):
    pass


class Timeout(Exception):
    pass


def errdict(e: BaseException, tb: bool = True) -> dict:
    d = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    if tb and not isinstance(e, (CudaError, Timeout, SkipProbe)):
        d["traceback"] = traceback.format_exc(limit=8)
    return d


def sub(fn, *args, **kw) -> dict:
    """Run one measurement; an exception becomes an error record, a failed check "failed_check"."""
    try:
        r = fn(*args, **kw)
        if isinstance(r, dict):
            check = r.get("check")
            failed = isinstance(check, dict) and check.get("ok") is False
            r.setdefault("status", "failed_check" if failed else "ok")
        return r
    except SkipProbe as e:
        return {"status": "skipped", "reason": str(e)}
    except Timeout as e:
        return {"status": "timeout", "where": str(e)}
    except Exception as e:
        return errdict(e)


# ----------------------------------------------------------------------------
# Statistics


def summarize(ns) -> dict:
    """median / p99 / min / max / mean in microseconds of samples in ns."""
    a = np.asarray(ns, dtype=np.float64).ravel()
    a = a[np.isfinite(a)]
    if a.size == 0:
        return {"n": 0}
    us = a * 1e-3
    return {
        "n": int(us.size),
        "median_us": float(np.median(us)),
        "p99_us": float(np.percentile(us, 99)),
        "min_us": float(us.min()),
        "max_us": float(us.max()),
        "mean_us": float(us.mean()),
    }


def trow(metric: str, st: dict | None, unit: str = "us", note: str = "") -> list:
    """A table row [metric, median, p99, unit, note] from a summarize() dict."""
    st = st or {}
    return [metric, st.get("median_us"), st.get("p99_us"), unit, note]


def device_slug(name: str) -> str:
    n = name.lower()
    m = re.search(
        r"\b(gh200|gb200|gb300|h200|h100|h800|h20|b300|b200|b100|a100|a800|a10g|a10|"
        r"l40s|l40|l4|t4|v100)\b",
        n,
    )
    if m:
        return m.group(1)
    n = re.sub(r"\b(nvidia|geforce|tesla|quadro)\b", " ", n)
    s = re.sub(r"[^a-z0-9]+", "-", n).strip("-")
    return s[:32] or "gpu"


# ----------------------------------------------------------------------------
# Kernel argument values (drv.KernelArgs keeps them alive and passes their addresses)


def U32(v) -> ctypes.c_uint32:
    return ctypes.c_uint32(int(v) & 0xFFFFFFFF)


def U64(v) -> ctypes.c_uint64:
    return ctypes.c_uint64(int(v) & 0xFFFFFFFFFFFFFFFF)


PTR = U64


# ----------------------------------------------------------------------------
# Rescue: whatever makes running device work end (shutdown words, flags)

_RESCUE_LOCK = threading.Lock()
_RESCUERS: list = []
_NO_RESCUE = False  # set in the exit-test child: its kernel must outlive it


def add_rescuer(fn) -> None:
    with _RESCUE_LOCK:
        _RESCUERS.append(fn)


def remove_rescuer(fn) -> None:
    with _RESCUE_LOCK:
        if fn in _RESCUERS:
            _RESCUERS.remove(fn)


def keep_kernels_running() -> None:
    """The exit-test child: its kernel must outlive it, so nothing is rescued."""
    global _NO_RESCUE
    _NO_RESCUE = True


def shutdown_all() -> None:
    """Set every shutdown word / release every wait this process created."""
    if _NO_RESCUE:
        return
    with _RESCUE_LOCK:
        fns = list(_RESCUERS)
    for fn in fns:
        try:
            fn()
        except Exception:
            pass


def wait_until(pred, timeout_s: float, nap: float = 10e-6, max_nap: float = 1e-3) -> bool:
    """Poll pred() with growing naps; its value at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return pred()
        time.sleep(nap)
        nap = min(nap * 2, max_nap)
    return True
