"""Tests for bench/gpu_limits/, the GPU-limits probe (``python -m bench.gpu_limits``).

On any machine (CI has no GPU):
  * --compile-only compiles every kernel with NVRTC for sm_90 and says so;
  * without a CUDA driver the plain command exits 0 with the 'no CUDA device'
    message;
  * the helpers (cuda_driver's check, parse_ptxas, device_slug, summarize, --only) behave;
  * every probe runs end to end against FakeDriver, a simulation of the CUDA
    driver below, set as ``device.backends.cuda_driver.cu`` (every driver call of
    the probe goes through that module). Each driver call is first made on the real cuda-python
    binding, whose argument conversion runs before it finds no libcuda, so a
    wrong argument type for the installed bindings fails the test. The
    simulated kernels implement the same protocols as bench/gpu_limits/kernels.cu
    (doorbell echo, ping-pong flag, WHILE/SWITCH counting), so the host side's
    checks and statistics run on realistic data. torch has no CUDA here, so
    probes 4 and 6 and the torch half of probe 5 are not exercised.
On a machine with a GPU (torch.cuda.is_available()):
  * the whole probe runs with --quick.

Run as a script, ``python tests/test_gpu_limits_build.py --fake-run OUT_DIR``
runs bench.gpu_limits.__main__.main under FakeDriver (the fake test does so in a subprocess).
"""

from __future__ import annotations

import collections
import ctypes
import importlib
import itertools
import json
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import ClassVar

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (--fake-run), not by pytest
    sys.path.insert(0, str(ROOT))
COMMAND = [sys.executable, "-m", "bench.gpu_limits"]  # run from ROOT
N_KERNELS = 8


def load(name: str):
    """A module of the package: "__main__" (the CLI), "common", "kernels", ..."""
    return importlib.import_module(f"bench.gpu_limits.{name}")


def cuda_driver():
    return importlib.import_module("device.backends.cuda_driver")


def run_probe(*args: str, timeout: int):
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _libcuda_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _torch_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _compile_line(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("GPU_LIMITS_COMPILE ")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0].split(" ", 1)[1])


# ----------------------------------------------------------------------------
# Tests that run everywhere


