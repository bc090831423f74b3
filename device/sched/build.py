"""Builds the one scheduler source for its two targets.

CPU: the host C++ compiler makes a shared library (cached by content hash, so an edit rebuilds).
CUDA: NVRTC makes a CUBIN for the device's own arch; no GPU is needed to compile.
Both get the same text: the layout header from ipc, then SCHEDULER_SOURCES, then an entry.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ringleader.ipc import layout
from ringleader.ipc.install_hint import install_hint
from ringleader.ipc.native import load_library

_HERE = Path(__file__).resolve().parent
KERNEL_NAME = "rl_scheduler_persistent"


# The scheduler's one source, in include order (each file relies on the ones before it).
SCHEDULER_SOURCES = (
    "primitives.h",
    "sched_common.h",
    "sched_prefix.h",
    "sched_grammar.h",
    "sched_spec.h",
    "sched_critical.h",
    "sched_overlapped.h",
    "sched_step.h",
    "sched_loop.h",
)


def scheduler_source(entry: str) -> str:
    """entry: "cpu_entry.cpp" or "kernel.cu"."""
    parts = [layout.c_header()]
    for name in (*SCHEDULER_SOURCES, entry):
        parts.append(f"// ---- {name}\n" + (_HERE / name).read_text())
    return "\n".join(parts)


# The launch graphs' nodes: kernel.cu's kernels, and the CPU build's exports of the same names
# and parameters after the context (by value there, by address here).  "handle" is a WHILE or
# SWITCH handle: on the CPU the address of a uint32 word the node sets.
GRAPH_NODES: dict[str, tuple[str, ...]] = {
    "rl_step_wait": ("handle", "handle", "u32"),
    "rl_step_begin": (),
    "rl_step_signal": (),
    "rl_host_step_begin": (),
    "rl_host_step_end": (),
    "rl_plan_wait": ("handle", "handle", "u32"),
    "rl_step_gate": ("u32",),
    "rl_signal_pingpong": ("u32",),
}
NODES_RETURNING = {"rl_step_gate"}  # on the CPU: what the gate saw (Turn.COMPUTE or EXIT)
_NODE_CTYPES = {"handle": ctypes.c_uint64, "u32": ctypes.c_uint32}

HOST_ACCESS_KINDS = ("acquire_loads", "release_stores", "system_fences", "loads", "stores")


class CpuScheduler:
    """The host-compiled scheduler, called through ctypes (the GIL is released during a call).

    step() runs both phases serially; critical() and overlapped() run one each, for a caller
    that overlaps the model step with the second; persistent() runs the kernel's own loop, and
    node() any launch graph node (GRAPH_NODES), as its kernel runs.  host_accesses() counts, per calling thread,
    every access the scheduler made to host-shared memory since reset_host_accesses()."""

    def __init__(self):
        lib = load_library("rlsched", scheduler_source("cpu_entry.cpp"))
        lib.rl_layout_fingerprint.restype = ctypes.c_uint64
        for name in ("rl_sched_init", "rl_sched_step", "rl_sched_critical"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_uint32
        lib.rl_prefix_page_key.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p]
        lib.rl_prefix_page_key.restype = ctypes.c_uint64
        lib.rl_sched_overlapped.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        lib.rl_sched_overlapped.restype = ctypes.c_uint32
        lib.rl_host_access_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        lib.rl_host_access_counts.restype = None
        lib.rl_host_access_reset.restype = None
        lib.rl_block_barrier_count.restype = ctypes.c_uint64
        lib.rl_hand_over_path_bins.restype = ctypes.c_uint32
        lib.rl_hand_over_path_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        lib.rl_hand_over_path_counts.restype = None
        lib.rl_hand_over_path_reset.restype = None
        lib.rl_sched_persistent.argtypes = [ctypes.c_void_p]
        lib.rl_sched_persistent.restype = None
        for name, params in GRAPH_NODES.items():
            getattr(lib, name).argtypes = [ctypes.c_void_p] + [_NODE_CTYPES[p] for p in params]
            getattr(lib, name).restype = ctypes.c_uint32 if name in NODES_RETURNING else None
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

    def persistent(self, context_address: int) -> None:
        """The kernel's whole loop on this thread (init included); returns when it exits."""
        self._lib.rl_sched_persistent(context_address)

    def node(self, name: str, context_address: int, *args: int) -> int | None:
        """Launch-graph node `name` (GRAPH_NODES) on this thread, as its kernel runs on a GPU;
        a conditional handle is the address of a uint32 word, which the node sets."""
        if name not in GRAPH_NODES:
            raise ValueError(f"{name!r} is not a launch graph node ({', '.join(GRAPH_NODES)})")
        return getattr(self._lib, name)(context_address, *args)

    def _branch_node(self, name: str, context_address: int, last: int) -> int:
        """A wait node with a SWITCH and a WHILE handle: the branch it picked (n_buckets: none,
        the loop ends)."""
        words = (ctypes.c_uint32 * 2)(0xFFFFFFFF, 1)  # SWITCH: unset; WHILE: running
        base = ctypes.addressof(words)
        self.node(name, context_address, base, base + 4, last)
        if words[0] == 0xFFFFFFFF:
            raise AssertionError(f"{name} returned without setting its SWITCH")
        return words[0]

    def step_wait(self, context_address: int) -> int:
        """The resident graph's wait: the SWITCH branch of the step handed over, or n_buckets
        (no branch) when the loop ends."""
        return self._branch_node("rl_step_wait", context_address, 1)

    def step_begin(self, context_address: int) -> None:
        self.node("rl_step_begin", context_address)

    def step_signal(self, context_address: int) -> None:
        self.node("rl_step_signal", context_address)

    def plan_wait(self, context_address: int, parity: int) -> int:
        """Ping-pong graph `parity`'s first node: the SWITCH branch of its next step's planned
        bucket, or n_buckets when the loop ends."""
        return self._branch_node("rl_plan_wait", context_address, parity)

    def step_gate(self, context_address: int, parity: int) -> int:
        """The branch's gate: Turn.COMPUTE once graph `parity`'s step is handed over (its start
        stamped), or Turn.EXIT."""
        return self.node("rl_step_gate", context_address, parity)

    def signal_pingpong(self, context_address: int, parity: int) -> None:
        self.node("rl_signal_pingpong", context_address, parity)

    def host_step_stamp(self, context_address: int, end: bool) -> None:
        """The host-scheduled graph's stamp kernels (rl_host_step_begin/end), on the CPU."""
        self.node("rl_host_step_end" if end else "rl_host_step_begin", context_address)

    def page_key(self, config_address: int, parent: int, tokens_address: int) -> int:
        """rl_page_key: the key of the page_size int32 tokens at tokens_address under the
        RlConfig at config_address, whose parent page's key is `parent`."""
        return self._lib.rl_prefix_page_key(config_address, parent, tokens_address)

    def host_accesses(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * len(HOST_ACCESS_KINDS))()
        self._lib.rl_host_access_counts(out)
        return dict(zip(HOST_ACCESS_KINDS, (int(v) for v in out)))

    def reset_host_accesses(self) -> None:
        self._lib.rl_host_access_reset()

    def block_barriers(self) -> int:
        """The block barriers (RL_SYNC, rl_block_any) this thread passed in the scheduler so far:
        on a GPU each is a __syncthreads of the block."""
        return self._lib.rl_block_barrier_count()

    def hand_over_paths(self) -> list[int]:
        """The persistent loop's hand-overs so far, by how many block barriers lay between the
        turn coming back and the step going out (index i: i barriers; the last: that many or
        more)."""
        out = (ctypes.c_uint64 * self._lib.rl_hand_over_path_bins())()
        self._lib.rl_hand_over_path_counts(out)
        return [int(v) for v in out]

    def reset_hand_over_paths(self) -> None:
        self._lib.rl_hand_over_path_reset()


