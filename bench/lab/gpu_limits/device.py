"""The device the probes run on: its primary context, pinned control blocks, scratch device
memory, streams and waits with timeouts, the loaded kernels (Probe) and probe threads.

Every driver call goes through ringleader.device.backends.cuda_driver (drv); `drv.cu` is looked up at each
call, so a stand-in driver module set there (tests/fake_cuda_driver.py) reaches all of it.
"""

from __future__ import annotations

import os
import threading
import time
import traceback

import numpy as np

from ringleader.bench.lab.gpu_limits.common import MIB, Budget, SkipProbe, Timeout, add_rescuer, wait_until
from ringleader.bench.lab.gpu_limits.kernels import (
    CTL_DOORBELL,
    CTL_EXIT,
    CTL_SHUTDOWN,
    CTL_WORDS,
    DOORBELL_STOP,
    EXIT_NAMES,
    KERNEL_GROUPS,
)
from ringleader.device.backends import cuda_driver as drv
from ringleader.device.backends.cuda_driver import CudaError


class Ctl:
    """One control block (CTL_WORDS u32) in the pinned arena."""

    def __init__(self, arena: drv.PinnedBuffer, offset: int, label: str):
        self.label = label
        self.offset = offset
        self.w = arena.view(np.uint32, offset, CTL_WORDS)
        self.w[:] = 0
        self.dptr = arena.device_ptr + offset
        self.hptr = arena.host_ptr + offset
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
        cu = drv.cu
        self.ordinal = ordinal
        drv.call(cu.cuInit, 0)
        self.driver_version = int(drv.call(cu.cuDriverGetVersion))
        self.dev = drv.call(cu.cuDeviceGet, ordinal)
        raw = drv.call(cu.cuDeviceGetName, 256, self.dev)
        if isinstance(raw, (bytes, bytearray)):
            raw = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
        self.name = str(raw).strip()
        A = cu.CUdevice_attribute
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
            "total_mem_bytes": int(drv.call(cu.cuDeviceTotalMem, self.dev)),
            "unified_addressing": self._attr_or_none("CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING"),
            "can_map_host_memory": self._attr_or_none("CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY"),
            "driver_version": self.driver_version,
        }
        self.ctx = drv.call(cu.cuDevicePrimaryCtxRetain, self.dev)
        drv.bind_context(self.ctx)
        self.prio_least, self.prio_greatest = drv.stream_priority_range()
        self.props["stream_priority_range"] = [self.prio_least, self.prio_greatest]
        try:
            self.props["module_loading_mode"] = getattr(drv.call(cu.cuModuleGetLoadingMode), "name", None)
        except Exception as e:
            self.props["module_loading_mode"] = f"unknown ({e})"
        self.props["CUDA_MODULE_LOADING"] = os.environ.get("CUDA_MODULE_LOADING")
        self._lock = threading.Lock()
        self.arena = drv.PinnedBuffer(1 * MIB)
        self._arena_next = 0
        self.staging = drv.PinnedBuffer(8 * MIB)
        self._staging_lock = threading.Lock()
        self.streams: list = []
        self.allocs: set[int] = set()

    def attr(self, a) -> int:
        return drv.device_attribute(self.dev, a)

    def _attr_or_none(self, name: str):
        a = getattr(drv.cu.CUdevice_attribute, name, None)
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
        drv.bind_context(self.ctx)

    # -- memory
    def new_ctl(self, label: str) -> Ctl:
        with self._lock:
            if self._arena_next + CTL_WORDS * 4 > self.arena.nbytes:
                self.arena = drv.PinnedBuffer(1 * MIB)  # the old arena stays allocated
                self._arena_next = 0
            off = self._arena_next
            self._arena_next += CTL_WORDS * 4
        return Ctl(self.arena, off, label)

    def malloc(self, nbytes: int) -> int:
        p = drv.mem_alloc(nbytes)
        self.allocs.add(p)
        return p

    def free(self, p: int) -> None:
        if p in self.allocs:
            self.allocs.discard(p)
            drv.mem_free(p)

    def d2h(self, p: int, nbytes: int, stream, timeout_s: float = 10.0) -> np.ndarray:
        """Copy device memory to a fresh numpy uint8 array (through pinned staging)."""
        out = np.empty(nbytes, np.uint8)
        with self._staging_lock:
            done = 0
            while done < nbytes:
                n = min(nbytes - done, self.staging.nbytes)
                drv.copy_to_host(self.staging.host_ptr, p + done, n, stream)
                if not self.wait_stream(stream, timeout_s):
                    raise Timeout("device-to-host copy")
                out[done : done + n] = self.staging.array[:n]
                done += n
        return out

    def read_u32(self, p: int, count: int, stream) -> np.ndarray:
        return self.d2h(p, 4 * count, stream).view(np.uint32)

    def read_u64(self, p: int, count: int, stream) -> np.ndarray:
        return self.d2h(p, 8 * count, stream).view(np.uint64)

    # -- streams, events
    def stream(self, high_priority: bool = False):
        s = drv.create_stream(highest_priority=high_priority)
        self.streams.append(s)
        return s

    def wait_stream(self, stream, timeout_s: float) -> bool:
        """Poll cuStreamQuery until the stream drains; False on timeout."""
        return wait_until(lambda: drv.stream_done(stream), timeout_s, 20e-6, 2e-3)

    def wait_event(self, ev, timeout_s: float) -> bool:
        return wait_until(lambda: drv.event_done(ev), timeout_s, 20e-6, 2e-3)


