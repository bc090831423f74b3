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
        raise CudaError(f"{what} failed: {name.decode() if name else err}: "
                        f"{text.decode() if text else ''}")
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
        self.device_ptr = int(check(cu.cuMemHostGetDevicePointer(self.host_ptr, 0),
                                    "cuMemHostGetDevicePointer"))
        raw = (ctypes.c_uint8 * nbytes).from_address(self.host_ptr)
        self.array = np.frombuffer(raw, dtype=np.uint8)
        self.array[:] = 0

    def free(self) -> None:
        if self.host_ptr:
            self.array = None
            check(cu.cuMemFreeHost(self.host_ptr), "cuMemFreeHost")
            self.host_ptr = 0


def load_cubin(cubin: bytes, arch: str):
    """Loads a module, keeping a copy of the CUBIN in the cache for inspection (cuobjdump)."""
    key = hashlib.sha256(cubin).hexdigest()[:16]
    (cache_dir() / f"rlsched-{arch}-{key}.cubin").write_bytes(cubin)
    return check(cu.cuModuleLoadData(cubin), "cuModuleLoadData")


def get_function(module, name: str):
    return check(cu.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")


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
    check(cu.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, shared, stream, args.pointer, 0),
          "cuLaunchKernel")


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
    return check(cu.cuGraphConditionalHandleCreate(graph, ctx, default, flags),
                 "cuGraphConditionalHandleCreate")


def handle_arg(handle) -> ctypes.c_uint64:
    return ctypes.c_uint64(int(handle))