def test_compile_only_builds_every_kernel():
    pytest.importorskip("cuda.bindings")
    r = run_probe("--compile-only", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    info = _compile_line(r.stdout)
    kernels = load("kernels")
    assert info["ok"] is True
    assert info["arch"] == "sm_90"
    assert info["n_expected"] == info["n_compiled"] == len(kernels.ALL_KERNELS) == N_KERNELS
    assert set(info["kernels"]) == set(kernels.ALL_KERNELS)
    for name, k in info["kernels"].items():
        assert k["ok"], name
        assert isinstance(k["regs"], int) and 0 < k["regs"] <= 64, (name, k)
        # one-thread control kernels: nothing may go to local memory
        assert k["stack_bytes"] == 0 and k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, (name, k)
    assert f"compiled {N_KERNELS} of {N_KERNELS} kernels for sm_90" in r.stdout


@pytest.mark.skipif(_libcuda_present(), reason="a CUDA driver is installed here")
def test_without_a_device_exits_zero_with_message():
    pytest.importorskip("cuda.bindings")
    r = run_probe(timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        f"no CUDA device: compiled {N_KERNELS} kernels for sm_90; measurements need an H100/H200" in r.stdout
    )
    assert _compile_line(r.stdout)["ok"] is True


def test_check_names_the_failing_call():
    pytest.importorskip("cuda.bindings")
    gl = cuda_driver()  # the probe's check, call and CudaError are the runtime's
    from cuda.bindings import driver, nvrtc

    assert load("device").CudaError is gl.CudaError and load("common").CudaError is gl.CudaError

    ok = gl.check((driver.CUresult.CUDA_SUCCESS, 7))
    assert ok == 7
    assert gl.check((driver.CUresult.CUDA_SUCCESS, 1, 2)) == (1, 2)
    assert gl.check((driver.CUresult.CUDA_SUCCESS,)) is None
    with pytest.raises(gl.CudaError, match=r"cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY \(2\)"):
        gl.check((driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, 0), "cuMemAlloc")

    def cuFakeThing():
        return (driver.CUresult.CUDA_ERROR_INVALID_VALUE,)

    with pytest.raises(gl.CudaError, match="cuFakeThing failed: CUDA_ERROR_INVALID_VALUE"):
        gl.check(cuFakeThing())
    with pytest.raises(gl.CudaError, match="nvrtcCompileProgram failed: NVRTC_ERROR_COMPILATION"):
        gl.check((nvrtc.nvrtcResult.NVRTC_ERROR_COMPILATION,), "nvrtcCompileProgram")
    with pytest.raises(gl.CudaError, match="cuStreamQuery failed: CUDA_ERROR_INVALID_HANDLE"):
        gl.call(_named("cuStreamQuery", driver.CUresult.CUDA_ERROR_INVALID_HANDLE), 1)


def test_probe_reuses_the_runtime_driver_helpers():
    """The package makes no driver binding of its own: every call goes through cuda_driver."""
    for path in (ROOT / "bench" / "gpu_limits").glob("*.py"):
        text = path.read_text()
        assert "import driver" not in text and "from cuda import cuda" not in text, path.name
        assert "cuda.bindings.driver" not in text, path.name


def _named(name, err):
    def f(*_a):
        return (err,)

    f.__name__ = name
    return f


def test_helpers():
    common, kernels, cli = load("common"), load("kernels"), load("__main__")
    assert common.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert common.device_slug("NVIDIA H100 PCIe") == "h100"
    assert common.device_slug("NVIDIA H200") == "h200"
    assert common.device_slug("NVIDIA GH200 480GB") == "gh200"
    assert common.device_slug("NVIDIA GeForce RTX 4090") == "rtx-4090"
    log = (
        "ptxas info    : Compiling entry function 'k1' for 'sm_90'\n"
        "ptxas info    : Function properties for k1\n"
        "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 380 bytes cmem[0]\n"
        "ptxas info    : Compiling entry function 'k2' for 'sm_90'\n"
        "ptxas info    : Function properties for k2\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 6 registers, used 0 barriers\n"
    )
    p = kernels.parse_ptxas(log)
    assert p["k1"] == {
        "regs": 40,
        "smem_bytes": 1024,
        "stack_bytes": 8,
        "spill_store_bytes": 4,
        "spill_load_bytes": 4,
        "cmem0_bytes": 380,
    }
    assert p["k2"]["regs"] == 6 and p["k2"]["smem_bytes"] == 0
    s = common.summarize([1000, 2000, 3000, 4000])
    assert s["n"] == 4 and s["median_us"] == 2.5 and s["min_us"] == 1.0 and s["max_us"] == 4.0
    assert common.summarize([]) == {"n": 0}
    assert cli.parse_args(["--only", "4,1,3-4"]).selected == [1, 3, 4]
    everything = cli.parse_args([]).selected
    assert sorted(everything) == [1, 2, 3, 4, 5, 6, 7] and everything == list(common.RUN_ORDER)
    # the probes that depend on cudaGraphSetConditional run last
    assert everything[-2:] == [3, 4]
    with pytest.raises(SystemExit):
        cli.parse_args(["--only", "9"])


@pytest.mark.skipif(_libcuda_present(), reason="a CUDA driver is installed: the real-GPU test covers this")
def test_every_probe_against_fake_driver(tmp_path):
    pytest.importorskip("cuda.bindings")
    r = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--fake-run", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "fake driver:" not in out, out[-6000:]
    files = list(tmp_path.glob("*-h100-gpu-limits-quick.json"))
    assert len(files) == 1, (list(tmp_path.iterdir()), out[-3000:])
    res = json.loads(files[0].read_text())
    assert (tmp_path / files[0].name.replace(".json", ".log")).exists()
    probes = res["probes"]
    assert set(probes) == {
        "1_doorbell",
        "2_handoff",
        "3_launch",
        "4_torchgraph",
        "5_blocking",
        "6_roofline",
        "7_memops",
    }
    assert not res["meta"]["tainted"]
    assert res["kernels"]["ok"] and len(res["kernels"]["kernels"]) == N_KERNELS

    def ok(key):
        assert probes[key]["status"] == "ok", json.dumps(probes[key], indent=1)[:6000]

    for key in ("1_doorbell", "2_handoff", "3_launch", "7_memops"):
        ok(key)
    db = probes["1_doorbell"]["variants"]
    assert set(db) == {"spin", "nanosleep_0", "nanosleep_100", "nanosleep_1000"}
    for v in db.values():
        assert v["check"]["ok"] and v["round_trip"]["n"] == 1000 and v["round_trip"]["median_us"] > 0
    pp = probes["2_handoff"]["pingpong"]
    assert pp["check"]["ok"] and pp["one_way_both"]["n"] > 0
    ln = probes["3_launch"]
    assert ln["while_graph"]["check"]["ok"] and ln["switch_graph"]["branch_check"]["ok"]
    assert ln["while_graph"]["per_iteration_from_stamps"]["n"] > 1000
    mo = probes["7_memops"]
    assert mo["handoff_memops"]["check"]["ok"] and mo["handoff_events"]["check"]["ok"]
    cap = mo["capture"]
    assert cap["node_types"].count("CU_GRAPH_NODE_TYPE_BATCH_MEM_OP") == 2
    assert cap["captured_graph_runs"]["ok"] and cap["mem_op_graph_in_while_body"]["ok"]
    for key in ("4_torchgraph", "6_roofline"):  # torch has no CUDA here
        assert probes[key]["status"] == "skipped", probes[key]
    bl = probes["5_blocking"]
    for name in (
        "cuMemHostAlloc",
        "cuMemAlloc_cuMemFree",
        "cuModuleLoadData",
        "kernel_on_other_nonblocking_stream",
        "cuMemFreeHost",
    ):
        assert bl["ops"][name]["status"] == "completed", bl["ops"][name]
        assert bl["ops"][name]["kernel_still_running"] is True, bl["ops"][name]
    # the exit test's child uses the real driver, which is absent here
    assert bl["exit"]["plain"]["status"] == "error"
    assert "measurement" in (tmp_path / files[0].name.replace(".json", ".log")).read_text()


# ----------------------------------------------------------------------------
# On a GPU


@pytest.mark.skipif(not _torch_cuda(), reason="needs a CUDA GPU (torch.cuda.is_available())")
def test_quick_probe_on_gpu(tmp_path):
    r = run_probe("--quick", "--out-dir", str(tmp_path), timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-8000:]
    files = list(tmp_path.glob("*-gpu-limits-quick.json"))
    assert len(files) == 1, list(tmp_path.iterdir())
    res = json.loads(files[0].read_text())
    assert res["kernels"]["ok"], res["kernels"]
    probes = res["probes"]
    assert len(probes) == 7
    for key, p in probes.items():
        assert p["status"] in ("ok", "partial", "skipped"), (key, p.get("error"), p.get("where"))
    assert probes["1_doorbell"]["status"] == "ok", probes["1_doorbell"]
    assert probes["2_handoff"]["status"] == "ok", probes["2_handoff"]
    assert not res["meta"]["tainted"]


# ----------------------------------------------------------------------------
# FakeDriver: a simulation of the parts of the CUDA driver the probe uses


def _r32(a):
    return ctypes.c_uint32.from_address(a).value


def _w32(a, v):
    ctypes.c_uint32.from_address(a).value = int(v) & 0xFFFFFFFF


def _r64(a):
    return ctypes.c_uint64.from_address(a).value


def _w64(a, v):
    ctypes.c_uint64.from_address(a).value = int(v) & 0xFFFFFFFFFFFFFFFF


def _now():
    return time.perf_counter_ns()


class _Trap(Exception):
    pass


class _FStream:
    def __init__(self, fake, sid):
        self.fake = fake
        self.id = sid
        self.q: queue.Queue = queue.Queue()
        self.pending = 0
        self.cond = threading.Condition()
        self.capturing = None
        threading.Thread(target=self._work, daemon=True, name=f"fake-stream-{sid:#x}").start()

    def submit(self, op):
        with self.cond:
            self.pending += 1
        self.q.put(op)

    def _work(self):
        while True:
            op = self.q.get()
            try:
                op()
            except _Trap:
                self.fake.sticky = "CUDA_ERROR_LAUNCH_FAILED"
            except Exception:
                self.fake.sticky = "CUDA_ERROR_ILLEGAL_ADDRESS"
                msg = traceback.format_exc()
                self.fake.errors.append(msg)
                print("fake driver: device op raised\n" + msg, file=sys.stderr, flush=True)
            finally:
                with self.cond:
                    self.pending -= 1
                    self.cond.notify_all()

    def idle(self):
        with self.cond:
            return self.pending == 0

    def sync(self):
        with self.cond:
            self.cond.wait_for(lambda: self.pending == 0)


class _FGraph:
    def __init__(self, gid):
        self.id = gid
        self.nodes: list = []


class _FNode:
    def __init__(self, nid, kind, **kw):
        self.id = nid
        self.kind = kind
        self.__dict__.update(kw)


class FakeDriver:
    """Stands in for ``cuda.bindings.driver`` as cuda_driver.cu (see module doc)."""

    SIGS: ClassVar[dict[str, str]] = {
        "rl_empty": "",
        "rl_doorbell": "QIIIQ",
        "rl_pingpong": "QIIQQQQ",
        "rl_stamp": "QI",
        "rl_timer_res": "QI",
        "rl_while_body": "QQQI",
        "rl_switch_ctl": "QQQQI",
        "rl_branch": "QI",
    }
    VALIDATE_CALLS = 4

    def __init__(self, gl):  # gl: bench.gpu_limits.kernels (the control-block layout)
        from cuda.bindings import driver as real

        self._real = real
        self._gl = gl
        self._validated: collections.Counter = collections.Counter()
        self._ids = itertools.count(0x1000, 0x10)
        self._keep: dict = {}
        self._streams: dict = {}
        self._events: dict = {}
        self._modules: dict = {}
        self._funcs: dict = {}
        self._graphs: dict = {}
        self._nodes: dict = {}
        self._execs: dict = {}
        self._handles: dict = {}
        self.errors: list = []
        self.sticky = None
        self._streams[0] = _FStream(self, 0)
        self.S = real.CUresult.CUDA_SUCCESS

    # -- plumbing
    def __getattr__(self, name):
        real = object.__getattribute__(self, "_real")
        real_attr = getattr(real, name)
        fake = getattr(type(self), "f_" + name, None)
        if fake is None:
            if name.startswith("cu") and callable(real_attr) and not isinstance(real_attr, type):

                def missing(*_a, **_k):
                    raise RuntimeError(f"fake driver: {name} is not simulated")

                missing.__name__ = name
                return missing
            return real_attr

        def wrapper(*args):
            if self._validated[name] < self.VALIDATE_CALLS:
                self._validated[name] += 1
                try:
                    real_attr(*args)
                except Exception as e:
                    if "DynamicLib" not in type(e).__name__ and "NotFound" not in type(e).__name__:
                        raise  # a wrong argument for the installed binding
            if self.sticky and name not in ("cuGetErrorString", "cuGetErrorName"):
                return (getattr(self._real.CUresult, self.sticky),)
            return fake(self, *args)

        wrapper.__name__ = name
        return wrapper

    def _id(self):
        return next(self._ids)

    def _stream(self, s):
        return self._streams[int(s)]

    def _decode(self, name, kp):
        sig = self.SIGS[name]
        if not sig:
            return ()
        arr = (ctypes.c_void_p * len(sig)).from_address(int(kp))
        out = []
        for ch, p in zip(sig, arr):
            out.append(
                ctypes.c_uint64.from_address(p).value if ch == "Q" else ctypes.c_uint32.from_address(p).value
            )
        return tuple(out)

    def _enqueue(self, s, op, kind, **kw):
        st = self._stream(s)
        if st.capturing is not None:
            g = st.capturing
            deps = [g.nodes[-1]] if g.nodes else []
            g.nodes.append(_FNode(self._id(), kind, op=op, deps=deps, **kw))
        else:
            st.submit(op)

    def _wait(self, pred, what):
        t0 = time.monotonic()
        while not pred():
            time.sleep(2e-5)
            if time.monotonic() - t0 > 120:
                raise RuntimeError(f"fake device wait stuck: {what}")

    # -- device, context
    def f_cuInit(self, flags):
        return (self.S,)

    def f_cuDriverGetVersion(self):
        return (self.S, 13000)

    def f_cuDeviceGetCount(self):
        return (self.S, 1)

    def f_cuDeviceGet(self, ordinal):
        return (self.S, self._real.CUdevice(ordinal))

    def f_cuDeviceGetName(self, n, dev):
        return (self.S, b"NVIDIA H100 80GB HBM3".ljust(n, b"\0"))

    def f_cuDeviceGetAttribute(self, attr, dev):
        A = self._real.CUdevice_attribute
        vals = {
            A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
            A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
            A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
            A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: 50 << 20,
        }
        return (self.S, vals.get(attr, 1))

    def f_cuDeviceTotalMem(self, dev):
        return (self.S, 80 << 30)

    def f_cuDevicePrimaryCtxRetain(self, dev):
        return (self.S, self._real.CUcontext(0xC0))

    def f_cuCtxSetCurrent(self, ctx):
        assert int(ctx) == 0xC0
        return (self.S,)

    def f_cuCtxGetCurrent(self):
        return (self.S, self._real.CUcontext(0xC0))

    def f_cuCtxGetStreamPriorityRange(self):
        return (self.S, 0, -5)

    def f_cuModuleGetLoadingMode(self):
        return (self.S, self._real.CUmoduleLoadingMode.CU_MODULE_LAZY_LOADING)

    def f_cuGetErrorString(self, err):
        return (self.S, f"fake description of {err.name}".encode())

    # -- memory
    def _alloc(self, n):
        buf = ctypes.create_string_buffer(max(int(n), 1))
        addr = ctypes.addressof(buf)
        self._keep[addr] = buf
        return addr

    def f_cuMemAlloc(self, n):
        return (self.S, self._real.CUdeviceptr(self._alloc(n)))

    def f_cuMemFree(self, p):
        assert self._keep.pop(int(p), None) is not None, "cuMemFree of an unknown pointer"
        return (self.S,)

    def f_cuMemHostAlloc(self, n, flags):
        return (self.S, self._alloc(n))

    def f_cuMemHostGetDevicePointer(self, p, flags):
        assert int(p) in self._keep and flags == 0
        return (self.S, self._real.CUdeviceptr(int(p)))

    def f_cuMemFreeHost(self, p):
        assert self._keep.pop(int(p), None) is not None, "cuMemFreeHost of an unknown pointer"
        return (self.S,)

    def f_cuMemsetD32Async(self, p, v, n, s):
        p, v, n = int(p), int(v), int(n)

        def op():
            arr = (ctypes.c_uint32 * n).from_address(p)
            for i in range(n):
                arr[i] = v

        self._enqueue(s, op, "MEMSET")
        return (self.S,)

    def f_cuMemcpyDtoHAsync(self, dst, src, n, s):
        dst, src, n = int(dst), int(src), int(n)
        self._enqueue(s, lambda: ctypes.memmove(dst, src, n), "MEMCPY")
        return (self.S,)

    # -- modules, kernels
    def f_cuModuleLoadData(self, image):
        image = bytes(image)
        assert image[:4] == b"\x7fELF", "not a CUBIN"
        mid = self._id()
        self._modules[mid] = image
        return (self.S, self._real.CUmodule(mid))

    def f_cuModuleGetFunction(self, mod, name):
        name = bytes(name)
        if b".text." + name not in self._modules[int(mod)]:
            return (self._real.CUresult.CUDA_ERROR_NOT_FOUND, None)
        fid = self._id()
        self._funcs[fid] = name.decode()
        return (self.S, self._real.CUfunction(fid))

    def f_cuFuncLoad(self, f):
        assert int(f) in self._funcs
        return (self.S,)

    def f_cuFuncGetAttribute(self, attr, f):
        assert int(f) in self._funcs
        return (self.S, 16)

    def f_cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, s, kp, extra):
        assert (gx, gy, gz, bx, by, bz) == (1, 1, 1, 1, 1, 1)
        name = self._funcs[int(f)]
        args = self._decode(name, kp) if kp else ()
        assert len(args) == len(self.SIGS[name]), name
        self._enqueue(s, lambda: self._run_kernel(name, args), "KERNEL", name=name, args=args)
        return (self.S,)

    def _run_kernel(self, name, args):
        getattr(self, "k_" + name)(*args)

    # simulated kernels: the protocols of gpu_limits_kernels.cu
    def k_rl_empty(self):
        pass

    def k_rl_doorbell(self, ctl, sleep_ns, use_sleep, flags, budget):
        gl = self._gl

        def W(i):
            return ctl + 4 * i

        t0 = _now()
        last = _r32(W(gl.CTL_DOORBELL))
        _w32(W(gl.CTL_STARTED), 1)
        handled = polls = reason = 0
        while True:
            v = _r32(W(gl.CTL_DOORBELL))
            polls += 1
            if v != last:
                if v == 0xFFFFFFFF:
                    reason = gl.EXIT_STOPWORD
                    break
                _w32(W(gl.CTL_ANSWER), v)
                last = v
                handled += 1
                continue
            # the kernel checks every 64 polls; a sleeping Python poll is ~100x slower than a
            # GPU's, so the stand-in checks every poll or its heartbeat lags the probe's 5 ms look
            if polls % 64 == 0 or use_sleep:
                if _r32(W(gl.CTL_SHUTDOWN)):
                    reason = gl.EXIT_SHUTDOWN
                    break
                now = _now()
                if now - t0 > budget:
                    reason = gl.EXIT_DEADLINE
                    break
                if flags & 1:
                    _w32(W(gl.CTL_HEARTBEAT), now)
            if use_sleep:
                time.sleep(sleep_ns * 1e-9)
        _w32(W(gl.CTL_HANDLED), handled)
        _w32(W(gl.CTL_POLLS_LO), polls)
        _w32(W(gl.CTL_POLLS_HI), polls >> 32)
        _w32(W(gl.CTL_EXIT), reason)

    def k_rl_pingpong(self, flag, role, n, t_send, t_recv, ctl, budget):
        gl = self._gl
        t0 = _now()
        done, reason = 0, gl.EXIT_DONE
        for i in range(n):
            want = 2 * i + 2 if role == 0 else 2 * i + 1
            if role == 0:
                _w64(t_send + 8 * i, _now())
                _w32(flag, 2 * i + 1)
            spins, bail = 0, False
            while ((_r32(flag) - want) & 0xFFFFFFFF) >= 0x80000000:
                spins += 1
                if spins % 64 == 0:
                    if _r32(ctl + 4 * gl.CTL_SHUTDOWN):
                        reason, bail = gl.EXIT_SHUTDOWN, True
                        break
                    if _now() - t0 > budget:
                        reason, bail = gl.EXIT_DEADLINE, True
                        break
                    time.sleep(0)
            if bail:
                break
            now = _now()
            _w64(t_recv + 8 * i, now)
            if role == 1:
                _w64(t_send + 8 * i, now)
                _w32(flag, 2 * i + 2)
            done = i + 1
        _w32(ctl + 4 * (gl.CTL_DONE0 + role), done)
        if role == 0:
            _w32(ctl + 4 * gl.CTL_EXIT, reason)

    def k_rl_stamp(self, out, idx):
        _w64(out + 8 * idx, _now())

    def k_rl_timer_res(self, out, n):
        _w64(out, 1)
        _w64(out + 8, n)
        _w64(out + 16, n)

    def _count(self, state, stamps, cap):
        c = _r32(state) + 1
        _w32(state, c)
        if c > _r32(state + 8):
            raise _Trap()
        if c <= cap:
            _w64(stamps + 8 * (c - 1), _now())
        return c

    def k_rl_while_body(self, h, state, stamps, cap):
        c = self._count(state, stamps, cap)
        self._set_cond(h, 1 if c < _r32(state + 4) else 0)

    def k_rl_switch_ctl(self, hw, hs, state, stamps, cap):
        c = self._count(state, stamps, cap)
        self._set_cond(hs, (c - 1) & 3)
        self._set_cond(hw, 1 if c < _r32(state + 4) else 0)

    def k_rl_branch(self, counters, k):
        _w32(counters + 4 * k, _r32(counters + 4 * k) + 1)

    def _set_cond(self, h, v):
        self._handles[int(h)]["value"] = v

    # -- streams, events
    def f_cuStreamCreateWithPriority(self, flags, prio):
        assert int(flags) == int(self._real.CUstream_flags.CU_STREAM_NON_BLOCKING)
        sid = self._id()
        self._streams[sid] = _FStream(self, sid)
        return (self.S, self._real.CUstream(sid))

    def f_cuStreamQuery(self, s):
        return (self.S if self._stream(s).idle() else self._real.CUresult.CUDA_ERROR_NOT_READY,)

    def f_cuStreamSynchronize(self, s):
        self._stream(s).sync()
        return (self.S,)

    def f_cuEventCreate(self, flags):
        eid = self._id()
        self._events[eid] = {"gen": 0, "done": 0, "t": None}
        return (self.S, self._real.CUevent(eid))

    def f_cuEventDestroy(self, ev):
        self._events.pop(int(ev))
        return (self.S,)

    def f_cuEventRecord(self, ev, s):
        e = self._events[int(ev)]
        e["gen"] += 1
        g = e["gen"]

        def op():
            e["t"] = _now()
            e["done"] = g

        self._enqueue(s, op, "EVENT_RECORD")
        return (self.S,)

    def f_cuEventQuery(self, ev):
        e = self._events[int(ev)]
        return (self.S if e["done"] >= e["gen"] else self._real.CUresult.CUDA_ERROR_NOT_READY,)

    def f_cuEventElapsedTime(self, e0, e1):
        a, b = self._events[int(e0)], self._events[int(e1)]
        assert a["done"] == a["gen"] and b["done"] == b["gen"], "elapsed time of an unfinished event"
        return (self.S, (b["t"] - a["t"]) / 1e6)

    def f_cuStreamWaitEvent(self, s, ev, flags):
        e = self._events[int(ev)]
        g = e["gen"]
        self._enqueue(s, lambda: self._wait(lambda: e["done"] >= g, "event"), "WAIT_EVENT")
        return (self.S,)

    def f_cuStreamWaitValue32(self, s, addr, value, flags):
        addr, value, flags = int(addr), int(value), int(flags)
        F = self._real.CUstreamWaitValue_flags

        def pred():
            v = _r32(addr)
            if flags == int(F.CU_STREAM_WAIT_VALUE_EQ):
                return v == value
            if flags == int(F.CU_STREAM_WAIT_VALUE_GEQ):
                return ((v - value) & 0xFFFFFFFF) < 0x80000000
            raise AssertionError(f"wait flags {flags} not simulated")

        self._enqueue(s, lambda: self._wait(pred, "wait value"), "BATCH_MEM_OP")
        return (self.S,)

    def f_cuStreamWriteValue32(self, s, addr, value, flags):
        addr, value = int(addr), int(value)
        self._enqueue(s, lambda: _w32(addr, value), "BATCH_MEM_OP")
        return (self.S,)

    def f_cuStreamBeginCapture(self, s, mode):
        st = self._stream(s)
        assert st.capturing is None
        st.capturing = self._new_graph()
        return (self.S,)

    def f_cuStreamEndCapture(self, s):
        st = self._stream(s)
        g, st.capturing = st.capturing, None
        return (self.S, self._real.CUgraph(g.id))

    # -- graphs
    def _new_graph(self):
        g = _FGraph(self._id())
        self._graphs[g.id] = g
        return g

    def _add_node(self, g, deps, ndeps, kind, **kw):
        g = self._graphs[int(g)]
        deps = [self._nodes[int(d)] for d in (deps or [])]
        assert len(deps) == int(ndeps)
        assert all(d in g.nodes for d in deps), "dependency from another graph"
        n = _FNode(self._id(), kind, deps=deps, **kw)
        g.nodes.append(n)
        self._nodes[n.id] = n
        return self._real.CUgraphNode(n.id)

    def f_cuGraphCreate(self, flags):
        return (self.S, self._real.CUgraph(self._new_graph().id))

    def f_cuGraphDestroy(self, g):
        return (self.S,)

    def f_cuGraphExecDestroy(self, ge):
        return (self.S,)

    def f_cuGraphConditionalHandleCreate(self, g, ctx, default, flags):
        hid = self._id()
        self._handles[hid] = {
            "graph": int(g),
            "default": int(default),
            "assign": bool(int(flags) & 1),
            "value": 0,
        }
        return (self.S, self._real.CUgraphConditionalHandle(hid))

    def f_cuGraphAddKernelNode(self, g, deps, ndeps, p):
        name = self._funcs[int(p.func)]
        assert (p.gridDimX, p.blockDimX) == (1, 1)
        args = self._decode(name, p.kernelParams) if p.kernelParams else ()
        assert len(args) == len(self.SIGS[name])
        return (self.S, self._add_node(g, deps, ndeps, "KERNEL", name=name, args=args))

    def f_cuGraphAddChildGraphNode(self, g, deps, ndeps, child):
        snap = list(self._graphs[int(child)].nodes)  # the child is cloned
        return (self.S, self._add_node(g, deps, ndeps, "GRAPH", nodes=snap))

    def f_cuGraphAddNode(self, g, deps, dep_data, ndeps, p):
        assert int(p.type) == int(self._real.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL)
        c = p.conditional
        hid, size = int(c.handle), int(c.size)
        if self._handles[hid]["graph"] != int(g):
            return (self._real.CUresult.CUDA_ERROR_INVALID_VALUE, None)
        assert int(c.ctx) == 0xC0
        bodies = [self._new_graph() for _ in range(size)]
        arr = (ctypes.c_uint64 * size)(*[b.id for b in bodies])
        self._keep[ctypes.addressof(arr)] = arr
        ctypes.c_uint64.from_address(c.getPtr() + 16).value = ctypes.addressof(arr)
        node = self._add_node(
            g, deps, ndeps, "CONDITIONAL", handle=hid, ctype=c.type, size=size, bodies=bodies
        )
        return (self.S, node)

    def f_cuGraphInstantiate(self, g, flags):
        xid = self._id()
        self._execs[xid] = self._graphs[int(g)]
        return (self.S, self._real.CUgraphExec(xid))

    def f_cuGraphUpload(self, ge, s):
        return (self.S,)

    def f_cuGraphLaunch(self, ge, s):
        g = self._execs[int(ge)]

        def op():
            tree = self._graph_tree(g.nodes, {g.id})
            for h in self._handles.values():
                if h["assign"] and h["graph"] in tree:
                    h["value"] = h["default"]
            self._exec_nodes(g.nodes)

        self._enqueue(s, op, "GRAPH")
        return (self.S,)

    def _graph_tree(self, nodes, acc):
        for n in nodes:
            if n.kind == "CONDITIONAL":
                for b in n.bodies:
                    acc.add(b.id)
                    self._graph_tree(b.nodes, acc)
            elif n.kind == "GRAPH":
                self._graph_tree(n.nodes, acc)
        return acc

    def _exec_nodes(self, nodes):
        CT = self._real.CUgraphConditionalNodeType
        for n in nodes:
            if n.kind == "KERNEL":
                self._run_kernel(n.name, n.args)
            elif n.kind == "GRAPH":
                self._exec_nodes(n.nodes)
            elif n.kind == "CONDITIONAL":
                h = self._handles[n.handle]
                if int(n.ctype) == int(CT.CU_GRAPH_COND_TYPE_WHILE):
                    guard = 0
                    while h["value"]:
                        self._exec_nodes(n.bodies[0].nodes)
                        guard += 1
                        if guard > 1_000_000:
                            raise _Trap()
                elif int(n.ctype) == int(CT.CU_GRAPH_COND_TYPE_SWITCH):
                    if h["value"] < n.size:
                        self._exec_nodes(n.bodies[h["value"]].nodes)
                else:
                    raise AssertionError("IF not simulated")
            else:
                n.op()

    def f_cuGraphGetNodes(self, g, n):
        nodes = self._graphs[int(g)].nodes
        if int(n) == 0:
            return (self.S, [], len(nodes))
        return (self.S, [self._real.CUgraphNode(x.id) for x in nodes[: int(n)]], min(len(nodes), int(n)))

    def f_cuGraphNodeGetType(self, node):
        for g in self._graphs.values():
            for x in g.nodes:
                if x.id == int(node):
                    return (self.S, getattr(self._real.CUgraphNodeType, "CU_GRAPH_NODE_TYPE_" + x.kind))
        raise AssertionError("unknown node")


def _fake_run(out_dir: str) -> int:
    sys.setswitchinterval(2e-5)  # the simulated kernels are Python threads
    drv = cuda_driver()
    fake = FakeDriver(load("kernels"))
    drv.cu = fake  # every driver call of the probe goes through cuda_driver
    rc = load("__main__").main(["--quick", "--out-dir", out_dir])
    if fake.errors:
        print(f"fake driver: {len(fake.errors)} device op(s) raised", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--fake-run":
        sys.exit(_fake_run(sys.argv[2]))
    sys.exit(pytest.main([__file__, "-v"]))