@functools.cache
def cpu_scheduler() -> CpuScheduler:
    """The process's one CpuScheduler (its library loads once; it holds no per-ring state)."""
    return CpuScheduler()


KERNELS = (KERNEL_NAME, *GRAPH_NODES)


@dataclass
class KernelResources:
    """One entry function's resource use, as ptxas -v reports it (None: not in the log)."""

    registers: int | None
    shared_bytes: int | None
    spill_bytes: int | None  # spill stores
    stack_bytes: int | None  # stack frame
    spill_load_bytes: int | None = None
    cmem0_bytes: int | None = None  # constant bank 0 (kernel parameters and the like)


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


_PTXAS_NUMBERS = (
    ("stack_bytes", re.compile(r"(\d+) bytes stack frame")),
    ("spill_bytes", re.compile(r"(\d+) bytes spill stores")),
    ("spill_load_bytes", re.compile(r"(\d+) bytes spill loads")),
    ("registers", re.compile(r"Used (\d+) registers")),
    ("shared_bytes", re.compile(r"(\d+) bytes smem")),
    ("cmem0_bytes", re.compile(r"(\d+) bytes cmem\[0\]")),
)


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """Per entry function resource use from an NVRTC --ptxas-options=-v log.

    A line belongs to the entry function last named by "Compiling entry function" or by
    "Function properties for"; the properties of a device (non-entry) function are skipped.
    shared_bytes is 0 when the log names no smem; any other number missing is None."""
    out: dict[str, KernelResources] = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = m.group(1)
            out.setdefault(cur, KernelResources(None, 0, None, None))
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            cur = m.group(1) if m.group(1) in out else None
            continue
        if cur is None:
            continue
        for field, pattern in _PTXAS_NUMBERS:
            m = pattern.search(line)
            if m:
                setattr(out[cur], field, int(m.group(1)))
    return out


