"""Checked cuda-python driver calls: pinned memory, streams, modules, launches and graph nodes.

Every call's result goes through check(), which raises with the function's name and the
driver's error string.  Kernel arguments are passed in the driver's raw form (an array of
addresses of each argument's bytes), which also carries RlContext by value.
"""

from __future__ import annotations

import ctypes
import hashlib

import numpy as np

from ipc.native import cache_dir

try:
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - the CPU backend never gets here
    cu = None


class CudaError(RuntimeError):
    pass


def check(result, what: str = "CUDA call"):
    """cuda-python returns (err, *values); raise on error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        raise CudaError(f"{what} failed: {name.decode() if name else err}: {text.decode() if text else ''}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def current_context():
    """The primary context torch made current on this thread (torch must be initialised)."""
    return check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")


def bind_context(ctx) -> None:
    """Driver calls on a new thread need the context made current there first."""
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def create_stream(highest_priority: bool = True):
    """A non-blocking stream of our own: never the legacy stream, never torch's pool."""
    least, greatest = check(cu.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
    prio = greatest if highest_priority else least
    flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
    return check(cu.cuStreamCreateWithPriority(flags, prio), "cuStreamCreateWithPriority")


def stream_done(stream) -> bool:
    err = cu.cuStreamQuery(stream)[0]
    if err == cu.CUresult.CUDA_ERROR_NOT_READY:
        return False
    check((err,), "cuStreamQuery")
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

    def free(self) -> None:
        if self.host_ptr:
            self.array = None
            check(cu.cuMemFreeHost(self.host_ptr), "cuMemFreeHost")
            self.host_ptr = 0


def driver_version() -> tuple[int, int]:
    """The CUDA version the installed driver supports, e.g. (13, 0) for an R580 driver."""
    v = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
    return v // 1000, (v % 1000) // 10


def load_module(build, driver: tuple[int, int] | None = None):
    """Loads the scheduler module from its CUBIN; if the driver refuses it, from its PTX, but
    only when that PTX is no newer than the driver accepts.  Returns (module, how it loaded)."""
    from device.sched.build import ptx_loadable

    key = hashlib.sha256(build.cubin).hexdigest()[:16]
    (cache_dir() / f"rlsched-{build.arch}-{key}.cubin").write_bytes(build.cubin)  # for cuobjdump
    try:
        return check(cu.cuModuleLoadData(build.cubin), "cuModuleLoadData(cubin)"), "cubin"
    except CudaError as cubin_error:
        driver = driver or driver_version()
        ok, why = ptx_loadable(build.nvrtc_version, driver)
        if not build.ptx or not ok:
            raise CudaError(
                f"the driver refused the scheduler's {build.arch} CUBIN ({cubin_error}) "
                f"and the PTX fallback is not possible: {why or 'no PTX'}"
            ) from cubin_error
        try:
            module = check(cu.cuModuleLoadData(build.ptx), "cuModuleLoadData(ptx)")
        except CudaError as ptx_error:
            raise CudaError(
                f"the driver refused the scheduler's CUBIN ({cubin_error}) and its PTX "
                f"(ISA {build.ptx_isa}: {ptx_error})"
            ) from ptx_error
        return module, f"ptx (ISA {build.ptx_isa}; the CUBIN was refused: {cubin_error})"


def get_function(module, name: str):
    """A kernel of the module, loaded now (not at first launch, when a persistent kernel may run)."""
    fn = check(cu.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
    check(cu.cuFuncLoad(fn), f"cuFuncLoad({name})")
    return fn


class BlockingEvent:
    """An event whose synchronize sleeps in the driver instead of spinning a host core."""

    def __init__(self):
        flags = cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC | cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(cu.cuEventCreate(int(flags)), "cuEventCreate")

    def record(self, stream) -> None:
        check(cu.cuEventRecord(self.handle, stream), "cuEventRecord")

    def synchronize(self) -> None:
        check(cu.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def destroy(self) -> None:
        if self.handle is not None:
            check(cu.cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None


def copy_to_device(dst: int, src: int, nbytes: int, stream) -> None:
    check(cu.cuMemcpyHtoDAsync(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")


def copy_to_host(dst: int, src: int, nbytes: int, stream) -> None:
    check(cu.cuMemcpyDtoHAsync(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")


def upload_graph(graph_exec, stream) -> None:
    """Moves an instantiated graph's device work to the GPU now rather than at its first launch."""
    check(cu.cuGraphUpload(graph_exec, stream), "cuGraphUpload")
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")


def read_graph(graph):
    """The graph's nodes (GraphNode tree, child graphs expanded) and its programmatic edges."""
    graph = cu.CUgraph(int(graph))
    return _read_nodes(graph), _programmatic_edges(graph)


def _read_nodes(graph) -> list:
    from device.backends.cuda_graph_rules import GraphNode

    _, count = check(cu.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    nodes = []
    if count:
        handles, count = check(cu.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
        for h in list(handles)[: int(count)]:
            kind = check(cu.cuGraphNodeGetType(h), "cuGraphNodeGetType")
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
    check(
        cu.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, shared, stream, args.pointer, 0),
        "cuLaunchKernel",
    )


def kernel_node_params(function, args: KernelArgs, *, grid: int = 1, block: int = 1):
    p = cu.CUDA_KERNEL_NODE_PARAMS()
    p.func = function
    p.gridDimX, p.gridDimY, p.gridDimZ = grid, 1, 1
    p.blockDimX, p.blockDimY, p.blockDimZ = block, 1, 1
    p.sharedMemBytes = 0
    p.kernelParams = args.pointer
    p.extra = 0
    return p


def add_kernel_node(graph, deps: list, function, args: KernelArgs, *, grid=1, block=1):
    params = kernel_node_params(function, args, grid=grid, block=block)
    return check(cu.cuGraphAddKernelNode(graph, deps or None, len(deps), params), "cuGraphAddKernelNode")


def add_conditional_node(graph, deps: list, handle, kind, size: int, ctx):
    """Adds a WHILE/SWITCH node; returns (node, [body graphs])."""
    p = cu.CUgraphNodeParams()
    p.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    p.conditional.handle = handle
    p.conditional.type = kind
    p.conditional.size = size
    p.conditional.ctx = ctx
    node = check(cu.cuGraphAddNode(graph, deps or None, None, len(deps), p), "cuGraphAddNode(conditional)")
    return node, [p.conditional.phGraph_out[i] for i in range(size)]


def conditional_handle(graph, ctx, default: int):
    flags = cu.CU_GRAPH_COND_ASSIGN_DEFAULT
    return check(
        cu.cuGraphConditionalHandleCreate(graph, ctx, default, flags), "cuGraphConditionalHandleCreate"
    )


def handle_arg(handle) -> ctypes.c_uint64:
    return ctypes.c_uint64(int(handle))
