"""Builds the one scheduler source for its two targets.

CPU: the host C++ compiler makes a shared library (cached by content hash, so an edit rebuilds).
CUDA: NVRTC makes a CUBIN for the device's own arch; no GPU is needed to compile.
Both get the same text: the layout header from ipc, then SCHEDULER_SOURCES, then an entry.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from ipc import layout
from ipc.native import load_library

_HERE = Path(__file__).resolve().parent
KERNEL_NAME = "rl_scheduler_persistent"


# The scheduler's one source, in include order (each file relies on the ones before it).
SCHEDULER_SOURCES = ("primitives.h", "sched_common.h", "sched_critical.h", "sched_overlapped.h", "sched_step.h")


def scheduler_source(entry: str) -> str:
    """entry: "cpu_entry.cpp" or "kernel.cu"."""
    parts = [layout.c_header()]
    for name in (*SCHEDULER_SOURCES, entry):
        parts.append(f"// ---- {name}\n" + (_HERE / name).read_text())
    return "\n".join(parts)


HOST_ACCESS_KINDS = ("acquire_loads", "release_stores", "system_fences", "loads", "stores")


class CpuScheduler:
    """The host-compiled scheduler, called through ctypes (the GIL is released during a call).

    step() runs both phases serially; critical() and overlapped() run one each, for a caller
    that overlaps the model step with the second.  host_accesses() counts, per calling thread,
    every access the scheduler made to host-shared memory since reset_host_accesses()."""

    def __init__(self):
        lib = load_library("rlsched", scheduler_source("cpu_entry.cpp"))
        lib.rl_layout_fingerprint.restype = ctypes.c_uint64
        for name in ("rl_sched_init", "rl_sched_step", "rl_sched_critical"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_uint32
        lib.rl_sched_overlapped.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        lib.rl_sched_overlapped.restype = ctypes.c_uint32
        lib.rl_host_access_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        lib.rl_host_access_counts.restype = None
        lib.rl_host_access_reset.restype = None
        if lib.rl_layout_fingerprint() != layout.fingerprint():
            raise RuntimeError("scheduler library was built for another layout")
        self._lib = lib

    def init(self, context_address: int) -> int:
        return self._lib.rl_sched_init(context_address)

    def step(self, context_address: int) -> int:
        return self._lib.rl_sched_step(context_address)

    def critical(self, context_address: int) -> int:
        return self._lib.rl_sched_critical(context_address)

    def overlapped(self, context_address: int, step_built: bool) -> int:
        return self._lib.rl_sched_overlapped(context_address, 1 if step_built else 0)

    def host_accesses(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * len(HOST_ACCESS_KINDS))()
        self._lib.rl_host_access_counts(out)
        return dict(zip(HOST_ACCESS_KINDS, (int(v) for v in out)))

    def reset_host_accesses(self) -> None:
        self._lib.rl_host_access_reset()


@functools.cache
def cpu_scheduler() -> CpuScheduler:
    """The process's one CpuScheduler (its library loads once; it holds no per-ring state)."""
    return CpuScheduler()


KERNELS = (KERNEL_NAME, "rl_step_wait", "rl_step_begin", "rl_step_signal")


@dataclass
class KernelResources:
    registers: int | None
    shared_bytes: int | None
    spill_bytes: int | None
    stack_bytes: int | None


@dataclass
class KernelBuild:
    arch: str
    cubin: bytes
    log: str
    resources: dict[str, KernelResources]  # per entry function, from ptxas -v
    ptx: bytes = b""  # the same program as PTX, for a driver that refuses the CUBIN
    nvrtc_version: tuple[int, int] = (0, 0)

    @property
    def ptx_isa(self) -> str | None:
        m = re.search(rb"^\.version\s+(\d+\.\d+)", self.ptx, re.M)
        return m.group(1).decode() if m else None

    def __getattr__(self, name):  # registers, shared_bytes, ... of the scheduler kernel
        if name in KernelResources.__dataclass_fields__:
            return getattr(self.resources[KERNEL_NAME], name)
        raise AttributeError(name)


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    out = {}
    for block in log.split("Compiling entry function '")[1:]:
        name = block.split("'", 1)[0]

        def grab(pattern, block=block):
            m = re.search(pattern, block)
            return int(m.group(1)) if m else None

        out[name] = KernelResources(
            grab(r"Used (\d+) registers"),
            grab(r"(\d+) bytes smem") or 0,
            grab(r"(\d+) bytes spill stores"),
            grab(r"(\d+) bytes stack frame"),
        )
    return out


def _check(result, what: str):
    from cuda.bindings import nvrtc

    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return result[1] if len(result) == 2 else result[1:]


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def ptx_loadable(nvrtc: tuple[int, int], driver: tuple[int, int]) -> tuple[bool, str]:
    """Whether a driver can JIT the PTX this NVRTC wrote: PTX from CUDA X.Y needs a driver of
    CUDA X.Y or newer (a newer PTX ISA ends in CUDA_ERROR_UNSUPPORTED_PTX_VERSION)."""
    n, d = "%d.%d" % nvrtc, "%d.%d" % driver
    if tuple(nvrtc) <= tuple(driver):
        return True, f"PTX from NVRTC {n} is no newer than the driver's CUDA {d}"
    return False, (
        f"PTX from NVRTC {n} is newer than the driver's CUDA {d} accepts; install "
        f"an NVRTC of CUDA {d} or older (cuda-toolkit[nvrtc]=={driver[0]}.{driver[1]}.*) "
        f"or a newer driver"
    )


def compile_kernel(arch: str = "sm_90", threads: int = 256) -> KernelBuild:
    """Compile the persistent scheduler kernel with NVRTC; ptxas -v gives resource usage."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "NVRTC needs cuda-bindings and the CUDA 13 NVRTC: pip install 'ringleader[nvrtc]'"
        ) from exc
    src = scheduler_source("kernel.cu").replace(
        "#define RL_MAX_THREADS 1024", f"#define RL_MAX_THREADS {threads}"
    )
    prog = _check(nvrtc.nvrtcCreateProgram(src.encode(), b"rl_scheduler.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-default-device", b"--ptxas-options=-v"]
    compiled = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    log = buf.decode(errors="replace").rstrip("\x00 ")
    if compiled[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC could not compile the scheduler for {arch}:\n{log}")
    n = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    cubin = b" " * n
    _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    n = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
    ptx = b" " * n
    _check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    nvrtc.nvrtcDestroyProgram(prog)
    return KernelBuild(
        arch, cubin, log, parse_ptxas_log(log), ptx.rstrip(b"\x00 ") + b"\x00", nvrtc_version()
    )