def try_init_device(ordinal: int):
    """(Dev, None), or (None, reason) when there is no usable CUDA device."""
    cu = drv.cu
    try:
        r = cu.cuInit(0)
    except Exception as e:
        return None, f"cuInit unavailable ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    if int(r[0]) != 0:
        return None, f"cuInit failed: {drv.err_text(r[0])}"
    r = cu.cuDeviceGetCount()
    if int(r[0]) != 0:
        return None, f"cuDeviceGetCount failed: {drv.err_text(r[0])}"
    if int(r[1]) <= ordinal:
        return None, f"{int(r[1])} CUDA device(s), ordinal {ordinal} requested"
    return Dev(ordinal), None


class Graphs:
    """Graphs / execs made by a probe, destroyed at the end."""

    def __init__(self):
        self.graphs: list = []
        self.execs: list = []

    def create(self):
        g = drv.create_graph()
        self.graphs.append(g)
        return g

    def instantiate(self, g, *, device_launch: bool = False):
        ge = drv.instantiate_graph(g, device_launch=device_launch)
        self.execs.append(ge)
        return ge

    def destroy(self) -> None:
        for destroy, items in ((drv.destroy_graph_exec, self.execs), (drv.destroy_graph, self.graphs)):
            for x in items:
                try:
                    destroy(x)
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
        self.ev0 = drv.create_event()
        self.ev1 = drv.create_event()

    def load_modules(self) -> None:
        for g, info in self.groups.items():
            if not info["ok"]:
                for k in KERNEL_GROUPS[g]:
                    self.func_err[k] = f"compile failed: {info['error']}"
                continue
            try:
                mod = drv.load_image(info["cubin"])
                self.modules[g] = mod
            except Exception as e:
                for k in KERNEL_GROUPS[g]:
                    self.func_err[k] = f"cuModuleLoadData failed: {e}"
                continue
            for k in KERNEL_GROUPS[g]:
                try:
                    # loaded now: lazy loading on first launch can wait for
                    # running kernels, which a persistent kernel never ends
                    f = drv.get_function(mod, k)
                    self.funcs[k] = f
                    self.func_attrs[k] = self._func_attrs(f)
                except Exception as e:
                    self.func_err[k] = str(e)

    @staticmethod
    def _func_attrs(f) -> dict:
        out = {}
        for key, name in (
            ("num_regs", "CU_FUNC_ATTRIBUTE_NUM_REGS"),
            ("local_bytes", "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES"),
            ("shared_bytes", "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES"),
            ("max_threads", "CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK"),
            ("binary_version", "CU_FUNC_ATTRIBUTE_BINARY_VERSION"),
        ):
            try:
                out[key] = drv.function_attribute(f, name)
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
        cur = drv.current_context()
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
        drv.memset_d32(buf, 1, 4, s)
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