class NvrtcError(RuntimeError):
    """An NVRTC step failed. result: the nvrtcResult's name (e.g. "NVRTC_ERROR_INVALID_OPTION",
    an option this NVRTC does not know); log: the program log ("" when there is none)."""

    def __init__(self, headline: str, *, result: str, log: str = ""):
        super().__init__(f"{headline}: {result}" + (f"\n{log}" if log else ""))
        self.headline, self.result, self.log = headline, result, log


# A libnvrtc to compile with instead of the one cuda-bindings would find (the GPU image's older
# release in CI, a system CUDA on an edge box); read once, at the process's first NVRTC call.
NVRTC_ENV = "RINGLEADER_NVRTC"


def _preload_nvrtc(path: Path) -> None:
    """Load `path` (and the builtins beside it) before cuda-bindings looks for NVRTC: it takes
    a libnvrtc already in the process before searching anywhere else."""
    if not path.is_file():
        raise RuntimeError(f"${NVRTC_ENV}={path}: no such file")
    for builtins in sorted(path.parent.glob("libnvrtc-builtins.so.*")):
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def nvrtc_library() -> str | None:
    """The path of the libnvrtc this process compiles with (None: not known)."""
    _nvrtc()
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception:
        return None


@functools.cache
def _nvrtc():
    chosen = os.environ.get(NVRTC_ENV)
    if chosen:
        _preload_nvrtc(Path(chosen))
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc  # type: ignore[no-redef]  # cuda-python < 12.6 layout
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                f"NVRTC needs cuda-bindings and the CUDA 13 NVRTC: {install_hint('nvrtc')}"
            ) from exc
    if chosen:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        used = load_nvidia_dynamic_lib("nvrtc").abs_path
        if not used or os.path.realpath(used) != os.path.realpath(chosen):
            raise RuntimeError(
                f"${NVRTC_ENV} names {chosen}, but this process already uses NVRTC from {used}; "
                "set it before the process's first NVRTC call"
            )
    return nvrtc


def _result_name(nvrtc, err) -> str:
    try:
        status, text = nvrtc.nvrtcGetErrorString(err)
        if int(status) == 0 and text:
            return text.decode()
    except Exception:
        pass
    return getattr(err, "name", None) or str(err)


def _check(result, what: str):
    """An NVRTC call's (err, *values): raise NvrtcError on error, else the value or values."""
    nvrtc = _nvrtc()
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcError(f"{what} failed", result=_result_name(nvrtc, err))
    return result[1] if len(result) == 2 else result[1:]


@dataclass
class NvrtcOutput:
    cubin: bytes
    log: str  # the program log: ptxas -v output when asked for with --ptxas-options=-v
    ptx: bytes = b""  # NUL-terminated PTX text, when asked for


def _program_log(nvrtc, prog) -> str:
    size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    if not size:
        return ""
    buf = b" " * size
    _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return buf.rstrip(b"\0 ").decode(errors="replace")


def nvrtc_compile(source: str, name: str, options: list[str], *, ptx: bool = False) -> NvrtcOutput:
    """Compile one CUDA source with NVRTC: the CUBIN, the PTX when ptx is true, and the log.

    Raises NvrtcError (with .result and .log) when a step fails: a failed compile carries the
    program log, and NVRTC_ERROR_INVALID_OPTION tells an option this NVRTC does not know.
    The program is always destroyed."""
    nvrtc = _nvrtc()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        compiled = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        failed = compiled[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS
        try:
            log = _program_log(nvrtc, prog)
        except NvrtcError as exc:
            if not failed:
                raise
            log = f"(no log: {exc})"
        if failed:
            raise NvrtcError("nvrtcCompileProgram failed", result=_result_name(nvrtc, compiled[0]), log=log)
        cubin = b" " * _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        text = b""
        if ptx:
            text = b" " * _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            _check(nvrtc.nvrtcGetPTX(prog, text), "nvrtcGetPTX")
            text = text.rstrip(b"\x00 ") + b"\x00"
        return NvrtcOutput(cubin, log, text)
    finally:
        try:
            nvrtc.nvrtcDestroyProgram(prog)
        except Exception:  # pragma: no cover - nothing to do about it
            pass


def nvrtc_version() -> tuple[int, int]:
    major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
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
    src = scheduler_source("kernel.cu").replace(
        "#define RL_MAX_THREADS 1024", f"#define RL_MAX_THREADS {threads}"
    )
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", "--ptxas-options=-v"]
    try:
        out = nvrtc_compile(src, "rl_scheduler.cu", opts, ptx=True)
    except NvrtcError as exc:
        raise NvrtcError(
            f"NVRTC could not compile the scheduler for {arch}: {exc.headline}",
            result=exc.result,
            log=exc.log,
        ) from exc
    return KernelBuild(arch, out.cubin, out.log, parse_ptxas_log(out.log), out.ptx, nvrtc_version())
