"""Checks made before the CUDA backend touches the GPU: settings that break a persistent kernel,
and whether the asked KV cache fits in device memory.  Pure functions, testable anywhere."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20
CTX_GRANULE = 256  # an automatically sized context is a multiple of this many tokens
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
    """The KV cache that fits: slots x context, and the arithmetic behind it (bytes)."""

    n_slots: int
    max_ctx: int
    kv_bytes: int
    bytes_per_token: int
    budget_bytes: int
    workspace_bytes: int


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
    free_bytes: int,
    total_bytes: int,
    fraction: float,
    workspace_bytes: int,
) -> MemoryPlan:
    """Sizes the cache from free device memory.  Of `fraction` of the device, what is already in
    use (weights, other processes) and the step's workspace are taken first; the KV cache gets
    the rest.  max_ctx None picks the longest context that fits (capped by the model's); a
    given max_ctx that does not fit is an error that says what would."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {fraction}")
    used = total_bytes - free_bytes
    budget = int(fraction * total_bytes) - used - workspace_bytes
    rows = n_slots + 1  # + the scratch slot that pad rows write to
    fits_ctx = max(0, budget) // (rows * bytes_per_token)
    where = (
        f"{_gib(max(0, budget))} is left for it: --gpu-memory-fraction {fraction} of "
        f"{_gib(total_bytes)}, less {_gib(used)} already in use (the weights and anything "
        f"else on the device) and about {_gib(workspace_bytes)} for the step's workspace"
    )
    if max_ctx is None:
        ctx = min(model_max_ctx, fits_ctx // CTX_GRANULE * CTX_GRANULE)
        if ctx < CTX_GRANULE:
            raise MemoryError(
                f"no KV cache fits: {n_slots} slots need {_gib(rows * bytes_per_token * CTX_GRANULE)} "
                f"for even {CTX_GRANULE} tokens each; {where}; lower --slots"
            )
        max_ctx = ctx
    need = rows * max_ctx * bytes_per_token
    if need > budget:
        slots_fit = max(0, budget // (max_ctx * bytes_per_token) - 1)
        raise MemoryError(
            f"the KV cache does not fit: {n_slots} slots x {max_ctx} tokens (+1 scratch slot) x "
            f"{bytes_per_token / 1024:.1f} KiB per token = {_gib(need)}, and {where}. At "
            f"--max-ctx {max_ctx} at most {slots_fit} slots fit; at --slots {n_slots} at most "
            f"{fits_ctx} tokens per slot"
        )
    return MemoryPlan(n_slots, max_ctx, need, bytes_per_token, budget, workspace_bytes)


def plan_model_kv_cache(
    config,
    *,
    n_slots: int,
    max_ctx: int | None,
    token_budget: int,
    dtype_bytes: int,
    bytes_per_token: int,
    free_bytes: int,
    total_bytes: int,
    fraction: float,
) -> MemoryPlan:
    """plan_kv_cache for a model (its ModelConfig), its step's workspace estimated from its
    shapes: what CudaBackend sizes at start, and what bench/triton_aot.py plans ahead."""
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
        free_bytes=free_bytes,
        total_bytes=total_bytes,
        fraction=fraction,
        workspace_bytes=workspace,
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{math.ceil(n / MIB)} MiB"
