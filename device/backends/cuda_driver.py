"""Checked cuda-python driver calls: pinned and device memory, streams, events, modules, launches,
graphs and graph nodes; the runtime and bench/lab/gpu_limits both use these (none written twice).

Every call's result goes through check(), which raises with the function's name and the
driver's error string.  Kernel arguments are passed in the driver's raw form (an array of
addresses of each argument's bytes), which also carries RlContext by value.
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import re

import numpy as np

from ringleader.ipc.native import cache_dir

try:
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - the CPU backend never gets here
    cu = None


class CudaError(RuntimeError):
    pass


_CALL_RE = re.compile(r"\b((?:cu|nvrtc|cuda)[A-Z]\w*)\s*[,(]")


def err_text(err) -> str:
    """'NAME (code): description' for a CUresult or an nvrtcResult."""
    try:
        code = int(err)
    except Exception:
        return repr(err)
    name = getattr(err, "name", None) or str(err)
    desc = ""
    try:
        if cu is not None and isinstance(err, cu.CUresult):
            r, s = cu.cuGetErrorString(err)
        else:
            from cuda.bindings import nvrtc

            r, s = nvrtc.nvrtcGetErrorString(err) if isinstance(err, nvrtc.nvrtcResult) else (1, b"")
        if int(r) == 0 and s:
            desc = s.decode(errors="replace") if isinstance(s, bytes) else str(s)
    except Exception:
        pass
    return f"{name} ({code})" + (f": {desc}" if desc and desc != name else "")


def _guess_call_name() -> str:
    """The cu*/nvrtc* function named on the source line of check()'s caller."""
    try:
        for fr in inspect.stack()[2:6]:
            m = _CALL_RE.search("".join(fr.code_context or []))
            if m:
                return m.group(1)
    except Exception:
        pass
    return "CUDA call"


def check(result, what: str | None = None):
    """cuda-python returns (err, *values); raise on error, return None, the value or the values.
    The error names `what`, or else the function called on the caller's source line."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise CudaError(f"{what or _guess_call_name()} failed: {err_text(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def call(fn, *args):
    """fn(*args) with its result checked; an error names fn."""
    return check(fn(*args), getattr(fn, "__name__", None))


def current_context():
    """The primary context torch made current on this thread (torch must be initialised)."""
    return check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")


def bind_context(ctx) -> None:
    """Driver calls on a new thread need the context made current there first."""
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def device_attribute(device, attribute) -> int:
    return int(check(cu.cuDeviceGetAttribute(attribute, device), "cuDeviceGetAttribute"))


def current_device():
    """The device of the context current on this thread."""
    return check(cu.cuCtxGetDevice(), "cuCtxGetDevice")


def stream_priority_range() -> tuple[int, int]:
    """(least, greatest) stream priority of the current context; greatest is numerically lowest."""
    least, greatest = check(cu.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
    return int(least), int(greatest)


def create_stream(highest_priority: bool = True):
    """A non-blocking stream of our own: never the legacy stream, never torch's pool."""
    least, greatest = stream_priority_range()
    prio = greatest if highest_priority else least
    flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
    return check(cu.cuStreamCreateWithPriority(flags, prio), "cuStreamCreateWithPriority")


def destroy_stream(stream) -> None:
    """Work queued on it still runs; its resources go once that has ended."""
    check(cu.cuStreamDestroy(stream), "cuStreamDestroy")


def stream_done(stream) -> bool:
    err = cu.cuStreamQuery(stream)[0]
    if err == cu.CUresult.CUDA_ERROR_NOT_READY:
        return False
    check((err,), "cuStreamQuery")
    return True


def synchronize(stream) -> None:
    """Waits (spinning in the driver) for the stream's work; never while a persistent kernel runs on it."""
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")


def event_done(event) -> bool:
    err = cu.cuEventQuery(event)[0]
    if err == cu.CUresult.CUDA_ERROR_NOT_READY:
        return False
    check((err,), "cuEventQuery")
    return True


