"""Checks made before the CUDA backend touches the GPU: settings that break a persistent kernel,
and how many KV pages fit in device memory.  Pure functions, testable anywhere."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ringleader.device.backends.kv_pool import KvPool, plan_pool

GIB = 1 << 30
MIB = 1 << 20
FIXED_RESERVE = 512 * MIB  # cuBLAS workspaces, Triton, the CUDA context's own growth


class UnsafeEnvironment(RuntimeError):
    """A setting under which the device scheduler would hang or fail; the message names it."""


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in ("", "0", "false", "no", "off")


def environment_hazards(environ=None) -> list[str]:
    """One sentence per setting that deadlocks or breaks a persistent scheduler kernel."""
    env = os.environ if environ is None else environ
    found = []
    if _truthy(env.get("CUDA_LAUNCH_BLOCKING")):
        found.append(
            f"CUDA_LAUNCH_BLOCKING={env['CUDA_LAUNCH_BLOCKING']}: every launch then waits "
            "for its kernel to end, and the persistent scheduler kernel never ends, so "
            "start-up would hang; unset it (or use --scheduler host)"
        )
    if _truthy(env.get("PYTORCH_NO_CUDA_MEMORY_CACHING")):
        found.append(
            f"PYTORCH_NO_CUDA_MEMORY_CACHING={env['PYTORCH_NO_CUDA_MEMORY_CACHING']}: every "
            "tensor free becomes a cudaFree, which waits for the whole device and so for "
            "the persistent kernel; the first free after start-up would hang; unset it"
        )
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "cudamallocasync" in env.get(name, "").replace(" ", "").lower():
            found.append(
                f"{name}={env[name]}: the cudaMallocAsync allocator puts memory-allocation "
                "nodes into captured graphs, which a conditional node's body cannot hold; "
                "drop backend:cudaMallocAsync"
            )
    return found


def refuse_unsafe_environment(environ=None, *, allocator_backend: str | None = None) -> None:
    """Raises UnsafeEnvironment listing every hazard; `allocator_backend` is torch's, once known."""
    found = environment_hazards(environ)
    if allocator_backend is not None and allocator_backend != "native":
        found.append(
            f"torch's CUDA allocator backend is {allocator_backend!r}: captured graphs "
            "would hold allocation nodes a conditional body cannot hold; use 'native'"
        )
    if found:
        raise UnsafeEnvironment("the device scheduler cannot run with " + "; and ".join(found))


@dataclass(frozen=True)
class MemoryPlan:
    """The KV page pool that fits, and the arithmetic behind it (bytes)."""

    pool: KvPool
    kv_bytes: int  # the pool and the scratch page that pad rows write into
    budget_bytes: int  # what --gpu-memory-fraction leaves for the KV cache
    workspace_bytes: int

    @property
    def max_ctx(self) -> int:
        return self.pool.max_ctx


def step_workspace_bytes(
    *,
    hidden: int,
    intermediate: int,
    q_kv_width: int,
    vocab: int,
    n_slots: int,
    token_budget: int,
    dtype_bytes: int,
) -> int:
    """A generous estimate of what the captured step graphs and sampling need besides the KV
    cache: activations of the largest bucket (twice, for temporaries) and, per sample row,
    fp32 logits with the sort and softmax scratch of sampling (about 25 bytes per entry)."""
    activations = 2 * token_budget * (4 * hidden + 3 * intermediate + q_kv_width) * dtype_bytes
    sampling = 25 * n_slots * vocab
    return activations + sampling + FIXED_RESERVE


def plan_kv_cache(
    *,
    n_slots: int,
    max_ctx: int | None,
    model_max_ctx: int,
    bytes_per_token: int,
    page_size: int,
    kv_cache_memory: int | float | None,
    free_bytes: int,
    total_bytes: int,
    fraction: float,
    workspace_bytes: int,
) -> MemoryPlan:
    """Sizes the page pool from free device memory.  Of `fraction` of the device, what is already
    in use (weights, other processes) and the step's workspace are taken first; the pool gets
    the rest, or `kv_cache_memory` of it: bytes, or a fraction of the memory free after the
    workspace.  One page more is the scratch page pad rows write into.  max_ctx None takes the
    model's limit, cut to what the pool holds; a max_ctx that not even one request of can fit is
    an error that says what would."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {fraction}")
    used = total_bytes - free_bytes
    budget = int(fraction * total_bytes) - used - workspace_bytes
    where = (
        f"{_gib(max(0, budget))} is left for it: --gpu-memory-fraction {fraction} of "
        f"{_gib(total_bytes)}, less {_gib(used)} already in use (the weights and anything "
        f"else on the device) and about {_gib(workspace_bytes)} for the step's workspace"
    )
    if isinstance(kv_cache_memory, float):
        pool_bytes = int(kv_cache_memory * max(0, free_bytes - workspace_bytes))
    elif kv_cache_memory is not None:
        pool_bytes = kv_cache_memory
        if pool_bytes > free_bytes - workspace_bytes:
            raise MemoryError(
                f"--kv-cache-memory {_gib(pool_bytes)} does not fit: {_gib(free_bytes)} of the "
                f"device is free, less about {_gib(workspace_bytes)} for the step's workspace"
            )
    else:
        pool_bytes = budget
    page_bytes = page_size * bytes_per_token
    pages = max(0, pool_bytes) // page_bytes - 1  # less the scratch page
    ctx = min(max_ctx or model_max_ctx, model_max_ctx)
    if max_ctx is None:
        ctx = min(ctx, max(page_size, pages * page_size))  # one request may take the whole pool
    try:
        pool = plan_pool(
            pool_bytes=max(0, pages) * page_bytes,
            bytes_per_token=bytes_per_token,
            page_size=page_size,
            max_ctx=ctx,
            n_slots=n_slots,
        )
    except MemoryError as exc:
        raise MemoryError(f"{exc}; on this device {where}") from None
    return MemoryPlan(pool, (pool.n_pages + 1) * page_bytes, budget, workspace_bytes)


def plan_model_kv_cache(
    config,
    *,
    n_slots: int,
    max_ctx: int | None,
    token_budget: int,
    dtype_bytes: int,
    bytes_per_token: int,
    page_size: int,
    kv_cache_memory: int | float | None,
    free_bytes: int,
    total_bytes: int,
    fraction: float,
) -> MemoryPlan:
    """plan_kv_cache for a model (its ModelConfig), its step's workspace estimated from its
    shapes: what CudaBackend sizes at start, and what bench/lab/triton_aot.py plans ahead."""
    workspace = step_workspace_bytes(
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        q_kv_width=(config.num_heads + 2 * config.num_kv_heads) * config.head_dim,
        vocab=config.vocab_size,
        n_slots=n_slots,
        token_budget=max(token_budget, n_slots),
        dtype_bytes=dtype_bytes,
    )
    return plan_kv_cache(
        n_slots=n_slots,
        max_ctx=max_ctx,
        model_max_ctx=config.max_position_embeddings,
        bytes_per_token=bytes_per_token,
        page_size=page_size,
        kv_cache_memory=kv_cache_memory,
        free_bytes=free_bytes,
        total_bytes=total_bytes,
        fraction=fraction,
        workspace_bytes=workspace,
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{math.ceil(n / MIB)} MiB"
