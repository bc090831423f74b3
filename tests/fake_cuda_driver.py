"""FakeDriver: a simulation of the parts of the CUDA driver the gpu_limits probe uses, set as
``ringleader.device.backends.cuda_driver.cu`` (every driver call of the probe goes through that
module). Each driver call is first made on the real cuda-python binding, whose argument
conversion runs before it finds no libcuda, so a wrong argument type for the installed bindings
fails the run. Streams are threads; the kernels are tests/fake_gpu_kernels.py's.

Run as a script, ``python tests/fake_cuda_driver.py --fake-run OUT_DIR`` runs
ringleader.bench.lab.gpu_limits.__main__.main --quick under FakeDriver
(tests/test_gpu_limits_simulated.py does so in a subprocess).
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import queue
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import ClassVar

if __name__ == "__main__":  # run as a script (--fake-run): the repository root holds tests/ and ringleader/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fake_gpu_kernels import FakeKernels, KernelTrap, now_ns, read_u32, write_u32
from tests.gpu_limits_probe import cuda_driver, load


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
            if op is None:  # FakeDriver.close(): the thread ends (after the ops queued before it)
                return
            try:
                op()
            except KernelTrap:
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


class FakeDriver(FakeKernels):
    """Stands in for ``cuda.bindings.driver`` as cuda_driver.cu (see module doc)."""

    VALIDATE_CALLS = 4
    MAX_BLOCK: ClassVar[dict[str, int]] = {}  # kernels launched with more than one thread, and how many

    def __init__(self, gl):  # gl: ringleader.bench.lab.gpu_limits.kernels (the control-block layout)
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
        self._device_execs: set = set()
        self._tls = threading.local()  # the graph run a stream's thread is executing, if any
        self.errors: list = []
        self.destroyed_streams = 0
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

    def close(self):
        """Ends every stream's thread once the work queued on it has run."""
        for st in self._streams.values():
            st.q.put(None)

    def _id(self):
        return next(self._ids)

    def _stream(self, s):
        return self._streams[int(s)]

    def _decode(self, name, kp):
        sig = self.SIGS[name]
        if not sig:
            return ()
        arr = (ctypes.c_void_p * len(sig)).from_address(int(kp))
        return tuple(self._decode_arg(ch, p) for ch, p in zip(sig, arr))

    def _decode_arg(self, ch, p):
        """One argument's value from its address (a subclass adds kinds: a struct by value)."""
        return ctypes.c_uint64.from_address(p).value if ch == "Q" else ctypes.c_uint32.from_address(p).value

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
        name = self._funcs[int(f)]
        assert (gx, gy, gz, by, bz) == (1, 1, 1, 1, 1) and 1 <= bx <= self.MAX_BLOCK.get(name, 1), (name, bx)
        args = self._decode(name, kp) if kp else ()
        assert len(args) == len(self.SIGS[name]), name
        self._enqueue(s, lambda: self._run_kernel(name, args), "KERNEL", name=name, args=args)
        return (self.S,)

    # -- streams, events
    def f_cuStreamCreateWithPriority(self, flags, prio):
        assert int(flags) == int(self._real.CUstream_flags.CU_STREAM_NON_BLOCKING)
        sid = self._id()
        self._streams[sid] = _FStream(self, sid)
        return (self.S, self._real.CUstream(sid))

    def f_cuStreamDestroy(self, s):
        """As CUDA's: work already queued still runs, then the stream's resources go."""
        self._streams.pop(int(s)).q.put(None)
        self.destroyed_streams += 1
        return (self.S,)

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
            e["t"] = now_ns()
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
            v = read_u32(addr)
            if flags == int(F.CU_STREAM_WAIT_VALUE_EQ):
                return v == value
            if flags == int(F.CU_STREAM_WAIT_VALUE_GEQ):
                return ((v - value) & 0xFFFFFFFF) < 0x80000000
            raise AssertionError(f"wait flags {flags} not simulated")

        self._enqueue(s, lambda: self._wait(pred, "wait value"), "BATCH_MEM_OP")
        return (self.S,)

    def f_cuStreamWriteValue32(self, s, addr, value, flags):
        addr, value = int(addr), int(value)
        self._enqueue(s, lambda: write_u32(addr, value), "BATCH_MEM_OP")
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
        if int(flags) & int(self._real.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH):
            self._device_execs.add(xid)
        return (self.S, self._real.CUgraphExec(xid))

    def f_cuGraphUpload(self, ge, s):
        return (self.S,)

    def f_cuGraphLaunch(self, ge, s):
        self._execs[int(ge)]  # a known exec
        self._enqueue(s, lambda: self._run_graph(int(ge)), "GRAPH")
        return (self.S,)

    def _run_graph(self, xid):
        """One graph launch: its nodes, then the graphs its kernels launched fire-and-forget
        (their threads joined), then its tail launches, each in turn (iteratively: a graph may
        tail-launch itself thousands of times)."""
        pending = [xid]
        while pending:
            xid = pending.pop(0)
            g = self._execs[xid]
            tree = self._graph_tree(g.nodes, {g.id})
            for h in self._handles.values():
                if h["assign"] and h["graph"] in tree:
                    h["value"] = h["default"]
            run: dict = {"exec": xid, "tails": [], "children": []}
            outer = getattr(self._tls, "run", None)
            self._tls.run = run
            try:
                self._exec_nodes(g.nodes)
            finally:
                self._tls.run = outer
            for child in run["children"]:
                child.join()
            pending.extend(run["tails"])

    def _run_child(self, xid):
        try:
            self._run_graph(xid)
        except KernelTrap:
            self.sticky = "CUDA_ERROR_LAUNCH_FAILED"
        except Exception:
            self.sticky = "CUDA_ERROR_ILLEGAL_ADDRESS"
            self.errors.append(traceback.format_exc())

    def device_launch(self, xid: int, tail: bool) -> int:
        """cudaGraphLaunch in a kernel. Assumed, as the probe measures: only a kernel running in
        a graph may launch, and only a graph instantiated for device launch; else an error code."""
        run = getattr(self._tls, "run", None)
        if xid == 0:
            xid = run["exec"] if run else 0
        if run is None or xid not in self._device_execs:
            return 1  # cudaErrorInvalidValue
        if tail:
            run["tails"].append(xid)
        else:
            child = threading.Thread(target=self._run_child, args=(xid,), daemon=True)
            child.start()
            run["children"].append(child)
        return 0

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
                            raise KernelTrap()
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


def fake_run(out_dir: str) -> int:
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
        sys.exit(fake_run(sys.argv[2]))
    sys.exit("usage: python tests/fake_cuda_driver.py --fake-run OUT_DIR")
