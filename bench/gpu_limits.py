#!/usr/bin/env python3
"""gpu_limits: measure the floors under ringleader's scheduler targets.

Self-contained: needs only numpy, cuda-python (``cuda.bindings``: driver and
NVRTC) and, for probes 4-6, torch. The kernels live in
``bench/gpu_limits_kernels.cu``; NVRTC compiles them to a CUBIN for the
device's own arch (sm_90 when there is no GPU) and the driver API loads and
launches them.

Probes (``--only 1,3`` runs a subset):
  1 doorbell    host -> device doorbell round trip through pinned host words,
                device polling by spinning and with __nanosleep 0/100/1000 ns
  2 handoff     device -> device one-way latency between two resident kernels
                on two streams through a device-memory flag (%globaltimer)
  3 launch      empty kernel launch, one-node graph launch, per-iteration cost
                of a WHILE conditional graph, and of WHILE + 4-way SWITCH
  4 torchgraph  a torch CUDA graph as a child node inside a WHILE body: does it
                run, does its output match eager torch
  5 blocking    with a persistent kernel on its own non-blocking stream: what
                completes and what blocks (allocations, copies, kernels on other
                streams); does process exit hang with the kernel running
  6 roofline    device-to-device copy bandwidth, bf16 matmul TFLOP/s
  7 memops      cuStreamWaitValue32/WriteValue32 handoff latency across two
                streams; does stream capture turn them into graph nodes

Output: a table on stdout, and in --out-dir (default bench/results)
``<date>-<device>-gpu-limits.json`` and ``.log`` (a tee of stdout/stderr).
``--quick`` and ``--only`` runs get a ``-quick`` / ``-only-N-M`` suffix.

Without a CUDA device (or with --compile-only) the script compiles every
kernel for sm_90, prints its resource use and exits 0.

Safety rules this script keeps: every CUDA call's result is checked; every
persistent kernel polls a shutdown word and has its own time budget
(%globaltimer), so it ends even if the host dies; the host never calls a
device-wide synchronize while a persistent kernel may run; each probe runs in
its own thread with a timeout and a probe that overruns is recorded as
{"status": "timeout"}; a whole-run watchdog writes what it has and exits.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import datetime as _dt
import faulthandler
import inspect
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

try:
    from cuda.bindings import driver, nvrtc
except ImportError:  # cuda-python < 12.6 layout
    from cuda import cuda as driver  # type: ignore[no-redef]
    from cuda import nvrtc  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
KERNEL_SRC = HERE / "gpu_limits_kernels.cu"
DEFAULT_OUT = HERE / "results"
SCHEMA = "ringleader.gpu_limits/1"

# ----------------------------------------------------------------------------
# Control block shared with the kernels (u32 words in pinned, device-mapped
# host memory). These values are passed to NVRTC as -D options.
CTL_SHUTDOWN = 0
CTL_DOORBELL = 1
CTL_ANSWER = 2
CTL_STARTED = 3
CTL_EXIT = 4
CTL_HANDLED = 5
CTL_POLLS_LO = 6
CTL_POLLS_HI = 7
CTL_HEARTBEAT = 8
CTL_DONE0 = 9
CTL_DONE1 = 10
CTL_WORDS = 64  # 256 bytes per block: no two blocks share a 128-byte line
DOORBELL_STOP = 0xFFFFFFFF
EXIT_SHUTDOWN, EXIT_DEADLINE, EXIT_STOPWORD, EXIT_DONE = 1, 2, 3, 4
EXIT_NAMES = {
    0: "still_running",
    EXIT_SHUTDOWN: "shutdown_word",
    EXIT_DEADLINE: "own_deadline",
    EXIT_STOPWORD: "stop_word",
    EXIT_DONE: "done",
}

KERNEL_GROUPS = {
    "core": ("rl_empty", "rl_doorbell", "rl_pingpong", "rl_stamp", "rl_timer_res"),
    "graph": ("rl_while_body", "rl_switch_ctl", "rl_branch"),
}
ALL_KERNELS = tuple(k for g in KERNEL_GROUPS.values() for k in g)
KERNEL_GROUP_OF = {k: g for g, ks in KERNEL_GROUPS.items() for k in ks}

PROBE_NAMES = {
    1: "doorbell",
    2: "handoff",
    3: "launch",
    4: "torchgraph",
    5: "blocking",
    6: "roofline",
    7: "memops",
}
TORCH_PROBES = {4, 5, 6}
# Execution order: a broken conditional-graph builtin would end in a trap (a
# sticky error that ends the context), so the probes that rely on
# cudaGraphSetConditional (3, 4 and the end of 7) run last.
RUN_ORDER = (1, 2, 6, 5, 7, 3, 4)

COMPILE_TAG = "GPU_LIMITS_COMPILE"
GIB = 1 << 30
MIB = 1 << 20


def kernel_defines() -> list[str]:
    d = {
        "RL_CTL_SHUTDOWN": CTL_SHUTDOWN,
        "RL_CTL_DOORBELL": CTL_DOORBELL,
        "RL_CTL_ANSWER": CTL_ANSWER,
        "RL_CTL_STARTED": CTL_STARTED,
        "RL_CTL_EXIT": CTL_EXIT,
        "RL_CTL_HANDLED": CTL_HANDLED,
        "RL_CTL_POLLS_LO": CTL_POLLS_LO,
        "RL_CTL_POLLS_HI": CTL_POLLS_HI,
        "RL_CTL_HEARTBEAT": CTL_HEARTBEAT,
        "RL_CTL_DONE0": CTL_DONE0,
        "RL_CTL_DONE1": CTL_DONE1,
        "RL_EXIT_SHUTDOWN": EXIT_SHUTDOWN,
        "RL_EXIT_DEADLINE": EXIT_DEADLINE,
        "RL_EXIT_STOPWORD": EXIT_STOPWORD,
        "RL_EXIT_DONE": EXIT_DONE,
    }
    out = [f"-D{k}={v}" for k, v in d.items()]
    out.append(f"-DRL_DOORBELL_STOP={DOORBELL_STOP:#x}u")
    return out


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
        # a persistent kernel's own deadline: it exits by itself after this
        self.kernel_budget_s = 30.0 if q else 60.0
        # probe thread timeouts
        self.probe_timeout = {1: 60, 2: 60, 3: 90, 4: 90, 5: 150, 6: 90, 7: 60}
        self.total_s = 240 if q else 330

    def t(self, seconds: float) -> float:
        return max(0.05, seconds * self.scale)

    @property
    def kernel_budget_ns(self) -> int:
        return int(self.kernel_budget_s * 1e9)


# ----------------------------------------------------------------------------
# Errors and checking


class CudaError(RuntimeError):
    pass


class SkipProbe(Exception):
    pass


class Timeout(Exception):
    pass


_CALL_RE = re.compile(r"\b((?:cu|nvrtc|cuda)[A-Z]\w*)\s*[,(]")


def _to_str(s) -> str:
    if isinstance(s, bytes):
        return s.decode(errors="replace")
    return str(s)


def err_text(err) -> str:
    """'NAME (code): description' for a CUresult / nvrtcResult."""
    try:
        code = int(err)
    except Exception:
        return repr(err)
    name = getattr(err, "name", None) or str(err)
    desc = ""
    try:
        if isinstance(err, driver.CUresult):
            r, s = driver.cuGetErrorString(err)
            if int(r) == 0 and s:
                desc = _to_str(s)
        elif isinstance(err, nvrtc.nvrtcResult):
            r, s = nvrtc.nvrtcGetErrorString(err)
            if int(r) == 0 and s:
                desc = _to_str(s)
    except Exception:
        pass
    return f"{name} ({code})" + (f": {desc}" if desc and desc != name else "")


def _guess_call_name() -> str:
    try:
        for fr in inspect.stack()[2:6]:
            m = _CALL_RE.search("".join(fr.code_context or []))
            if m:
                return m.group(1)
    except Exception:
        pass
    return "CUDA call"


def check(result, name: str | None = None):
    """Check a cuda-python result tuple (err, *outputs) and return the outputs.

    Raises CudaError naming the function (``name``, or guessed from the
    caller's source line) and the error string. Returns None, the single
    output, or a tuple of outputs.
    """
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if int(err) != 0:
        raise CudaError(f"{name or _guess_call_name()} failed: {err_text(err)}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def call(fn, *args):
    """fn(*args) with its result checked; errors name fn."""
    return check(fn(*args), getattr(fn, "__name__", None))


def errdict(e: BaseException, tb: bool = True) -> dict:
    d = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    if tb and not isinstance(e, (CudaError, Timeout, SkipProbe)):
        d["traceback"] = traceback.format_exc(limit=8)
    return d


def sub(fn, *args, **kw) -> dict:
    """Run one measurement; an exception becomes an error record."""
    try:
        r = fn(*args, **kw)
        if isinstance(r, dict):
            r.setdefault("status", "ok")
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


def parse_ptxas(log: str) -> dict:
    """Per-function resource use from NVRTC's --ptxas-options=-v log."""
    out: dict[str, dict] = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = m.group(1)
            out.setdefault(
                cur,
                {
                    "regs": None,
                    "smem_bytes": 0,
                    "stack_bytes": 0,
                    "spill_store_bytes": 0,
                    "spill_load_bytes": 0,
                    "cmem0_bytes": None,
                },
            )
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            cur = m.group(1) if m.group(1) in out else None
            continue
        if cur is None:
            continue
        d = out[cur]
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            d["stack_bytes"], d["spill_store_bytes"], d["spill_load_bytes"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            d["regs"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            d["smem_bytes"] = int(m.group(1))
        m = re.search(r"(\d+) bytes cmem\[0\]", line)
        if m:
            d["cmem0_bytes"] = int(m.group(1))
    return out


# ----------------------------------------------------------------------------
# NVRTC


def nvrtc_version() -> str:
    try:
        major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
        return f"{major}.{minor}"
    except Exception as e:
        return f"unknown ({type(e).__name__}: {e})"


def _program_log(prog) -> str:
    n = call(nvrtc.nvrtcGetProgramLogSize, prog)
    if not n:
        return ""
    buf = b" " * n
    call(nvrtc.nvrtcGetProgramLog, prog, buf)
    return buf.rstrip(b"\0 ").decode(errors="replace")


def compile_group(group: str, arch: str, src: str | None = None) -> dict:
    """Compile one kernel group to a CUBIN. Never raises; see 'ok'/'error'."""
    if src is None:
        src = KERNEL_SRC.read_text()
    info = {
        "group": group,
        "arch": arch,
        "ok": False,
        "error": None,
        "log": "",
        "cubin": None,
        "cubin_bytes": 0,
        "compile_s": None,
        "options": None,
        "kernels": {},
    }
    opts = [
        f"--gpu-architecture={arch}",
        "--std=c++17",
        "--ptxas-options=-v",
        f"-DRL_GROUP_{group.upper()}=1",
        *kernel_defines(),
    ]
    info["options"] = opts
    t0 = time.perf_counter()
    prog = None
    try:
        prog = call(nvrtc.nvrtcCreateProgram, src.encode(), f"gpu_limits_{group}.cu".encode(), 0, [], [])
        ob = [o.encode() for o in opts]
        res = nvrtc.nvrtcCompileProgram(prog, len(ob), ob)
        if res[0] == nvrtc.nvrtcResult.NVRTC_ERROR_INVALID_OPTION:
            # an NVRTC without --ptxas-options: compile anyway, resources unknown
            call(nvrtc.nvrtcDestroyProgram, prog)
            prog = call(nvrtc.nvrtcCreateProgram, src.encode(), f"gpu_limits_{group}.cu".encode(), 0, [], [])
            opts = [o for o in opts if not o.startswith("--ptxas-options")]
            info["options"] = opts
            ob = [o.encode() for o in opts]
            res = nvrtc.nvrtcCompileProgram(prog, len(ob), ob)
        try:
            info["log"] = _program_log(prog)
        except Exception as e:
            info["log"] = f"(no log: {e})"
        if int(res[0]) != 0:
            raise CudaError(f"nvrtcCompileProgram failed: {err_text(res[0])}\n{info['log']}")
        size = call(nvrtc.nvrtcGetCUBINSize, prog)
        buf = b" " * size
        call(nvrtc.nvrtcGetCUBIN, prog, buf)
        info["cubin"] = bytes(buf)
        info["cubin_bytes"] = size
        res_use = parse_ptxas(info["log"])
        for k in KERNEL_GROUPS[group]:
            present = k in res_use or (b".text." + k.encode()) in info["cubin"]
            d = {"ok": bool(present), "group": group}
            d.update(res_use.get(k, {}))
            info["kernels"][k] = d
        info["ok"] = all(v["ok"] for v in info["kernels"].values())
        if not info["ok"]:
            info["error"] = "kernel(s) missing from the CUBIN: " + ", ".join(
                k for k, v in info["kernels"].items() if not v["ok"]
            )
    except Exception as e:
        info["error"] = f"{type(e).__name__}: {e}"
        for k in KERNEL_GROUPS[group]:
            info["kernels"].setdefault(k, {"ok": False, "group": group})
    finally:
        if prog is not None:
            try:
                call(nvrtc.nvrtcDestroyProgram, prog)
            except Exception:
                pass
    info["compile_s"] = round(time.perf_counter() - t0, 3)
    return info


def compile_all(arch: str) -> dict:
    src = KERNEL_SRC.read_text()
    return {g: compile_group(g, arch, src) for g in KERNEL_GROUPS}


def compile_summary(groups: dict, arch: str) -> dict:
    kernels = {}
    for g in groups.values():
        kernels.update(g["kernels"])
    n_ok = sum(1 for v in kernels.values() if v.get("ok"))
    return {
        "arch": arch,
        "nvrtc": nvrtc_version(),
        "n_expected": len(ALL_KERNELS),
        "n_compiled": n_ok,
        "ok": n_ok == len(ALL_KERNELS),
        "groups": {
            k: {
                "ok": v["ok"],
                "error": v["error"],
                "cubin_bytes": v["cubin_bytes"],
                "compile_s": v["compile_s"],
                "options": v["options"],
                "log": v["log"][-4000:],
            }
            for k, v in groups.items()
        },
        "kernels": kernels,
    }


def print_kernel_table(summary: dict, loaded: dict | None = None) -> None:
    print(
        f"\nkernels (NVRTC {summary['nvrtc']}, {summary['arch']}; ptxas -v"
        + ("; driver attributes after load" if loaded else "")
        + ")"
    )
    hdr = f"  {'kernel':<16}{'group':<7}{'ok':<4}{'regs':>5}{'smem':>6}{'stack':>6}{'spill_st':>9}{'spill_ld':>9}"
    if loaded:
        hdr += f"  {'drv_regs':>8}{'local':>6}{'smem':>6}"
    print(hdr)
    for name in ALL_KERNELS:
        k = summary["kernels"].get(name, {})

        def f(x):
            return "-" if x is None else str(x)

        line = (
            f"  {name:<16}{k.get('group', '?'):<7}{'yes' if k.get('ok') else 'NO':<4}{f(k.get('regs')):>5}"
            f"{f(k.get('smem_bytes')):>6}{f(k.get('stack_bytes')):>6}{f(k.get('spill_store_bytes')):>9}"
            f"{f(k.get('spill_load_bytes')):>9}"
        )
        if loaded:
            a = loaded.get(name) or {}
            line += f"  {f(a.get('num_regs')):>8}{f(a.get('local_bytes')):>6}{f(a.get('shared_bytes')):>6}"
        print(line)
    for g, v in summary["groups"].items():
        if v["error"]:
            print(f"  group {g}: {v['error'].splitlines()[0]}")


# ----------------------------------------------------------------------------
# Kernel arguments


def U32(v) -> ctypes.c_uint32:
    return ctypes.c_uint32(int(v) & 0xFFFFFFFF)


def U64(v) -> ctypes.c_uint64:
    return ctypes.c_uint64(int(v) & 0xFFFFFFFFFFFFFFFF)


PTR = U64


class KArgs:
    """void* kernelParams[] built from ctypes values (kept alive with it)."""

    __slots__ = ("arr", "ptr", "vals")

    def __init__(self, vals):
        self.vals = list(vals)
        if self.vals:
            self.arr = (ctypes.c_void_p * len(self.vals))(*[ctypes.addressof(v) for v in self.vals])
            self.ptr = ctypes.addressof(self.arr)
        else:
            self.arr = None
            self.ptr = 0


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


# ----------------------------------------------------------------------------
# Device


class Pinned:
    """cuMemHostAlloc(PORTABLE|DEVICEMAP) buffer with numpy views."""

    def __init__(self, nbytes: int, flags: int | None = None):
        if flags is None:
            flags = driver.CU_MEMHOSTALLOC_PORTABLE | driver.CU_MEMHOSTALLOC_DEVICEMAP
        self.nbytes = int(nbytes)
        self.hptr = int(call(driver.cuMemHostAlloc, self.nbytes, flags))
        self.dptr = int(call(driver.cuMemHostGetDevicePointer, self.hptr, 0))
        self._buf = (ctypes.c_uint8 * self.nbytes).from_address(self.hptr)
        self.u8 = np.ctypeslib.as_array(self._buf)
        self.u8[:] = 0
        self.freed = False

    def view(self, dtype, offset: int = 0, count: int | None = None) -> np.ndarray:
        dt = np.dtype(dtype)
        if count is None:
            count = (self.nbytes - offset) // dt.itemsize
        return self.u8[offset : offset + count * dt.itemsize].view(dt)

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            call(driver.cuMemFreeHost, self.hptr)


class Ctl:
    """One control block (CTL_WORDS u32) in the pinned arena."""

    def __init__(self, arena: Pinned, offset: int, label: str):
        self.label = label
        self.offset = offset
        self.w = arena.view(np.uint32, offset, CTL_WORDS)
        self.w[:] = 0
        self.dptr = arena.dptr + offset
        self.hptr = arena.hptr + offset
        add_rescuer(self.stop)

    def stop(self) -> None:
        self.w[CTL_SHUTDOWN] = 1
        self.w[CTL_DOORBELL] = DOORBELL_STOP

    def word_dptr(self, idx: int) -> int:
        return self.dptr + 4 * idx

    @property
    def exit_reason(self) -> str:
        return EXIT_NAMES.get(int(self.w[CTL_EXIT]), str(int(self.w[CTL_EXIT])))


class Dev:
    """The primary context of one device, plus what the probes allocate."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        call(driver.cuInit, 0)
        self.driver_version = int(call(driver.cuDriverGetVersion))
        self.dev = call(driver.cuDeviceGet, ordinal)
        raw = call(driver.cuDeviceGetName, 256, self.dev)
        if isinstance(raw, (bytes, bytearray)):
            raw = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
        self.name = str(raw).strip()
        A = driver.CUdevice_attribute
        self.cc = (
            self.attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            self.attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        )
        self.props = {
            "name": self.name,
            "compute_capability": f"{self.cc[0]}.{self.cc[1]}",
            "multiprocessors": self.attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            "l2_bytes": self.attr(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
            "sm_clock_khz": self._attr_or_none("CU_DEVICE_ATTRIBUTE_CLOCK_RATE"),
            "mem_clock_khz": self._attr_or_none("CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE"),
            "total_mem_bytes": int(call(driver.cuDeviceTotalMem, self.dev)),
            "unified_addressing": self._attr_or_none("CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING"),
            "can_map_host_memory": self._attr_or_none("CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY"),
            "driver_version": self.driver_version,
        }
        self.ctx = call(driver.cuDevicePrimaryCtxRetain, self.dev)
        call(driver.cuCtxSetCurrent, self.ctx)
        self.prio_least, self.prio_greatest = call(driver.cuCtxGetStreamPriorityRange)
        self.props["stream_priority_range"] = [int(self.prio_least), int(self.prio_greatest)]
        try:
            self.props["module_loading_mode"] = getattr(call(driver.cuModuleGetLoadingMode), "name", None)
        except Exception as e:
            self.props["module_loading_mode"] = f"unknown ({e})"
        self.props["CUDA_MODULE_LOADING"] = os.environ.get("CUDA_MODULE_LOADING")
        self._lock = threading.Lock()
        self.arena = Pinned(1 * MIB)
        self._arena_next = 0
        self.staging = Pinned(8 * MIB)
        self._staging_lock = threading.Lock()
        self.streams: list = []
        self.allocs: set[int] = set()

    def attr(self, a) -> int:
        return int(call(driver.cuDeviceGetAttribute, a, self.dev))

    def _attr_or_none(self, name: str):
        a = getattr(driver.CUdevice_attribute, name, None)
        if a is None:
            return None
        try:
            return self.attr(a)
        except CudaError:
            return None

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    def make_current(self) -> None:
        call(driver.cuCtxSetCurrent, self.ctx)

    # -- memory
    def new_ctl(self, label: str) -> Ctl:
        with self._lock:
            if self._arena_next + CTL_WORDS * 4 > self.arena.nbytes:
                self.arena = Pinned(1 * MIB)  # the old arena stays allocated
                self._arena_next = 0
            off = self._arena_next
            self._arena_next += CTL_WORDS * 4
        return Ctl(self.arena, off, label)

    def malloc(self, nbytes: int) -> int:
        p = int(call(driver.cuMemAlloc, int(nbytes)))
        self.allocs.add(p)
        return p

    def free(self, p: int) -> None:
        if p in self.allocs:
            self.allocs.discard(p)
            call(driver.cuMemFree, p)

    def memset32(self, p: int, value: int, count: int, stream) -> None:
        call(driver.cuMemsetD32Async, p, int(value) & 0xFFFFFFFF, int(count), stream)

    def d2h(self, p: int, nbytes: int, stream, timeout_s: float = 10.0) -> np.ndarray:
        """Copy device memory to a fresh numpy uint8 array (through pinned staging)."""
        out = np.empty(nbytes, np.uint8)
        with self._staging_lock:
            done = 0
            while done < nbytes:
                n = min(nbytes - done, self.staging.nbytes)
                call(driver.cuMemcpyDtoHAsync, self.staging.hptr, p + done, n, stream)
                if not self.wait_stream(stream, timeout_s):
                    raise Timeout("device-to-host copy")
                out[done : done + n] = self.staging.u8[:n]
                done += n
        return out

    def read_u32(self, p: int, count: int, stream) -> np.ndarray:
        return self.d2h(p, 4 * count, stream).view(np.uint32)

    def read_u64(self, p: int, count: int, stream) -> np.ndarray:
        return self.d2h(p, 8 * count, stream).view(np.uint64)

    # -- streams, events
    def stream(self, high_priority: bool = False):
        prio = int(self.prio_greatest) if high_priority else int(self.prio_least)
        s = call(driver.cuStreamCreateWithPriority, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, prio)
        self.streams.append(s)
        return s

    def event(self):
        return call(driver.cuEventCreate, driver.CUevent_flags.CU_EVENT_DEFAULT)

    def wait_stream(self, stream, timeout_s: float) -> bool:
        """Poll cuStreamQuery until the stream drains; False on timeout."""
        deadline = time.monotonic() + timeout_s
        nap = 20e-6
        while True:
            r = driver.cuStreamQuery(stream)[0]
            if int(r) == 0:
                return True
            if r != driver.CUresult.CUDA_ERROR_NOT_READY:
                raise CudaError(f"cuStreamQuery failed: {err_text(r)}")
            if time.monotonic() > deadline:
                return False
            time.sleep(nap)
            nap = min(nap * 2, 2e-3)

    def wait_event(self, ev, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        nap = 20e-6
        while True:
            r = driver.cuEventQuery(ev)[0]
            if int(r) == 0:
                return True
            if r != driver.CUresult.CUDA_ERROR_NOT_READY:
                raise CudaError(f"cuEventQuery failed: {err_text(r)}")
            if time.monotonic() > deadline:
                return False
            time.sleep(nap)
            nap = min(nap * 2, 2e-3)

    def elapsed_ms(self, e0, e1) -> float:
        return float(call(driver.cuEventElapsedTime, e0, e1))

    # -- kernels
    def launch(self, f, args, stream, grid: int = 1, block: int = 1) -> None:
        ka = KArgs(args)
        check(driver.cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, ka.ptr, 0), "cuLaunchKernel")


def try_init_device(ordinal: int):
    """(Dev, None), or (None, reason) when there is no usable CUDA device."""
    try:
        r = driver.cuInit(0)
    except Exception as e:
        return None, f"cuInit unavailable ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    if int(r[0]) != 0:
        return None, f"cuInit failed: {err_text(r[0])}"
    r = driver.cuDeviceGetCount()
    if int(r[0]) != 0:
        return None, f"cuDeviceGetCount failed: {err_text(r[0])}"
    if int(r[1]) <= ordinal:
        return None, f"{int(r[1])} CUDA device(s), ordinal {ordinal} requested"
    return Dev(ordinal), None


def wait_until(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    nap = 10e-6
    while not pred():
        if time.monotonic() > deadline:
            return pred()
        time.sleep(nap)
        nap = min(nap * 2, 1e-3)
    return True


# ----------------------------------------------------------------------------
# Graph helpers


def graph_add_node(graph, deps: list, params):
    """cuGraphAddNode across bindings versions (13.x has dependencyData)."""
    deps = list(deps)
    try:
        return check(driver.cuGraphAddNode(graph, deps, None, len(deps), params), "cuGraphAddNode")
    except TypeError:
        return check(driver.cuGraphAddNode(graph, deps, len(deps), params), "cuGraphAddNode")


def add_kernel_node(graph, deps: list, func, args: list):
    p = driver.CUDA_KERNEL_NODE_PARAMS()
    p.func = func
    p.gridDimX = p.gridDimY = p.gridDimZ = 1
    p.blockDimX = p.blockDimY = p.blockDimZ = 1
    p.sharedMemBytes = 0
    ka = KArgs(args)
    p.kernelParams = ka.ptr
    p.extra = 0
    deps = list(deps)
    return call(driver.cuGraphAddKernelNode, graph, deps, len(deps), p)


def add_cond_node(graph, deps: list, ctx, handle, cond_type, size: int):
    """A conditional node; returns (node, [body graphs])."""
    p = driver.CUgraphNodeParams()
    p.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    p.conditional.handle = handle
    p.conditional.type = cond_type
    p.conditional.size = size
    p.conditional.ctx = ctx
    node = graph_add_node(graph, deps, p)
    bodies = list(p.conditional.phGraph_out)
    if len(bodies) < size:
        raise CudaError(f"conditional node returned {len(bodies)} body graphs, expected {size}")
    return node, bodies[:size]


def cond_handle(graph, ctx, default: int, assign_default: bool):
    flags = driver.CU_GRAPH_COND_ASSIGN_DEFAULT if assign_default else 0
    return call(driver.cuGraphConditionalHandleCreate, graph, ctx, default, flags)


def graph_node_types(graph) -> list[str]:
    r = call(driver.cuGraphGetNodes, graph, 0)
    n = int(r[1]) if isinstance(r, tuple) else 0
    if n == 0:
        return []
    nodes, n = call(driver.cuGraphGetNodes, graph, n)
    out = []
    for nd in list(nodes)[: int(n)]:
        t = call(driver.cuGraphNodeGetType, nd)
        out.append(getattr(t, "name", str(t)))
    return out


class Graphs:
    """Graphs / execs made by a probe, destroyed at the end."""

    def __init__(self):
        self.graphs: list = []
        self.execs: list = []

    def create(self):
        g = call(driver.cuGraphCreate, 0)
        self.graphs.append(g)
        return g

    def instantiate(self, g):
        ge = call(driver.cuGraphInstantiate, g, 0)
        self.execs.append(ge)
        return ge

    def destroy(self) -> None:
        for ge in self.execs:
            try:
                call(driver.cuGraphExecDestroy, ge)
            except Exception:
                pass
        for g in self.graphs:
            try:
                call(driver.cuGraphDestroy, g)
            except Exception:
                pass
        self.graphs.clear()
        self.execs.clear()


# ----------------------------------------------------------------------------
# Probe context


class Probe:
    """What every probe gets: device, kernels, streams, torch, budget."""

    def __init__(self, dev: Dev, args, budget: Budget, groups: dict, torch_mod, torch_err):
        self.dev = dev
        self.args = args
        self.B = budget
        self.groups = groups
        self.torch = torch_mod
        self.torch_err = torch_err
        self.arch = args.arch or dev.arch
        self.funcs: dict = {}
        self.func_err: dict = {}
        self.modules: dict = {}
        self.func_attrs: dict = {}
        self.tainted: str | None = None
        self.context_dead: str | None = None
        # persistent kernels get a high-priority non-blocking stream of their own
        self.sched_stream = dev.stream(high_priority=True)
        self.work_stream = dev.stream()
        self.stream_a = dev.stream(high_priority=True)
        self.stream_b = dev.stream(high_priority=True)
        self.aux_stream = dev.stream()
        self.ev0 = dev.event()
        self.ev1 = dev.event()

    def load_modules(self) -> None:
        for g, info in self.groups.items():
            if not info["ok"]:
                for k in KERNEL_GROUPS[g]:
                    self.func_err[k] = f"compile failed: {info['error']}"
                continue
            try:
                mod = call(driver.cuModuleLoadData, info["cubin"])
                self.modules[g] = mod
            except Exception as e:
                for k in KERNEL_GROUPS[g]:
                    self.func_err[k] = f"cuModuleLoadData failed: {e}"
                continue
            for k in KERNEL_GROUPS[g]:
                try:
                    f = call(driver.cuModuleGetFunction, mod, k.encode())
                    # load now: lazy loading on first launch can wait for
                    # running kernels, which a persistent kernel never ends
                    if hasattr(driver, "cuFuncLoad"):
                        call(driver.cuFuncLoad, f)
                    self.funcs[k] = f
                    self.func_attrs[k] = self._func_attrs(f)
                except Exception as e:
                    self.func_err[k] = str(e)

    @staticmethod
    def _func_attrs(f) -> dict:
        FA = driver.CUfunction_attribute
        out = {}
        for key, name in (
            ("num_regs", "CU_FUNC_ATTRIBUTE_NUM_REGS"),
            ("local_bytes", "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES"),
            ("shared_bytes", "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES"),
            ("max_threads", "CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK"),
            ("binary_version", "CU_FUNC_ATTRIBUTE_BINARY_VERSION"),
        ):
            try:
                out[key] = int(call(driver.cuFuncGetAttribute, getattr(FA, name), f))
            except Exception as e:
                out[key] = f"error: {e}"
        return out

    def thread_init(self) -> None:
        """A new thread: our context current, torch on our device."""
        self.dev.make_current()
        if self.torch is not None:
            self.torch.cuda.set_device(self.args.device)

    def fn(self, name: str):
        if name in self.funcs:
            return self.funcs[name]
        raise SkipProbe(f"kernel {name} unavailable: {self.func_err.get(name, 'not loaded')}")

    def need_torch(self):
        if self.torch is None:
            raise SkipProbe(f"torch unavailable: {self.torch_err}")
        return self.torch

    def require_clean(self) -> None:
        if self.tainted:
            raise SkipProbe(f"skipped: {self.tainted} (a device-wide sync could hang)")

    def taint(self, why: str) -> None:
        if not self.tainted:
            self.tainted = why
            print(f"  !! {why}; probes that need a device-wide sync are skipped from here", flush=True)

    def stop_and_wait(self, ctl: Ctl, stream, what: str, timeout_s: float = 10.0) -> bool:
        ctl.stop()
        ok = self.dev.wait_stream(stream, self.B.t(timeout_s))
        if not ok:
            self.taint(f"{what}: persistent kernel did not exit after its shutdown word was set")
        return ok


def run_in_thread(fn, timeout_s: float, init=None, name: str = "op"):
    """Run init() then fn() in a daemon thread; returns (record, thread, box)."""
    box: dict = {}

    def target():
        t0 = time.perf_counter_ns()
        try:
            if init is not None:
                init()
            box["value"] = fn()
            box["status"] = "completed"
        except BaseException as e:
            box["status"] = "error"
            box["error"] = f"{type(e).__name__}: {e}"
            if not isinstance(e, (CudaError, Timeout)):
                box["traceback"] = traceback.format_exc(limit=6)
        finally:
            box["elapsed_ms"] = (time.perf_counter_ns() - t0) / 1e6

    th = threading.Thread(target=target, name=name, daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        return {"status": "blocked", "timeout_s": timeout_s}, th, box
    rec = {"status": box.get("status", "error"), "elapsed_ms": round(box.get("elapsed_ms", 0.0), 3)}
    for k in ("value", "error", "traceback"):
        if k in box:
            rec["result" if k == "value" else k] = box[k]
    return rec, th, box


# ----------------------------------------------------------------------------
# Probe 1: host -> device doorbell


def _doorbell_floor(ctl: Ctl, n: int) -> dict:
    """The Python host loop alone: answer already equal, no device involved."""
    w = ctl.w
    pc = time.perf_counter_ns
    out = np.empty(n, np.int64)
    for i in range(n):
        seq = (i + 1) & 0x7FFFFFFF
        w[CTL_ANSWER] = seq
        t0 = pc()
        w[CTL_DOORBELL] = seq
        dl = t0 + 1_000_000_000
        while w[CTL_ANSWER] != seq:
            if pc() > dl:
                break
        out[i] = pc() - t0
    return summarize(out)


def _doorbell_variant(P: Probe, f, sleep_ns: int, use_sleep: int) -> dict:
    dev, B = P.dev, P.B
    s = P.sched_stream
    ctl = dev.new_ctl(f"doorbell sleep={sleep_ns if use_sleep else 'none'}")
    w = ctl.w
    total = B.db_warm + B.db_reps
    res: dict = {"device_poll": f"__nanosleep({sleep_ns})" if use_sleep else "spin (no sleep)"}
    samples = np.zeros(total, np.int64)
    done = 0
    dev.launch(f, [PTR(ctl.dptr), U32(sleep_ns), U32(use_sleep), U32(0), U64(B.kernel_budget_ns)], s)
    try:
        if not wait_until(lambda: w[CTL_STARTED] == 1, B.t(20)):
            raise Timeout("persistent kernel did not start within 20 s")
        pc = time.perf_counter_ns
        limit = int(B.t(0.5) * 1e9)
        for i in range(total):
            seq = i + 1
            t0 = pc()
            w[CTL_DOORBELL] = seq
            dl = t0 + limit
            while w[CTL_ANSWER] != seq:
                if pc() > dl:
                    break
            t1 = pc()
            if w[CTL_ANSWER] != seq:
                res["status"] = "timeout"
                res["where"] = f"no answer to doorbell {seq} within {limit / 1e9:.2f} s"
                break
            samples[i] = t1 - t0
            done += 1
    finally:
        exited = P.stop_and_wait(ctl, s, "doorbell")
    handled = int(w[CTL_HANDLED])
    polls = int(w[CTL_POLLS_LO]) | (int(w[CTL_POLLS_HI]) << 32)
    res["round_trip"] = summarize(samples[B.db_warm : done]) if done > B.db_warm else {"n": 0}
    res["warmup_discarded"] = B.db_warm
    res["device_polls"] = polls
    res["kernel_exit"] = ctl.exit_reason if exited else "did_not_exit"
    ok = done == total and handled == total and ctl.exit_reason in ("stop_word", "shutdown_word")
    res["check"] = {
        "ok": ok,
        "echoed": done,
        "expected": total,
        "kernel_handled": handled,
        "what": "each doorbell sequence number echoed back exactly once",
    }
    if "status" not in res:
        res["status"] = "ok" if ok else "failed_check"
    return res


def probe_doorbell(P: Probe) -> dict:
    f = P.fn("rl_doorbell")
    out: dict = {
        "what": "host writes a pinned word, a 1-thread persistent kernel (ld.acquire.sys) echoes it "
        "into another pinned word, host polls it; host-side perf_counter_ns round trip",
        "variants": {},
        "table": [],
    }
    ctl = P.dev.new_ctl("doorbell floor")
    out["host_loop_floor"] = _doorbell_floor(ctl, P.B.db_reps)
    out["table"].append(trow("host loop floor (no device)", out["host_loop_floor"]))
    for label, ns, use in (
        ("spin", 0, 0),
        ("nanosleep_0", 0, 1),
        ("nanosleep_100", 100, 1),
        ("nanosleep_1000", 1000, 1),
    ):
        if P.tainted:
            r = {"status": "skipped", "reason": P.tainted}
        else:
            r = sub(_doorbell_variant, P, f, ns, use)
        out["variants"][label] = r
        ok = (r.get("check") or {}).get("ok")
        out["table"].append(
            trow(
                f"doorbell RTT, device {label}",
                r.get("round_trip"),
                note=r["status"] if not ok else "echo ok",
            )
        )
    out["status"] = "ok" if all(v.get("status") == "ok" for v in out["variants"].values()) else "partial"
    return out


# ----------------------------------------------------------------------------
# Probe 2: device -> device handoff between two resident kernels


def _timer_resolution(P: Probe) -> dict:
    f = P.fn("rl_timer_res")
    s = P.work_stream
    buf = P.dev.malloc(64)
    try:
        P.dev.memset32(buf, 0, 16, s)
        P.dev.launch(f, [PTR(buf), U32(P.B.timer_reads)], s)
        if not P.dev.wait_stream(s, P.B.t(20)):
            raise Timeout("rl_timer_res did not finish")
        v = P.dev.read_u64(buf, 3, s)
    finally:
        P.dev.free(buf)
    minstep, changes, span = int(v[0]), int(v[1]), int(v[2])
    return {
        "reads": P.B.timer_reads,
        "min_step_ns": minstep if changes else None,
        "changes": changes,
        "span_ns": span,
        "mean_step_ns": (span / changes) if changes else None,
        "check": {"ok": changes > 0 and span > 0},
    }


def _pingpong(P: Probe) -> dict:
    dev, B = P.dev, P.B
    f = P.fn("rl_pingpong")
    n = B.pp_n
    warm = min(B.pp_warm, n // 2)
    sa, sb, s = P.stream_a, P.stream_b, P.work_stream
    flag = dev.malloc(256)
    stamps = dev.malloc(4 * 8 * n)
    ping_send, ping_recv, pong_send, pong_recv = (stamps + k * 8 * n for k in range(4))
    ctl = dev.new_ctl("pingpong")
    res: dict = {"iterations": n, "warmup_discarded": warm}
    try:
        dev.memset32(flag, 0, 64, s)
        dev.memset32(stamps, 0, 4 * 2 * n, s)
        if not dev.wait_stream(s, B.t(10)):
            raise Timeout("memset")
        budget = U64(int(B.t(20) * 1e9))
        dev.launch(f, [PTR(flag), U32(1), U32(n), PTR(pong_send), PTR(pong_recv), PTR(ctl.dptr), budget], sb)
        dev.launch(f, [PTR(flag), U32(0), U32(n), PTR(ping_send), PTR(ping_recv), PTR(ctl.dptr), budget], sa)
        t0 = time.monotonic()
        ok_a = dev.wait_stream(sa, B.t(25))
        ok_b = ok_a and dev.wait_stream(sb, B.t(5))
        res["host_wall_s"] = round(time.monotonic() - t0, 4)
        if not (ok_a and ok_b):
            ctl.stop()
            ea, eb = dev.wait_stream(sa, B.t(10)), dev.wait_stream(sb, B.t(10))
            if not (ea and eb):
                P.taint("ping-pong kernels did not exit")
            res.update(
                status="timeout",
                where="ping-pong did not finish",
                done=[int(ctl.w[CTL_DONE0]), int(ctl.w[CTL_DONE1])],
                kernel_exit=ctl.exit_reason,
            )
            return res
        ps = dev.read_u64(ping_send, n, s).astype(np.int64)
        pr = dev.read_u64(ping_recv, n, s).astype(np.int64)
        qs = dev.read_u64(pong_send, n, s).astype(np.int64)
        qr = dev.read_u64(pong_recv, n, s).astype(np.int64)
        final_flag = int(dev.read_u32(flag, 1, s)[0])
    finally:
        dev.free(flag)
        dev.free(stamps)
    d0, d1 = int(ctl.w[CTL_DONE0]), int(ctl.w[CTL_DONE1])
    a2b = qr - ps  # ping -> pong
    b2a = pr - qs  # pong -> ping
    rtt = pr - ps
    sl = slice(warm, n)
    monotone = bool(np.all(a2b >= 0) and np.all(b2a >= 0))
    nonzero = bool(np.all(ps > 0) and np.all(pr > 0) and np.all(qs > 0) and np.all(qr > 0))
    ok = d0 == n and d1 == n and final_flag == 2 * n and monotone and nonzero
    res["ping_to_pong"] = summarize(a2b[sl])
    res["pong_to_ping"] = summarize(b2a[sl])
    res["one_way_both"] = summarize(np.concatenate([a2b[sl], b2a[sl]]))
    res["round_trip"] = summarize(rtt[sl])
    span = float(pr[n - 1] - ps[warm])
    res["one_way_mean_from_total_ns"] = span / (2 * (n - warm)) if n > warm else None
    res["kernel_exit"] = ctl.exit_reason
    res["check"] = {
        "ok": ok,
        "done": [d0, d1],
        "expected": n,
        "final_flag": final_flag,
        "expected_flag": 2 * n,
        "stamps_ordered": monotone,
        "stamps_written": nonzero,
    }
    res["status"] = "ok" if ok else "failed_check"
    return res


def probe_handoff(P: Probe) -> dict:
    out: dict = {
        "what": "two 1-thread kernels resident on two streams hand a device-memory flag back and forth "
        "(st.release.gpu / ld.acquire.gpu); one-way latency from %globaltimer stamps",
        "table": [],
    }
    out["globaltimer"] = sub(_timer_resolution, P)
    out["pingpong"] = pp = sub(_pingpong, P)
    gt = out["globaltimer"]
    ok = (pp.get("check") or {}).get("ok")
    note = "ok" if ok else pp.get("status", "")
    if gt.get("min_step_ns"):
        note += f"; globaltimer step {gt['min_step_ns']} ns (mean {gt['mean_step_ns']:.0f})"
    out["table"].append(trow("d2d handoff one-way (both dirs)", pp.get("one_way_both"), note=note))
    out["table"].append(trow("d2d handoff round trip", pp.get("round_trip")))
    m = pp.get("one_way_mean_from_total_ns")
    out["table"].append(["d2d one-way, mean from total span", m / 1e3 if m else None, None, "us", ""])
    out["status"] = "ok" if gt.get("status") == "ok" and pp.get("status") == "ok" else "partial"
    return out


# ----------------------------------------------------------------------------
# Probe 3: launch costs and conditional graphs


def _time_launches(P: Probe, launch, label: str) -> dict:
    """Host call cost, launch+sync latency, back-to-back device rate."""
    dev, B = P.dev, P.B
    s = P.work_stream
    pc = time.perf_counter_ns
    for _ in range(B.launch_warm):
        launch()
    if not dev.wait_stream(s, B.t(10)):
        raise Timeout(f"{label}: warm-up launches did not finish")
    host = np.empty(B.launch_reps, np.int64)
    for i in range(B.launch_reps):
        t0 = pc()
        launch()
        host[i] = pc() - t0
        if (i & 63) == 63 and not dev.wait_stream(s, B.t(10)):
            raise Timeout(f"{label}: launches did not drain")
    if not dev.wait_stream(s, B.t(10)):
        raise Timeout(f"{label}: launches did not drain")
    sync = np.empty(B.sync_reps, np.int64)
    SS = driver.cuStreamSynchronize
    for i in range(B.sync_reps):
        t0 = pc()
        launch()
        check(SS(s), "cuStreamSynchronize")
        sync[i] = pc() - t0
    call(driver.cuEventRecord, P.ev0, s)
    t0 = pc()
    for _ in range(B.b2b):
        launch()
    call(driver.cuEventRecord, P.ev1, s)
    t_enq = pc() - t0
    if not dev.wait_event(P.ev1, B.t(20)):
        raise Timeout(f"{label}: back-to-back launches did not finish")
    ms = dev.elapsed_ms(P.ev0, P.ev1)
    return {
        "host_call": summarize(host),
        "launch_plus_sync": summarize(sync),
        "back_to_back": {
            "n": B.b2b,
            "device_us_per_launch": ms * 1e3 / B.b2b,
            "host_enqueue_us_per_launch": t_enq / 1e3 / B.b2b,
        },
    }


def _cuda_python_floor(P: Probe) -> dict:
    s = P.work_stream
    pc = time.perf_counter_ns
    q = driver.cuStreamQuery
    out = np.empty(2000, np.int64)
    for i in range(out.size):
        t0 = pc()
        check(q(s), "cuStreamQuery")
        out[i] = pc() - t0
    return summarize(out)


def _empty_kernel(P: Probe) -> dict:
    f = P.fn("rl_empty")
    s = P.work_stream
    L = driver.cuLaunchKernel

    def launch():
        check(L(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0), "cuLaunchKernel")

    return _time_launches(P, launch, "empty kernel")


def _one_node_graph(P: Probe, G: Graphs) -> dict:
    f = P.fn("rl_empty")
    s = P.work_stream
    g = G.create()
    add_kernel_node(g, [], f, [])
    ge = G.instantiate(g)
    if hasattr(driver, "cuGraphUpload"):
        call(driver.cuGraphUpload, ge, s)
    GL = driver.cuGraphLaunch

    def launch():
        check(GL(ge, s), "cuGraphLaunch")

    r = _time_launches(P, launch, "one-node graph")
    # a chain of empty kernel nodes: the per-node cost inside one graph
    B = P.B
    g2 = G.create()
    prev: list = []
    for _ in range(B.chain_nodes):
        prev = [add_kernel_node(g2, prev, f, [])]
    ge2 = G.instantiate(g2)
    times = []
    for _ in range(B.chain_reps + 2):
        call(driver.cuEventRecord, P.ev0, s)
        call(driver.cuGraphLaunch, ge2, s)
        call(driver.cuEventRecord, P.ev1, s)
        if not P.dev.wait_event(P.ev1, B.t(10)):
            raise Timeout("chain graph")
        times.append(P.dev.elapsed_ms(P.ev0, P.ev1) * 1e6 / B.chain_nodes)
    r["chain_per_node"] = summarize(times[2:])
    r["chain_nodes"] = B.chain_nodes
    return r


def _run_counted_graph(P: Probe, ge, state: int, n: int, stream, extra=None) -> tuple[float, int]:
    """Launch a WHILE graph whose body counts to n; returns (ms, count)."""
    dev, B = P.dev, P.B
    dev.memset32(state, 0, 1, stream)
    dev.memset32(state + 4, n, 1, stream)
    dev.memset32(state + 8, n + 16, 1, stream)  # hard cap: the kernel traps beyond it
    if extra:
        extra()
    call(driver.cuEventRecord, P.ev0, stream)
    call(driver.cuGraphLaunch, ge, stream)
    call(driver.cuEventRecord, P.ev1, stream)
    if not dev.wait_event(P.ev1, B.t(10 + n * 20e-6)):
        raise Timeout(f"WHILE graph with {n} iterations did not finish")
    ms = dev.elapsed_ms(P.ev0, P.ev1)
    count = int(dev.read_u32(state, 1, stream)[0])
    return ms, count


def _while_stats(P: Probe, ge, state: int, stamps: int, cap: int, stream, extra=None, after=None) -> dict:
    B = P.B
    small = []
    bad: list = []
    for _ in range(B.while_small_reps + 1):
        ms, c = _run_counted_graph(P, ge, state, 1, stream, extra)
        small.append(ms)
        if c != 1:
            bad.append(("n=1", c))
        if after:
            after(1, bad)
    big = []
    for _ in range(B.while_reps + 1):
        ms, c = _run_counted_graph(P, ge, state, B.while_n, stream, extra)
        big.append(ms)
        if c != B.while_n:
            bad.append((f"n={B.while_n}", c))
        if after:
            after(B.while_n, bad)
    small_ms = float(np.median(small[1:]))
    per_iter_ns = [(b - small_ms) * 1e6 / (B.while_n - 1) for b in big[1:]]
    st = P.dev.read_u64(stamps, min(cap, B.while_n), stream).astype(np.int64)
    d = np.diff(st)
    skip = min(10, d.size // 2)
    return {
        "iterations": B.while_n,
        "graph_time_n1": summarize(np.array(small[1:]) * 1e6),
        "graph_time_n": summarize(np.array(big[1:]) * 1e6),
        "per_iteration_from_events": summarize(per_iter_ns),
        "per_iteration_from_stamps": summarize(d[skip:]),
        "stamps_ordered": bool(np.all(d >= 0)) if d.size else None,
        "check": {
            "ok": not bad and (bool(np.all(d >= 0)) if d.size else False),
            "bad_counts": bad[:8],
            "what": "iteration counter == requested iterations",
        },
    }


def _while_graph(P: Probe, G: Graphs) -> dict:
    dev, B = P.dev, P.B
    f = P.fn("rl_while_body")
    s = P.work_stream
    state = dev.malloc(256)
    cap = B.while_n
    stamps = dev.malloc(8 * cap)
    try:
        g = G.create()
        h = cond_handle(g, dev.ctx, 1, True)
        _, (body,) = add_cond_node(
            g, [], dev.ctx, h, driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE, 1
        )
        add_kernel_node(body, [], f, [U64(int(h)), PTR(state), PTR(stamps), U32(cap)])
        ge = G.instantiate(g)
        r = _while_stats(P, ge, state, stamps, cap, s)
        # the whole WHILE graph (1 iteration) launched and waited for from the host
        pc = time.perf_counter_ns
        host = []
        for _ in range(B.sync_reps // 4 + 5):
            dev.memset32(state, 0, 1, s)
            dev.memset32(state + 4, 1, 1, s)
            dev.memset32(state + 8, 17, 1, s)
            if not dev.wait_stream(s, B.t(10)):
                raise Timeout("memset")
            t0 = pc()
            call(driver.cuGraphLaunch, ge, s)
            call(driver.cuStreamSynchronize, s)
            host.append(pc() - t0)
        r["host_launch_plus_sync_n1"] = summarize(host[5:])
        r["status"] = "ok" if r["check"]["ok"] else "failed_check"
        return r
    finally:
        if not P.tainted:
            dev.free(state)
            dev.free(stamps)


def _switch_graph(P: Probe, G: Graphs) -> dict:
    dev, B = P.dev, P.B
    f_ctl, f_br = P.fn("rl_switch_ctl"), P.fn("rl_branch")
    s = P.work_stream
    state = dev.malloc(256)
    counters = dev.malloc(256)
    cap = B.while_n
    stamps = dev.malloc(8 * cap)
    CT = driver.CUgraphConditionalNodeType
    try:
        g = G.create()
        hw = cond_handle(g, dev.ctx, 1, True)
        _, (body,) = add_cond_node(g, [], dev.ctx, hw, CT.CU_GRAPH_COND_TYPE_WHILE, 1)
        hs = cond_handle(body, dev.ctx, 0, False)
        k = add_kernel_node(body, [], f_ctl, [U64(int(hw)), U64(int(hs)), PTR(state), PTR(stamps), U32(cap)])
        _, branches = add_cond_node(body, [k], dev.ctx, hs, CT.CU_GRAPH_COND_TYPE_SWITCH, 4)
        for i, bg in enumerate(branches):
            add_kernel_node(bg, [], f_br, [PTR(counters), U32(i)])
        ge = G.instantiate(g)
        branch_bad: list = []

        def reset():
            dev.memset32(counters, 0, 4, s)

        def after(n, bad):
            c = dev.read_u32(counters, 4, s)
            want = [n // 4 + (1 if i < n % 4 else 0) for i in range(4)]
            if [int(x) for x in c] != want:
                branch_bad.append({"n": n, "got": [int(x) for x in c], "want": want})

        r = _while_stats(P, ge, state, stamps, cap, s, extra=reset, after=after)
        r["branch_check"] = {
            "ok": not branch_bad,
            "bad": branch_bad[:4],
            "what": "branch k ran exactly for iterations c with (c-1)%4 == k",
        }
        r["check"]["ok"] = r["check"]["ok"] and not branch_bad
        r["status"] = "ok" if r["check"]["ok"] else "failed_check"
        return r
    finally:
        if not P.tainted:
            for p in (state, counters, stamps):
                dev.free(p)


def probe_launch(P: Probe) -> dict:
    out: dict = {
        "what": "host launch costs (cuda-python call included) and device-side per-iteration cost of "
        "conditional graphs",
        "table": [],
    }
    G = Graphs()
    try:
        out["cuda_python_call_floor"] = sub(_cuda_python_floor, P)
        out["empty_kernel"] = ek = sub(_empty_kernel, P)
        out["one_node_graph"] = og = sub(_one_node_graph, P, G)
        out["while_graph"] = wg = sub(_while_graph, P, G)
        out["switch_graph"] = sg = sub(_switch_graph, P, G)
    finally:
        G.destroy()
    t = out["table"]
    t.append(trow("cuda-python call floor (cuStreamQuery)", out["cuda_python_call_floor"]))
    for label, r in (("empty kernel", ek), ("1-node graph", og)):
        t.append(trow(f"{label}: host launch call", r.get("host_call"), note=r.get("status", "")))
        t.append(trow(f"{label}: launch + stream sync", r.get("launch_plus_sync")))
        b = r.get("back_to_back") or {}
        t.append([f"{label}: back-to-back, device per launch", b.get("device_us_per_launch"), None, "us", ""])
    if og.get("chain_per_node"):
        t.append(trow("graph chain of 100 empty nodes, per node", og["chain_per_node"]))
    for label, r in (("WHILE", wg), ("WHILE+SWITCH(4)", sg)):
        note = r.get("status", "")
        t.append(trow(f"{label} per iteration (stamps)", r.get("per_iteration_from_stamps"), note=note))
        t.append(trow(f"{label} per iteration (events)", r.get("per_iteration_from_events")))
    if wg.get("host_launch_plus_sync_n1"):
        t.append(trow("WHILE graph (1 iter): launch + sync", wg["host_launch_plus_sync_n1"]))
    subs = [ek, og, wg, sg]
    out["status"] = "ok" if all(r.get("status") == "ok" for r in subs) else "partial"
    return out


# ----------------------------------------------------------------------------
# Probe 4: a torch CUDA graph inside a WHILE body


def probe_torchgraph(P: Probe) -> dict:
    torch = P.need_torch()
    P.require_clean()
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # full float32, for the float64 comparison
    try:
        return _torchgraph(P, torch)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32


def _torchgraph(P: Probe, torch) -> dict:
    dev, B = P.dev, P.B
    f = P.fn("rl_while_body")
    out: dict = {
        "what": "torch graph (2 matmuls + tanh, updating x in place) captured with "
        "CUDAGraph(keep_graph=True) on its own stream, embedded as a child node in a WHILE "
        "body that runs it K times; compared with K eager iterations",
        "table": [],
    }
    tdev = torch.device("cuda", P.args.device)
    gen = torch.Generator(device=tdev)
    gen.manual_seed(1234)
    M, K = 256, 1024
    x0 = torch.randn(M, K, device=tdev, generator=gen)
    w1 = torch.randn(K, K, device=tdev, generator=gen) / K**0.5
    w2 = torch.randn(K, K, device=tdev, generator=gen) / K**0.5
    x = x0.clone()

    def body():
        x.copy_(torch.tanh(torch.tanh(x @ w1) @ w2))

    side = torch.cuda.Stream(device=tdev)
    side.wait_stream(torch.cuda.current_stream(tdev))
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.synchronize(tdev)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(side):
        g.capture_begin(capture_error_mode="thread_local")
        try:
            body()
        finally:
            g.capture_end()
    torch.cuda.synchronize(tdev)
    raw = g.raw_cuda_graph()
    tg = driver.CUgraph(int(raw))
    out["torch_graph_node_types"] = sub(graph_node_types, tg)
    iters = B.torch_iters
    state = dev.malloc(256)
    stamps = dev.malloc(8 * 64)
    G = Graphs()
    s = P.work_stream
    try:
        outer = G.create()
        h = cond_handle(outer, dev.ctx, 1, True)
        _, (wbody,) = add_cond_node(
            outer, [], dev.ctx, h, driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE, 1
        )
        child = call(driver.cuGraphAddChildGraphNode, wbody, [], 0, tg)
        add_kernel_node(wbody, [child], f, [U64(int(h)), PTR(state), PTR(stamps), U32(64)])
        ge = G.instantiate(outer)
        out["instantiated"] = True
        runs = []
        count = None
        for _ in range(B.torch_reps):
            x.copy_(x0)
            torch.cuda.synchronize(tdev)
            ms, count = _run_counted_graph(P, ge, state, iters, s)
            runs.append(ms)
        xg = x.clone()
        # eager reference, same ops on the default stream
        x.copy_(x0)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            body()
        e1.record()
        torch.cuda.synchronize(tdev)
        eager_ms = e0.elapsed_time(e1)
        xe = x.clone()
        # float64 reference on the CPU
        r64 = x0.double().cpu()
        w1d, w2d = w1.double().cpu(), w2.double().cpu()
        for _ in range(iters):
            r64 = torch.tanh(torch.tanh(r64 @ w1d) @ w2d)
        rel = float((xg - xe).norm() / xe.norm())
        rel64_graph = float((xg.double().cpu() - r64).norm() / r64.norm())
        rel64_eager = float((xe.double().cpu() - r64).norm() / r64.norm())
        finite = bool(torch.isfinite(xg).all())
        ok = count == iters and finite and rel < 1e-4 and rel64_graph < 1e-3
        out.update(
            {
                "runs": True,
                "iterations": iters,
                "count": count,
                "graph_ms": summarize(np.array(runs) * 1e6),
                "eager_ms": eager_ms,
                "per_iteration_graph_us": float(np.median(runs)) * 1e3 / iters,
                "per_iteration_eager_us": eager_ms * 1e3 / iters,
                "rel_err_graph_vs_eager": rel,
                "bitwise_equal": bool(torch.equal(xg, xe)),
                "rel_err_graph_vs_fp64": rel64_graph,
                "rel_err_eager_vs_fp64": rel64_eager,
                "check": {"ok": ok, "what": "iteration count, finite output, graph == eager within 1e-4"},
            }
        )
        out["table"].append(
            [
                "torch child graph in WHILE: per iteration",
                out["per_iteration_graph_us"],
                None,
                "us",
                f"{'match' if ok else 'MISMATCH'} rel={rel:.1e}",
            ]
        )
        out["table"].append(["same ops eager: per iteration", out["per_iteration_eager_us"], None, "us", ""])
        out["status"] = "ok" if ok else "failed_check"
    finally:
        G.destroy()
        if not P.tainted:
            dev.free(state)
            dev.free(stamps)
        del g
    return out


# ----------------------------------------------------------------------------
# Probe 5: what blocks while a persistent kernel runs; process exit


def _blocking_ops(P: Probe, torch) -> list:
    """(name, fn, needs_torch) tried one at a time while the kernel runs."""
    dev = P.dev
    keep: list = []
    tdev = torch.device("cuda", P.args.device) if torch else None
    state: dict = {}
    ops = []

    if torch is not None:
        # warm everything these ops use, before the persistent kernel starts
        side = torch.cuda.Stream(device=tdev)
        t = torch.empty(4096, dtype=torch.uint8, device=tdev)
        with torch.cuda.stream(side):
            t.fill_(1)
            int(t.sum().item())
        t.fill_(2)
        int(t.sum().item())
        n_copy = 64 * MIB
        pat = torch.arange(251, device=tdev, dtype=torch.uint8)
        src = pat.repeat(n_copy // 251 + 1)[:n_copy].contiguous()
        pinned_dst = torch.empty(n_copy, dtype=torch.uint8, pin_memory=True)
        pinned_dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(tdev)
        expect = np.tile(np.arange(251, dtype=np.uint8), n_copy // 251 + 1)[:n_copy]
        state.update(side=side, src=src, expect=expect, pinned_dst=pinned_dst)
        gb = 1024 * MIB

        def torch_empty_new_size():
            before = torch.cuda.memory_reserved(tdev)
            x = torch.empty(gb + 12345, dtype=torch.uint8, device=tdev)
            keep.append(x)
            return {"bytes": gb + 12345, "reserved_grew_bytes": torch.cuda.memory_reserved(tdev) - before}

        def torch_empty_then_kernel_other_stream():
            x = torch.empty(gb + 54321, dtype=torch.uint8, device=tdev)
            keep.append(x)
            with torch.cuda.stream(side):
                x[:4096].fill_(7)
                v = int(x[:4096].sum().item())
            return {"ok": v == 7 * 4096, "sum": v}

        def torch_kernel_default_stream():
            y = torch.empty(4096, dtype=torch.uint8, device=tdev)
            y.fill_(3)
            v = int(y.sum().item())
            return {"ok": v == 3 * 4096, "sum": v}

        def torch_first_use_kernel():
            z = torch.arange(1000, device=tdev, dtype=torch.int16).flip(0).cumsum(0, dtype=torch.int32)
            v = int(z[-1].item())
            return {"ok": v == 499500, "value": v, "what": "a torch kernel never launched before (lazy load)"}

        def torch_pinned_alloc():
            p = torch.empty(64 * MIB, dtype=torch.uint8, pin_memory=True)
            keep.append(p)
            return {"is_pinned": bool(p.is_pinned())}

        def pageable_cpu_copy():
            h = src.cpu()
            return {"ok": bool(np.array_equal(h.numpy(), expect)), "bytes": n_copy}

        def pinned_copy_non_blocking():
            pinned_dst.zero_()
            with torch.cuda.stream(side):
                pinned_dst.copy_(src, non_blocking=True)
                side.synchronize()
            return {"ok": bool(np.array_equal(pinned_dst.numpy(), expect))}

        def torch_graph_capture():
            a = torch.ones(1024, device=tdev)
            with torch.cuda.stream(side):
                gr = torch.cuda.CUDAGraph()
                gr.capture_begin(capture_error_mode="thread_local")
                b = a * 3
                gr.capture_end()
                gr.replay()
                side.synchronize()
                v = float(b.sum().item())
            keep.append(gr)
            return {"ok": v == 3 * 1024, "sum": v}

        def torch_free_empty_cache():
            keep.clear()
            torch.cuda.empty_cache()
            return {"reserved_after": torch.cuda.memory_reserved(tdev)}

        ops += [
            ("torch_empty_new_size", torch_empty_new_size),
            ("torch_empty_then_kernel_other_stream", torch_empty_then_kernel_other_stream),
            ("torch_kernel_default_stream", torch_kernel_default_stream),
            ("torch_first_use_kernel", torch_first_use_kernel),
            ("torch_pinned_alloc", torch_pinned_alloc),
            ("pageable_cpu_copy", pageable_cpu_copy),
            ("pinned_copy_non_blocking", pinned_copy_non_blocking),
            ("torch_graph_capture", torch_graph_capture),
            ("torch_free_empty_cache", torch_free_empty_cache),
        ]

    def cu_mem_host_alloc():
        p = Pinned(16 * MIB)
        keep.append(p)
        return {"ok": True}

    def cu_mem_alloc_free():
        p = int(call(driver.cuMemAlloc, 64 * MIB))
        call(driver.cuMemFree, p)
        return {"ok": True}

    def cu_module_load():
        mod = call(driver.cuModuleLoadData, P.groups["core"]["cubin"])
        fn = call(driver.cuModuleGetFunction, mod, b"rl_empty")
        if hasattr(driver, "cuFuncLoad"):
            call(driver.cuFuncLoad, fn)
        keep.append(mod)
        return {"ok": True}

    def cu_launch_other_stream():
        f = P.fn("rl_empty")
        s = P.work_stream
        dev.launch(f, [], s)
        return {"ok": dev.wait_stream(s, 2.0)}

    ops += [
        ("cuMemHostAlloc", cu_mem_host_alloc),
        ("cuMemAlloc_cuMemFree", cu_mem_alloc_free),
        ("cuModuleLoadData", cu_module_load),
        ("kernel_on_other_nonblocking_stream", cu_launch_other_stream),
    ]

    def cu_mem_free_host():
        n = 0
        for p in [k for k in keep if isinstance(k, Pinned)]:
            p.free()
            n += 1
        return {"freed": n}

    ops.append(("cuMemFreeHost", cu_mem_free_host))
    return ops


def _exit_test(P: Probe, mode: str) -> dict:
    B = P.B
    budget = B.child_budget_s
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--_exit-child",
        mode,
        "--device",
        str(P.args.device),
        "--arch",
        P.arch,
        "--_child-budget-s",
        str(budget),
    ]
    res: dict = {"mode": mode, "kernel_own_deadline_s": budget}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    lines: list = []
    errs: list = []
    launched = threading.Event()
    t_launch: list = []

    def rd_out():
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("EXIT_CHILD_LAUNCHED"):
                t_launch.append(time.monotonic())
                launched.set()

    def rd_err():
        for line in proc.stderr:
            errs.append(line.rstrip())

    th1 = threading.Thread(target=rd_out, daemon=True)
    th2 = threading.Thread(target=rd_err, daemon=True)
    th1.start()
    th2.start()

    def kill():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except Exception:
            pass
        try:
            proc.wait(10)
        except Exception:
            pass

    deadline = time.monotonic() + B.t(90)
    while not launched.is_set() and proc.poll() is None and time.monotonic() < deadline:
        launched.wait(0.05)
    if not launched.is_set():
        if proc.poll() is None:
            kill()
            res.update(status="timeout", where="child did not report its kernel running")
        else:
            res.update(status="error", error=f"child exited rc={proc.returncode} before launching")
        res["child_stdout"] = lines[-10:]
        res["child_stderr"] = errs[-15:]
        return res
    res["child_start_s"] = round(t_launch[0] - t0, 3)
    limit = budget + B.t(15)
    try:
        rc = proc.wait(timeout=limit)
        exit_s = time.monotonic() - t_launch[0]
        res["returncode"] = rc
        res["exit_s"] = round(exit_s, 3)
        if exit_s < 0.5 * budget:
            res["finding"] = "exits_promptly (context teardown ended the running kernel)"
        elif exit_s >= 0.8 * budget:
            res["finding"] = (
                "exit_waited_for_kernel (returned only when the kernel hit its own deadline: "
                "without one, exit hangs)"
            )
        else:
            res["finding"] = "slow_exit"
        res["status"] = "ok"
    except subprocess.TimeoutExpired:
        kill()
        res.update(status="timeout", finding="exit_hung (killed)", timeout_s=limit)
    th1.join(2)
    th2.join(2)
    res["child_stdout"] = lines[-10:]
    res["child_stderr"] = errs[-15:]
    return res


def probe_blocking(P: Probe) -> dict:
    dev, B = P.dev, P.B
    f = P.fn("rl_doorbell")
    torch = P.torch
    s = P.sched_stream
    out: dict = {
        "what": "a 1-thread persistent kernel polls on its own stream (cuStreamCreateWithPriority, "
        "CU_STREAM_NON_BLOCKING, highest priority); each operation runs in a thread with a "
        f"{B.op_timeout:.0f} s timeout; 'blocked' = still running at the timeout",
        "stream_priority": int(dev.prio_greatest),
        "torch": torch is not None,
        "ops": {},
        "exit": {},
        "table": [],
    }
    if torch is None:
        out["torch_error"] = P.torch_err
    try:
        ops = _blocking_ops(P, torch)
    except Exception as e:
        out["setup_error"] = errdict(e)
        ops = []
    kern: list = []  # [ctl] while running

    def start():
        ctl = dev.new_ctl("blocking probe")
        dev.launch(f, [PTR(ctl.dptr), U32(1000), U32(1), U32(1), U64(B.kernel_budget_ns)], s)
        if not wait_until(lambda: ctl.w[CTL_STARTED] == 1, B.t(20)):
            ctl.stop()
            raise Timeout("persistent kernel did not start")
        kern.append(ctl)
        return ctl

    for name, op in ops:
        if P.tainted:
            out["ops"][name] = {"status": "skipped", "reason": P.tainted}
            continue
        try:
            ctl = kern[0] if kern else start()
        except Exception as e:
            out["ops"][name] = errdict(e)
            break
        hb0 = int(ctl.w[CTL_HEARTBEAT])
        rec, th, box = run_in_thread(op, B.t(B.op_timeout), P.thread_init, name=f"op-{name}")
        time.sleep(0.005)
        rec["kernel_still_running"] = bool(int(ctl.w[CTL_EXIT]) == 0 and int(ctl.w[CTL_HEARTBEAT]) != hb0)
        if rec["status"] == "completed" and rec["elapsed_ms"] > 1000 * B.t(B.op_timeout):
            # it held the GIL while blocked, so the timeout could not fire; it returned
            # only when the kernel reached its own deadline
            rec["status"] = "blocked"
            rec["after_kernel_shutdown"] = "completed (held the GIL until the kernel's own deadline)"
        if rec["status"] == "blocked" and "after_kernel_shutdown" not in rec:
            P.stop_and_wait(ctl, s, f"blocking probe ({name})")
            kern.clear()
            th.join(B.t(15))
            rec["after_kernel_shutdown"] = (
                box.get("status", "still_blocked") if not th.is_alive() else "still_blocked"
            )
            if th.is_alive():
                P.taint(f"operation {name} stayed blocked after the kernel exited")
            elif "elapsed_ms" in box:
                rec["elapsed_ms_total"] = round(box["elapsed_ms"], 3)
        if kern and int(ctl.w[CTL_EXIT]) != 0:
            # the kernel ended by itself (its own deadline?): the next op starts a fresh one
            rec["kernel_exit"] = ctl.exit_reason
            dev.wait_stream(s, B.t(5))
            kern.clear()
        res_ok = (rec.get("result") or {}).get("ok") if isinstance(rec.get("result"), dict) else None
        if res_ok is False:
            rec["check"] = "FAILED"
        out["ops"][name] = rec
        note = rec["status"]
        if rec["status"] == "blocked":
            note += f" (after shutdown: {rec.get('after_kernel_shutdown')})"
        if res_ok is False:
            note += ", WRONG RESULT"
        out["table"].append([f"with kernel running: {name}", rec.get("elapsed_ms"), None, "ms", note])
    if kern:
        P.stop_and_wait(kern[0], s, "blocking probe")
        out["kernel_exit"] = kern[0].exit_reason
    for mode in B.exit_modes:
        if mode == "torch" and torch is None:
            out["exit"][mode] = {"status": "skipped", "reason": "torch unavailable"}
            continue
        r = sub(_exit_test, P, mode)
        out["exit"][mode] = r
        out["table"].append(
            [
                f"process exit, kernel running ({mode})",
                r.get("exit_s"),
                None,
                "s",
                r.get("finding") or r.get("status", ""),
            ]
        )
    statuses = [r.get("status") for r in out["ops"].values()] + [
        r.get("status") for r in out["exit"].values()
    ]
    out["status"] = (
        "ok" if all(st in ("completed", "blocked", "ok", "skipped") for st in statuses) else "partial"
    )
    return out


def exit_child(args) -> int:
    """Child of the exit test: start a persistent kernel and exit with it running."""
    global _NO_RESCUE
    _NO_RESCUE = True
    dev, why = try_init_device(args.device)
    if dev is None:
        print(f"EXIT_CHILD_ERROR {why}", flush=True)
        return 3
    if args._exit_child == "torch":
        import torch

        torch.cuda.set_device(args.device)
        t = torch.ones(1024, device=f"cuda:{args.device}")
        float(t.sum().item())
        dev.make_current()
    info = compile_group("core", args.arch or dev.arch)
    if not info["ok"]:
        print(f"EXIT_CHILD_ERROR compile: {info['error']}", flush=True)
        return 3
    mod = call(driver.cuModuleLoadData, info["cubin"])
    f = call(driver.cuModuleGetFunction, mod, b"rl_doorbell")
    s = dev.stream(high_priority=True)
    ctl = dev.new_ctl("exit child")
    budget = int(float(args._child_budget_s) * 1e9)
    dev.launch(f, [PTR(ctl.dptr), U32(1000), U32(1), U32(1), U64(budget)], s)
    if not wait_until(lambda: ctl.w[CTL_STARTED] == 1, 30):
        print("EXIT_CHILD_ERROR kernel did not start", flush=True)
        return 3
    print("EXIT_CHILD_LAUNCHED", flush=True)
    return 0  # the interpreter exits normally with the kernel still polling


# ----------------------------------------------------------------------------
# Probe 6: roofline ceilings


def probe_roofline(P: Probe) -> dict:
    torch = P.need_torch()
    P.require_clean()
    B = P.B
    tdev = torch.device("cuda", P.args.device)
    out: dict = {
        "what": "device-to-device copy (bytes read + written) and bf16 matmul through torch, "
        "timed with CUDA events after warm-up, random data",
        "table": [],
    }

    def copy_bw():
        free, _total = torch.cuda.mem_get_info(tdev)
        nbytes = B.copy_bytes
        while nbytes > 64 * MIB and 2.2 * nbytes > free:
            nbytes //= 2
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=tdev)
        dst = torch.empty_like(src)
        for _ in range(2):
            dst.copy_(src)
        times = []
        for _ in range(B.copy_reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        ok = bool(torch.equal(dst, src))
        del src, dst
        torch.cuda.empty_cache()
        ms = np.array(times)
        tbs = 2 * nbytes / (ms * 1e-3) / 1e12
        return {
            "bytes_per_buffer": nbytes,
            "ms": summarize(ms * 1e6),
            "tb_per_s_median": float(np.median(tbs)),
            "tb_per_s_best": float(tbs.max()),
            "check": {"ok": ok, "what": "dst == src after the copy"},
        }

    def matmul():
        n = B.mm_n
        gen = torch.Generator(device=tdev)
        gen.manual_seed(7)
        a = torch.randn(n, n, device=tdev, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(n, n, device=tdev, dtype=torch.bfloat16, generator=gen)
        c = torch.empty(n, n, device=tdev, dtype=torch.bfloat16)
        for _ in range(3):
            torch.matmul(a, b, out=c)
        times = []
        for _ in range(B.mm_reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.matmul(a, b, out=c)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        ref = a[:64].double().cpu() @ b[:, :64].double().cpu()
        got = c[:64, :64].double().cpu()
        rel = float((got - ref).norm() / ref.norm())
        del a, b, c
        torch.cuda.empty_cache()
        ms = np.array(times)
        tf = 2 * n**3 / (ms * 1e-3) / 1e12
        return {
            "n": n,
            "ms": summarize(ms * 1e6),
            "tflops_median": float(np.median(tf)),
            "tflops_best": float(tf.max()),
            "rel_err_vs_fp64_block": rel,
            "check": {"ok": rel < 2e-2, "what": "64x64 block vs float64 CPU"},
        }

    out["copy"] = cp = sub(copy_bw)
    out["matmul_bf16"] = mm = sub(matmul)
    out["table"].append(
        [
            "d2d copy bandwidth (read+write)",
            cp.get("tb_per_s_median"),
            None,
            "TB/s",
            f"{cp.get('bytes_per_buffer', 0) / GIB:.0f} GiB buffers; "
            + ("ok" if (cp.get("check") or {}).get("ok") else cp.get("status", "")),
        ]
    )
    out["table"].append(
        [
            f"bf16 matmul {B.mm_n}^3",
            mm.get("tflops_median"),
            None,
            "TFLOP/s",
            ("ok" if (mm.get("check") or {}).get("ok") else mm.get("status", ""))
            + (f" rel={mm['rel_err_vs_fp64_block']:.1e}" if "rel_err_vs_fp64_block" in mm else ""),
        ]
    )
    okc = (cp.get("check") or {}).get("ok") and (mm.get("check") or {}).get("ok")
    out["status"] = "ok" if okc else "partial"
    return out


# ----------------------------------------------------------------------------
# Probe 7: stream memory operations


def _memop_handoff(P: Probe, use_events: bool) -> dict:
    """Ping-pong between two streams through cuStreamWriteValue32/WaitValue32
    on device flags (or through events), stamped by tiny kernels."""
    dev, B = P.dev, P.B
    f = P.fn("rl_stamp")
    sa, sb, s = P.stream_a, P.stream_b, P.work_stream
    nb, bs = B.memop_batches, B.memop_batch
    n = nb * bs
    flags = dev.malloc(256)
    fa, fb = flags, flags + 128
    t_send = dev.malloc(8 * n)
    t_recv = dev.malloc(8 * n)
    go_ctl = dev.new_ctl("memops gate")
    go_ptr = go_ctl.word_dptr(CTL_DOORBELL)
    GEQ = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    WDEF = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    release = 0x7FFFFFF0
    rescue_stream = P.aux_stream

    def rescue():
        go_ctl.w[CTL_DOORBELL] = release
        call(driver.cuMemsetD32Async, flags, release, 64, rescue_stream)

    add_rescuer(rescue)
    events: list = []
    res: dict = {
        "iterations": n,
        "batches": nb,
        "gate_forced": 0,
        "mechanism": "events (cuEventRecord/cuStreamWaitEvent)"
        if use_events
        else "cuStreamWriteValue32 / cuStreamWaitValue32 (GEQ) on device flags",
    }
    try:
        dev.memset32(flags, 0, 64, s)
        dev.memset32(t_send, 0, 2 * n, s)
        dev.memset32(t_recv, 0, 2 * n, s)
        if not dev.wait_stream(s, B.t(10)):
            raise Timeout("memset")
        if use_events:
            flags_ev = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
            ev_a = [call(driver.cuEventCreate, flags_ev) for _ in range(bs)]
            ev_b = [call(driver.cuEventCreate, flags_ev) for _ in range(bs)]
            events = ev_a + ev_b
        use_gate = True
        for b in range(nb):
            gate = b + 1
            # both streams wait on a pinned host word until the whole batch is
            # enqueued, so the handoff runs at device speed, not enqueue speed
            if use_gate:
                try:
                    call(driver.cuStreamWaitValue32, sa, go_ptr, gate, GEQ)
                except CudaError as e:
                    use_gate = False
                    res["gate"] = f"waiting on a pinned host word failed, running ungated: {e}"
            if use_gate:
                call(driver.cuStreamWaitValue32, sb, go_ptr, gate, GEQ)
            # if enqueueing ever blocked (a full queue), open the gate anyway
            timer = threading.Timer(B.t(3.0), lambda g=gate: go_ctl.w.__setitem__(CTL_DOORBELL, g))
            timer.daemon = True
            timer.start()
            for j in range(bs):
                i = b * bs + j
                if use_events:
                    if j > 0:
                        call(driver.cuStreamWaitEvent, sa, ev_b[j - 1], 0)
                    dev.launch(f, [PTR(t_send), U32(i)], sa)
                    call(driver.cuEventRecord, ev_a[j], sa)
                    call(driver.cuStreamWaitEvent, sb, ev_a[j], 0)
                    dev.launch(f, [PTR(t_recv), U32(i)], sb)
                    call(driver.cuEventRecord, ev_b[j], sb)
                else:
                    call(driver.cuStreamWaitValue32, sa, fb, i, GEQ)
                    dev.launch(f, [PTR(t_send), U32(i)], sa)
                    call(driver.cuStreamWriteValue32, sa, fa, i + 1, WDEF)
                    call(driver.cuStreamWaitValue32, sb, fa, i + 1, GEQ)
                    dev.launch(f, [PTR(t_recv), U32(i)], sb)
                    call(driver.cuStreamWriteValue32, sb, fb, i + 1, WDEF)
            timer.cancel()
            if use_gate and int(go_ctl.w[CTL_DOORBELL]) >= gate:
                res["gate_forced"] += 1
            go_ctl.w[CTL_DOORBELL] = gate
            ok = dev.wait_stream(sa, B.t(10)) and dev.wait_stream(sb, B.t(10))
            if not ok:
                rescue()
                if not (dev.wait_stream(sa, B.t(5)) and dev.wait_stream(sb, B.t(5))):
                    P.taint("stream memory-op handoff did not drain after rescue")
                raise Timeout(f"handoff batch {b} did not finish")
        ts = dev.read_u64(t_send, n, s).astype(np.int64)
        tr = dev.read_u64(t_recv, n, s).astype(np.int64)
        fl = dev.read_u32(flags, 64, s) if not use_events else None
    finally:
        remove_rescuer(rescue)
        for ev in events:
            try:
                call(driver.cuEventDestroy, ev)
            except Exception:
                pass
        if not P.tainted:
            for p in (flags, t_send, t_recv):
                dev.free(p)
    a2b, b2a = [], []
    for b in range(1, nb):  # the first batch is warm-up
        for j in range(2, bs):
            i = b * bs + j
            a2b.append(tr[i] - ts[i])
            if j + 1 < bs:
                b2a.append(ts[i + 1] - tr[i])
    a2b_a, b2a_a = np.array(a2b), np.array(b2a)
    written = bool(np.all(ts > 0) and np.all(tr > 0))
    ordered = bool(np.all(a2b_a >= 0) and np.all(b2a_a >= 0)) if a2b_a.size else False
    ok = written and ordered
    if fl is not None:
        ok = ok and int(fl[0]) == n and int(fl[32]) == n
        res["final_flags"] = [int(fl[0]), int(fl[32])]
    res.update(
        {
            "a_to_b": summarize(a2b_a),
            "b_to_a": summarize(b2a_a),
            "one_way_both": summarize(np.concatenate([a2b_a, b2a_a])) if a2b_a.size else {"n": 0},
            "check": {"ok": ok, "stamps_written": written, "stamps_ordered": ordered},
            "status": "ok" if ok else "failed_check",
            "note": "one way = stamp kernel on A -> signal -> wait on B -> stamp kernel on B starts",
        }
    )
    return res


def _memop_capture(P: Probe) -> dict:
    dev, B = P.dev, P.B
    s = dev.stream()
    f = P.fn("rl_stamp")
    buf = dev.malloc(256)
    res: dict = {}
    G = Graphs()
    EQ = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
    try:
        dev.memset32(buf, 0, 64, s)
        if not dev.wait_stream(s, B.t(10)):
            raise Timeout("memset")
        call(driver.cuStreamBeginCapture, s, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        cap_err = None
        try:
            call(driver.cuStreamWriteValue32, s, buf, 42, 0)
            call(driver.cuStreamWaitValue32, s, buf, 42, EQ)
            dev.launch(f, [PTR(buf + 64), U32(0)], s)
        except Exception as e:
            cap_err = f"{type(e).__name__}: {e}"
        finally:
            r = driver.cuStreamEndCapture(s)
        if cap_err:
            res.update(
                status="ok",
                captured=False,
                capture_error=cap_err,
                end_capture="ok" if int(r[0]) == 0 else err_text(r[0]),
            )
            return res
        graph = check(r, "cuStreamEndCapture")
        G.graphs.append(graph)
        types = graph_node_types(graph)
        res["captured"] = True
        res["node_types"] = types
        res["mem_ops_became_nodes"] = any("MEM_OP" in t for t in types)
        ge = G.instantiate(graph)
        call(driver.cuGraphLaunch, ge, s)
        if not dev.wait_stream(s, B.t(10)):
            raise Timeout("captured graph did not finish")
        v = dev.read_u32(buf, 1, s)[0]
        st = dev.read_u64(buf + 64, 1, s)[0]
        res["captured_graph_runs"] = {
            "ok": int(v) == 42 and int(st) > 0,
            "flag": int(v),
            "stamp_written": int(st) > 0,
        }

        # can such a graph sit inside a WHILE body (as a child graph)?
        def in_while():
            fw = P.fn("rl_while_body")
            state = dev.malloc(256)
            stamps = dev.malloc(64)
            try:
                outer = G.create()
                h = cond_handle(outer, dev.ctx, 1, True)
                _, (wb,) = add_cond_node(
                    outer, [], dev.ctx, h, driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE, 1
                )
                child = call(driver.cuGraphAddChildGraphNode, wb, [], 0, graph)
                add_kernel_node(wb, [child], fw, [U64(int(h)), PTR(state), PTR(stamps), U32(8)])
                ge2 = G.instantiate(outer)
                dev.memset32(buf, 0, 1, s)
                ms, cnt = _run_counted_graph(P, ge2, state, 3, s)
                return {"ok": cnt == 3, "count": cnt, "status": "ok"}
            finally:
                if not P.tainted:
                    dev.free(state)
                    dev.free(stamps)

        res["mem_op_graph_in_while_body"] = sub(in_while)
        res["status"] = "ok"
        return res
    finally:
        G.destroy()
        if not P.tainted:
            dev.free(buf)


def probe_memops(P: Probe) -> dict:
    out: dict = {
        "what": "stream memory operations as a cross-stream handoff, and whether stream capture "
        "records them as graph nodes",
        "table": [],
    }
    out["handoff_memops"] = hm = sub(_memop_handoff, P, False)
    out["handoff_events"] = he = sub(_memop_handoff, P, True)
    out["capture"] = cap = sub(_memop_capture, P)
    out["table"].append(
        trow("write->wait handoff one-way (memops)", hm.get("one_way_both"), note=hm.get("status", ""))
    )
    out["table"].append(
        trow("record->wait handoff one-way (events)", he.get("one_way_both"), note=he.get("status", ""))
    )
    note = cap.get("status", "")
    if "node_types" in cap:
        note = "nodes: " + ",".join(t.replace("CU_GRAPH_NODE_TYPE_", "") for t in cap["node_types"])
        runs = (cap.get("captured_graph_runs") or {}).get("ok")
        note += f"; runs={'yes' if runs else 'NO'}"
        wb = cap.get("mem_op_graph_in_while_body") or {}
        note += f"; in WHILE body: {'yes' if wb.get('ok') else wb.get('status')}"
    elif cap.get("capture_error"):
        note = "capture failed: " + cap["capture_error"][:60]
    out["table"].append(["capture of write/wait value", None, None, "", note])
    out["status"] = "ok" if all(r.get("status") == "ok" for r in (hm, he, cap)) else "partial"
    return out


PROBE_FUNCS = {
    1: probe_doorbell,
    2: probe_handoff,
    3: probe_launch,
    4: probe_torchgraph,
    5: probe_blocking,
    6: probe_roofline,
    7: probe_memops,
}


# ----------------------------------------------------------------------------
# Output


class Tee:
    """stdout/stderr copy into the log file (buffered until it is opened)."""

    def __init__(self, stream, shared: dict):
        self.stream = stream
        self.shared = shared

    def write(self, s: str) -> int:
        with self.shared["lock"]:
            self.stream.write(s)
            fh = self.shared.get("fh")
            if fh is not None:
                fh.write(s)
            else:
                self.shared["buf"].append(s)
            if "\n" in s:
                self.stream.flush()
                if fh is not None:
                    fh.flush()
        return len(s)

    def flush(self) -> None:
        self.stream.flush()
        fh = self.shared.get("fh")
        if fh is not None:
            fh.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()


_TEE: dict = {"lock": threading.RLock(), "buf": [], "fh": None}


def install_tee() -> None:
    if not isinstance(sys.stdout, Tee):
        sys.stdout = Tee(sys.stdout, _TEE)
        sys.stderr = Tee(sys.stderr, _TEE)


def open_log(path: Path) -> None:
    with _TEE["lock"]:
        fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 - the tee keeps it open for the run
        fh.write("".join(_TEE["buf"]))
        _TEE["buf"].clear()
        _TEE["fh"] = fh


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (bytes, bytearray)):
        return f"<{len(o)} bytes>"
    if hasattr(o, "name") and hasattr(o, "value"):
        return o.name
    return str(o)


def save_json(path: Path | None, results: dict) -> None:
    if path is None:
        return
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=_json_default))
    os.replace(tmp, path)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x:
            return "nan"
        if abs(x) >= 1000:
            return f"{x:.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.3f}" if abs(x) < 1 else f"{x:.2f}"
    return str(x)


def print_table(results: dict) -> None:
    rows = []
    for key, pr in sorted(results["probes"].items(), key=lambda kv: int(kv[0].split("_", 1)[0])):
        num = key.split("_", 1)[0]
        tbl = pr.get("table") or []
        for r in tbl:
            rows.append([num, r[0], _fmt(r[1]), _fmt(r[2]), r[3], r[4]])
        if not tbl or pr.get("status") not in ("ok", "partial"):
            why = pr.get("error") or pr.get("reason") or pr.get("where") or ""
            rows.append(
                [
                    num,
                    f"[{PROBE_NAMES.get(int(num), key)}]",
                    "-",
                    "-",
                    "",
                    f"{pr.get('status')} {why}".strip()[:100],
                ]
            )
    hdr = ["#", "measurement", "median", "p99", "unit", "check / notes"]
    w = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(5)]
    print()
    print("  ".join(h.ljust(w[i]) if i < 5 else h for i, h in enumerate(hdr)))
    print("  ".join("-" * w[i] for i in range(5)) + "  " + "-" * 13)
    for r in rows:
        print(
            "  ".join(
                (str(r[i]).rjust(w[i]) if i in (2, 3) else str(r[i]).ljust(w[i])) if i < 5 else str(r[i])
                for i in range(6)
            )
        )


# ----------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--only", default="", help="comma-separated probe numbers (1-7) to run")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="compile every kernel with NVRTC (sm_90 unless --arch), print resources, exit",
    )
    ap.add_argument("--arch", default=None, help="override the target arch, e.g. sm_90")
    ap.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    ap.add_argument("--out-dir", default=str(DEFAULT_OUT), help="where the JSON and log go")
    ap.add_argument("--no-save", action="store_true", help="print only; write no files")
    ap.add_argument(
        "--max-seconds", type=float, default=None, help="whole-run watchdog (default 330, quick 240)"
    )
    ap.add_argument("--_exit-child", dest="_exit_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_child-budget-s", dest="_child_budget_s", default="10", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sel = set()
    for part in [p for p in args.only.replace(" ", "").split(",") if p]:
        if "-" in part:
            a, b = part.split("-", 1)
            sel.update(range(int(a), int(b) + 1))
        else:
            sel.add(int(part))
    bad = sel - set(PROBE_NAMES)
    if bad:
        ap.error(f"unknown probe number(s) {sorted(bad)}; probes are {sorted(PROBE_NAMES)}")
    args.selected = [n for n in RUN_ORDER if n in sel] if sel else list(RUN_ORDER)
    return args


def _versions() -> dict:
    v = {"python": platform.python_version(), "numpy": np.__version__, "nvrtc": nvrtc_version()}
    try:
        from cuda.bindings import __version__ as cbv

        v["cuda_bindings"] = cbv
    except Exception:
        try:
            import cuda  # noqa: F401

            v["cuda_bindings"] = getattr(sys.modules.get("cuda"), "__version__", "unknown")
        except Exception:
            v["cuda_bindings"] = "unknown"
    return v


def _git_rev() -> str | None:
    try:
        r = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return r.stdout.strip() or None
    except Exception:
        return None


def run_compile_only(arch: str, reason: str | None) -> int:
    groups = compile_all(arch)
    summary = compile_summary(groups, arch)
    print_kernel_table(summary)
    for g in groups.values():
        if g["error"]:
            print(f"\n--- NVRTC log for group {g['group']} ---\n{g['log'] or g['error']}")
    line = {k: v for k, v in summary.items() if k != "groups"}
    line["groups"] = {g: {"ok": v["ok"], "error": v["error"]} for g, v in summary["groups"].items()}
    print(f"{COMPILE_TAG} " + json.dumps(line, default=_json_default), flush=True)
    n, m = summary["n_compiled"], summary["n_expected"]
    if reason is not None:
        print(f"no CUDA device: compiled {n} kernels for {arch}; measurements need an H100/H200 ({reason})")
    else:
        print(f"compile-only: compiled {n} of {m} kernels for {arch}; no measurements run")
    return 0 if summary["ok"] else 1


def init_torch(ordinal: int, dev: Dev):
    try:
        import torch
    except Exception as e:
        return None, f"import torch failed: {e}"
    try:
        if not torch.cuda.is_available():
            return None, f"torch {torch.__version__}: torch.cuda.is_available() is False"
        torch.cuda.set_device(ordinal)
        tdev = torch.device("cuda", ordinal)
        a = torch.randn(256, 256, device=tdev)
        float((a @ a).sum().item())
        torch.cuda.synchronize(tdev)
        dev.make_current()
        cur = call(driver.cuCtxGetCurrent)
        if int(cur) != int(dev.ctx):
            return None, "torch is not on the device's primary context"
        return torch, None
    except Exception as e:
        return None, f"torch CUDA init failed: {type(e).__name__}: {e}"


def health_check(P: Probe) -> str | None:
    """A sticky error (trap, illegal address) shows on any stream call."""
    try:
        s = P.work_stream
        buf = P.dev.malloc(256)
        P.dev.memset32(buf, 1, 4, s)
        ok = P.dev.wait_stream(s, 10)
        v = P.dev.read_u32(buf, 1, s)[0] if ok else None
        P.dev.free(buf)
        if not ok:
            return "health check: a memset did not finish"
        if int(v) != 1:
            return f"health check: memset readback {v}"
        return None
    except Exception as e:
        return f"health check: {type(e).__name__}: {e}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._exit_child:
        return exit_child(args)
    install_tee()
    t_start = time.monotonic()
    print(
        f"gpu_limits: {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} "
        f"python {platform.python_version()} nvrtc {nvrtc_version()}",
        flush=True,
    )
    if args.compile_only:
        return run_compile_only(args.arch or "sm_90", None)
    dev, why = try_init_device(args.device)
    if dev is None:
        return run_compile_only(args.arch or "sm_90", why)

    scale = float(os.environ.get("GPU_LIMITS_TIMEOUT_SCALE", "1") or 1)
    B = Budget(args.quick, scale)
    arch = args.arch or dev.arch
    print(
        f"device {args.device}: {dev.name} (cc {dev.props['compute_capability']}, "
        f"{dev.props['multiprocessors']} SMs), driver {dev.driver_version}, arch {arch}",
        flush=True,
    )
    slug = device_slug(dev.name)
    date = _dt.date.today().isoformat()
    suffix = ("-quick" if args.quick else "") + (
        "-only-" + "-".join(map(str, sorted(args.selected))) if len(args.selected) < len(PROBE_NAMES) else ""
    )
    json_path = log_path = None
    if not args.no_save:
        outdir = Path(args.out_dir)
        outdir.mkdir(parents=True, exist_ok=True)
        base = f"{date}-{slug}-gpu-limits{suffix}"
        json_path = outdir / f"{base}.json"
        log_path = outdir / f"{base}.log"
        open_log(log_path)
        print(f"writing {json_path} and {log_path.name}", flush=True)

    results: dict = {
        "schema": SCHEMA,
        "meta": {
            "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "device": dev.props,
            "device_slug": slug,
            "arch": arch,
            "versions": _versions(),
            "git": _git_rev(),
            "argv": sys.argv[1:],
            "quick": args.quick,
            "selected": args.selected,
            "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        },
        "kernels": {},
        "probes": {},
    }
    # watchdogs: a clean one that saves what there is, and faulthandler behind it
    max_s = args.max_seconds or B.total_s
    current = {"probe": None}
    done_evt = threading.Event()

    def on_watchdog():
        if done_evt.wait(max_s):
            return
        print(
            f"\n!! WATCHDOG: run exceeded {max_s:.0f} s during probe {current['probe']}; shutting down",
            flush=True,
        )
        shutdown_all()
        results["watchdog"] = {"fired_after_s": max_s, "probe": current["probe"]}
        if current["probe"]:
            key = current["probe"]
            results["probes"].setdefault(key, {"status": "timeout", "where": "whole-run watchdog"})
        try:
            print_table(results)
            save_json(json_path, results)
        finally:
            sys.stdout.flush()
            os._exit(2)

    threading.Thread(target=on_watchdog, daemon=True, name="watchdog").start()
    faulthandler.dump_traceback_later(max_s + 60, exit=True)
    atexit.register(shutdown_all)

    def _on_signal(signum, _frame):
        shutdown_all()
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(sig, _on_signal)
        except Exception:
            pass

    groups = compile_all(arch)
    summary = compile_summary(groups, arch)
    torch_mod, torch_err = (None, "not needed by the selected probes")
    if TORCH_PROBES & set(args.selected):
        torch_mod, torch_err = init_torch(args.device, dev)
        print(f"torch: {torch_mod.__version__ if torch_mod else torch_err}", flush=True)
        if torch_mod is not None:
            results["meta"]["versions"]["torch"] = torch_mod.__version__
    P = Probe(dev, args, B, groups, torch_mod, torch_err)
    P.load_modules()
    for k, a in P.func_attrs.items():
        summary["kernels"].setdefault(k, {})["driver_attributes"] = a
    for k, e in P.func_err.items():
        summary["kernels"].setdefault(k, {})["load_error"] = e
    results["kernels"] = summary
    print_kernel_table(summary, P.func_attrs)
    for k, e in P.func_err.items():
        print(f"  {k}: {e.splitlines()[0][:160]}")
    save_json(json_path, results)

    for num in args.selected:
        key = f"{num}_{PROBE_NAMES[num]}"
        current["probe"] = key
        print(f"\n== probe {num} {PROBE_NAMES[num]} ==", flush=True)
        if P.context_dead:
            results["probes"][key] = {"status": "skipped", "reason": f"context unusable: {P.context_dead}"}
            print(f"  skipped: {P.context_dead}")
            continue
        t0 = time.monotonic()
        timeout = B.t(B.probe_timeout[num])
        rec, th, box = run_in_thread(
            lambda n=num: PROBE_FUNCS[n](P), timeout, P.thread_init, name=f"probe{num}"
        )
        if rec["status"] == "blocked":
            shutdown_all()
            th.join(B.t(10))
            res = {"status": "timeout", "timeout_s": timeout, "finished_after_shutdown": not th.is_alive()}
            if th.is_alive():
                P.taint(f"probe {num} thread stuck after timeout")
            elif isinstance(box.get("value"), dict):
                res["late_result"] = box["value"]
        elif rec["status"] == "error":
            res = {"status": "error", "error": rec.get("error"), "traceback": rec.get("traceback")}
            if str(rec.get("error", "")).startswith("SkipProbe"):
                res = {"status": "skipped", "reason": rec["error"].split(": ", 1)[-1]}
        else:
            res = rec.get("result") or {"status": "error", "error": "probe returned nothing"}
        res["elapsed_s"] = round(time.monotonic() - t0, 2)
        results["probes"][key] = res
        print(
            f"  -> {res.get('status')} in {res['elapsed_s']} s"
            + (
                f": {res.get('error') or res.get('reason')}"
                if res.get("status") in ("error", "skipped")
                else ""
            ),
            flush=True,
        )
        for r in res.get("table") or []:
            print(f"     {r[0]}: {_fmt(r[1])} / p99 {_fmt(r[2])} {r[3]}  {r[4]}")
        if not P.tainted:
            bad = health_check(P)
            if bad:
                P.context_dead = bad
                results["context_dead"] = bad
                print(f"  !! {bad}; remaining probes are skipped", flush=True)
        save_json(json_path, results)

    current["probe"] = None
    results["meta"]["tainted"] = P.tainted
    results["meta"]["elapsed_s"] = round(time.monotonic() - t_start, 1)
    print_table(results)
    print(f"\ntotal {results['meta']['elapsed_s']} s" + (f"; TAINTED: {P.tainted}" if P.tainted else ""))
    if json_path:
        print(f"results: {json_path}\nlog:     {log_path}")
    save_json(json_path, results)
    done_evt.set()
    faulthandler.cancel_dump_traceback_later()
    shutdown_all()
    sys.stdout.flush()
    if P.tainted:
        # a kernel may still run: do not risk the exit path waiting on it
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