class PinnedBuffer:
    """Page-locked host memory the device reads and writes at system scope (not write-combined:
    the host reads it too)."""

    def __init__(self, nbytes: int):
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
        self.host_ptr = int(check(cu.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc"))
        self.nbytes = nbytes
        self.device_ptr = int(
            check(cu.cuMemHostGetDevicePointer(self.host_ptr, 0), "cuMemHostGetDevicePointer")
        )
        raw = (ctypes.c_uint8 * nbytes).from_address(self.host_ptr)
        self.array = np.frombuffer(raw, dtype=np.uint8)
        self.array[:] = 0

    def view(self, dtype, offset: int = 0, count: int | None = None) -> np.ndarray:
        """count items of dtype from byte offset (all the rest when count is None)."""
        dt = np.dtype(dtype)
        if count is None:
            count = (self.nbytes - offset) // dt.itemsize
        return self.array[offset : offset + count * dt.itemsize].view(dt)

    def free(self) -> None:
        if self.host_ptr:
            self.array = None
            check(cu.cuMemFreeHost(self.host_ptr), "cuMemFreeHost")
            self.host_ptr = 0


def mem_alloc(nbytes: int) -> int:
    """Device memory outside torch's caching allocator; free it with mem_free."""
    return int(check(cu.cuMemAlloc(int(nbytes)), "cuMemAlloc"))


def mem_free(ptr: int) -> None:
    check(cu.cuMemFree(ptr), "cuMemFree")


def memset_d32(ptr: int, value: int, count: int, stream) -> None:
    """count 32-bit words at ptr set to value, in stream order."""
    check(cu.cuMemsetD32Async(ptr, int(value) & 0xFFFFFFFF, int(count), stream), "cuMemsetD32Async")


def driver_version() -> tuple[int, int]:
    """The CUDA version the installed driver supports, e.g. (13, 0) for an R580 driver."""
    v = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
    return v // 1000, (v % 1000) // 10


def load_module(build, driver: tuple[int, int] | None = None):
    """Loads the scheduler module from its CUBIN; if the driver refuses it, from its PTX, but
    only when that PTX is no newer than the driver accepts.  Returns (module, how it loaded)."""
    from ringleader.device.sched.build import ptx_loadable

    key = hashlib.sha256(build.cubin).hexdigest()[:16]
    (cache_dir() / f"rlsched-{build.arch}-{key}.cubin").write_bytes(build.cubin)  # for cuobjdump
    try:
        return load_image(build.cubin, "cuModuleLoadData(cubin)"), "cubin"
    except CudaError as cubin_error:
        driver = driver or driver_version()
        ok, why = ptx_loadable(build.nvrtc_version, driver)
        if not build.ptx or not ok:
            raise CudaError(
                f"the driver refused the scheduler's {build.arch} CUBIN ({cubin_error}) "
                f"and the PTX fallback is not possible: {why or 'no PTX'}"
            ) from cubin_error
        try:
            module = load_image(build.ptx, "cuModuleLoadData(ptx)")
        except CudaError as ptx_error:
            raise CudaError(
                f"the driver refused the scheduler's CUBIN ({cubin_error}) and its PTX "
                f"(ISA {build.ptx_isa}: {ptx_error})"
            ) from ptx_error
        return module, f"ptx (ISA {build.ptx_isa}; the CUBIN was refused: {cubin_error})"


def load_image(image: bytes, what: str = "cuModuleLoadData"):
    """A module from a CUBIN or PTX image in memory."""
    return check(cu.cuModuleLoadData(image), what)


def get_function(module, name: str):
    """A kernel of the module, loaded now (not at first launch, when a persistent kernel may run)."""
    fn = check(cu.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
    check(cu.cuFuncLoad(fn), f"cuFuncLoad({name})")
    return fn


def function_attribute(function, name: str) -> int:
    """A CUfunction_attribute by name, e.g. "CU_FUNC_ATTRIBUTE_NUM_REGS"."""
    attr = getattr(cu.CUfunction_attribute, name)
    return int(check(cu.cuFuncGetAttribute(attr, function), f"cuFuncGetAttribute({name})"))


def set_function_attribute(function, name: str, value: int) -> None:
    """Sets a CUfunction_attribute by name, e.g. "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES"."""
    attr = getattr(cu.CUfunction_attribute, name)
    check(cu.cuFuncSetAttribute(function, attr, int(value)), f"cuFuncSetAttribute({name})")


def create_event(*, timing: bool = True, blocking_sync: bool = False):
    """A raw event handle; timing events can give elapsed_ms."""
    flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
    if blocking_sync:
        flags = int(flags) | int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
    return check(cu.cuEventCreate(int(flags)), "cuEventCreate")


def record_event(event, stream) -> None:
    check(cu.cuEventRecord(event, stream), "cuEventRecord")


def elapsed_ms(start, end) -> float:
    return float(check(cu.cuEventElapsedTime(start, end), "cuEventElapsedTime"))


def destroy_event(event) -> None:
    check(cu.cuEventDestroy(event), "cuEventDestroy")


class BlockingEvent:
    """An event whose synchronize sleeps in the driver instead of spinning a host core."""

    def __init__(self):
        self.handle = create_event(timing=False, blocking_sync=True)

    def record(self, stream) -> None:
        record_event(self.handle, stream)

    def synchronize(self) -> None:
        check(cu.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def destroy(self) -> None:
        if self.handle is not None:
            destroy_event(self.handle)
            self.handle = None


def copy_to_device(dst: int, src: int, nbytes: int, stream) -> None:
    check(cu.cuMemcpyHtoDAsync(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")


def copy_to_host(dst: int, src: int, nbytes: int, stream) -> None:
    check(cu.cuMemcpyDtoHAsync(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")


def create_graph():
    return check(cu.cuGraphCreate(0), "cuGraphCreate")


def instantiate_graph(graph, *, device_launch: bool = False):
    """device_launch: a kernel may launch the result too (cudaGraphLaunch in device code); it
    must be uploaded before the device launches it."""
    flags = int(cu.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH) if device_launch else 0
    return check(cu.cuGraphInstantiate(graph, flags), "cuGraphInstantiate")


def launch_graph(graph_exec, stream) -> None:
    check(cu.cuGraphLaunch(graph_exec, stream), "cuGraphLaunch")


def destroy_graph(graph) -> None:
    check(cu.cuGraphDestroy(graph), "cuGraphDestroy")


def destroy_graph_exec(graph_exec) -> None:
    check(cu.cuGraphExecDestroy(graph_exec), "cuGraphExecDestroy")


def add_child_graph_node(graph, deps: list, child):
    """A node that runs a clone of child (the driver copies it now)."""
    return check(
        cu.cuGraphAddChildGraphNode(graph, deps or None, len(deps), child), "cuGraphAddChildGraphNode"
    )


def upload_graph(graph_exec, stream) -> None:
    """Moves an instantiated graph's device work to the GPU now rather than at its first launch."""
    check(cu.cuGraphUpload(graph_exec, stream), "cuGraphUpload")
    synchronize(stream)


def read_graph(graph):
    """The graph's nodes (GraphNode tree, child graphs expanded) and its programmatic edges."""
    graph = cu.CUgraph(int(graph))
    return _read_nodes(graph), _programmatic_edges(graph)


def _node_kinds(graph) -> list:
    """[(node handle, CUgraphNodeType)] of the graph's own nodes (child graphs not expanded)."""
    _, count = check(cu.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    if not count:
        return []
    handles, count = check(cu.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
    return [(h, check(cu.cuGraphNodeGetType(h), "cuGraphNodeGetType")) for h in list(handles)[: int(count)]]


def node_types(graph) -> list[str]:
    """The type names of the graph's own nodes, e.g. ["CU_GRAPH_NODE_TYPE_KERNEL"]."""
    return [getattr(kind, "name", str(kind)) for _, kind in _node_kinds(graph)]


def _read_nodes(graph) -> list:
    from ringleader.device.backends.cuda_graph_rules import GraphNode

    nodes = []
    for h, kind in _node_kinds(graph):
        node = GraphNode(getattr(kind, "name", str(kind)))
        if kind == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_GRAPH:
            node.children = _read_nodes(
                check(cu.cuGraphChildGraphNodeGetGraph(h), "cuGraphChildGraphNodeGetGraph")
            )
        nodes.append(node)
    return nodes


def _programmatic_edges(graph) -> int:
    """-1 when the driver or bindings cannot say (the count is informative, not a gate)."""
    try:
        return _count_programmatic_edges(graph)
    except (CudaError, TypeError, AttributeError):
        return -1


def _count_programmatic_edges(graph) -> int:
    _, _, _, n = check(cu.cuGraphGetEdges(graph, 0), "cuGraphGetEdges")
    if not n:
        return 0
    _, _, data, n = check(cu.cuGraphGetEdges(graph, n), "cuGraphGetEdges")
    programmatic = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    return sum(1 for d in list(data)[: int(n)] if d is not None and d.type == programmatic)


class KernelArgs:
    """Raw kernel parameters: each argument's bytes kept alive, and the array of their addresses."""

    def __init__(self, *args: bytes | ctypes._SimpleCData | ctypes.Array):
        self._keep = []
        addrs = []
        for a in args:
            buf = ctypes.create_string_buffer(bytes(a), len(bytes(a))) if isinstance(a, bytes) else a
            self._keep.append(buf)
            addrs.append(ctypes.addressof(buf))
        self._addrs = (ctypes.c_void_p * len(addrs))(*addrs)

    @property
    def pointer(self) -> int:
        return ctypes.addressof(self._addrs)


def launch(function, args: KernelArgs, stream, *, grid: int = 1, block: int = 1, shared: int = 0):
    """shared: the launch's dynamic shared memory in bytes (above the function's
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES only once set_function_attribute raised it)."""
    check(
        cu.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, shared, stream, args.pointer, 0),
        "cuLaunchKernel",
    )


def kernel_node_params(function, args: KernelArgs, *, grid: int = 1, block: int = 1, shared: int = 0):
    """shared: the launch's dynamic shared memory in bytes."""
    p = cu.CUDA_KERNEL_NODE_PARAMS()
    p.func = function
    p.gridDimX, p.gridDimY, p.gridDimZ = grid, 1, 1
    p.blockDimX, p.blockDimY, p.blockDimZ = block, 1, 1
    p.sharedMemBytes = shared
    p.kernelParams = args.pointer
    p.extra = 0
    return p


def add_kernel_node(graph, deps: list, function, args: KernelArgs, *, grid=1, block=1, shared=0):
    params = kernel_node_params(function, args, grid=grid, block=block, shared=shared)
    return check(cu.cuGraphAddKernelNode(graph, deps or None, len(deps), params), "cuGraphAddKernelNode")


def clone_graph(graph):
    """A copy of graph (its child graphs copied too) that may be changed apart from it."""
    return check(cu.cuGraphClone(cu.CUgraph(int(graph))), "cuGraphClone")


def graph_sinks(graph) -> list[tuple[object, bool]]:
    """The graph's own nodes that nothing depends on, each with whether it is a kernel node."""
    kinds = _node_kinds(graph)
    _, _, _, n = check(cu.cuGraphGetEdges(graph, 0), "cuGraphGetEdges")
    sources = set()
    if n:
        froms, _, _, n = check(cu.cuGraphGetEdges(graph, n), "cuGraphGetEdges")
        sources = {int(f) for f in list(froms)[: int(n)]}
    kernel = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
    return [(h, kind == kernel) for h, kind in kinds if int(h) not in sources]


def add_kernel_node_after(graph, deps: list, function, args: KernelArgs, *, programmatic: bool):
    """A one-thread kernel node after every node of deps; with programmatic, each edge is a
    programmatic one (the node may start once its predecessors' blocks have all triggered or
    exited, and must wait for their completion itself: griddepcontrol.wait), which CUDA allows
    between kernel nodes only (sm_90+)."""
    if not programmatic:
        return add_kernel_node(graph, deps, function, args)
    node = add_kernel_node(graph, [], function, args)
    edge = cu.CUgraphEdgeData()
    edge.type = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    edge.from_port = cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    check(
        cu.cuGraphAddDependencies(graph, deps, [node] * len(deps), [edge] * len(deps), len(deps)),
        "cuGraphAddDependencies(programmatic)",
    )
    return node


def add_conditional_node(graph, deps: list, handle, kind, size: int, ctx):
    """Adds a WHILE/SWITCH node; returns (node, [body graphs])."""
    p = cu.CUgraphNodeParams()
    p.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    p.conditional.handle = handle
    p.conditional.type = kind
    p.conditional.size = size
    p.conditional.ctx = ctx
    try:
        node = check(
            cu.cuGraphAddNode(graph, deps or None, None, len(deps), p), "cuGraphAddNode(conditional)"
        )
    except TypeError:  # bindings before dependencyData (12.3)
        node = check(cu.cuGraphAddNode(graph, deps or None, len(deps), p), "cuGraphAddNode(conditional)")
    return node, [p.conditional.phGraph_out[i] for i in range(size)]


def conditional_handle(graph, ctx, default: int, assign_default: bool = True):
    """A WHILE/SWITCH handle; with assign_default it is reset to default at each graph launch."""
    flags = cu.CU_GRAPH_COND_ASSIGN_DEFAULT if assign_default else 0
    return check(
        cu.cuGraphConditionalHandleCreate(graph, ctx, default, flags), "cuGraphConditionalHandleCreate"
    )


def handle_arg(handle) -> ctypes.c_uint64:
    return ctypes.c_uint64(int(handle))
