"""Ragged causal attention over a per-slot KV cache, as one graph-capturable Triton launch.

Each of the T rows (a decode token or one row of a prefill chunk) attends over its own slot's
cache positions [0, positions[row]] (its own k/v are already written there). One program runs
per (row, kv head) and handles the q_per_kv query heads sharing that kv head together (GQA),
walking the slot's cache in BLOCK_N blocks only up to the row's own context end with an online
softmax in fp32, so the cost follows each row's real context and not max_ctx.

Everything the launch depends on is static: the grid is (T, n_kv_heads) with T the bucket size,
the loop bound is read on the device, and pad rows (slot_of < 0) run zero iterations and write
zeros. So the same launch can be captured once per bucket in a CUDA graph. Nothing syncs with
the host; the first call for a dtype / head shape compiles (do it before capturing).

`ragged_attention_reference` is the same function in plain torch (masked over max_ctx): the
CPU path and the reference in tests.

Under TRITON_INTERPRET=1 (set before this module is imported) the kernel runs on CPU tensors.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference still works
    triton = None
    tl = None

HAVE_TRITON = triton is not None


def ragged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_of: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D]; k/v_cache [S, C, KV, D]; slot_of/positions [T] -> o [T, H, D] (q.dtype).

    Static shapes only (a [T, C] mask), so it is capturable too, but it gathers T full-length
    caches: meant for the CPU and for tests, not for speed.
    """
    T, H, D = q.shape
    C, KV = k_cache.shape[1], k_cache.shape[2]
    G = H // KV
    live = slot_of >= 0
    slot = torch.where(live, slot_of, torch.zeros_like(slot_of)).long()
    k = k_cache.index_select(0, slot).float()  # [T, C, KV, D]
    v = v_cache.index_select(0, slot).float()
    scores = torch.einsum("tkgd,tckd->tkgc", q.float().view(T, KV, G, D), k) * scale
    cols = torch.arange(C, device=q.device)
    allowed = (cols[None, :] <= positions.long()[:, None]) & live[:, None]  # [T, C]
    # pad rows get one finite column so softmax stays finite; their output is zeroed below
    allowed = allowed | (~live[:, None] & (cols[None, :] == 0))
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    out = torch.einsum("tkgc,tckd->tkgd", torch.softmax(scores, dim=-1), v).reshape(T, H, D)
    return torch.where(live[:, None, None], out, torch.zeros_like(out)).to(q.dtype)


if HAVE_TRITON:

    @triton.jit
    def _ragged_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        slot_ptr,
        pos_ptr,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_ks,
        stride_kn,
        stride_kh,
        stride_kd,
        stride_vs,
        stride_vn,
        stride_vh,
        stride_vd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_slot,
        stride_pos,
        max_ctx,
        scale_log2e,
        Q_PER_KV: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        slot = tl.load(slot_ptr + row * stride_slot)
        pos = tl.load(pos_ptr + row * stride_pos)
        live = slot >= 0
        # pad rows: an empty loop, so they read no cache at all
        n_ctx = tl.where(live, tl.minimum(pos + 1, max_ctx), 0)
        slot64 = tl.where(live, slot, 0).to(tl.int64)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_ok = offs_g < Q_PER_KV
        d_ok = offs_d < HEAD_DIM
        heads = kvh * Q_PER_KV + offs_g
        gd_ok = g_ok[:, None] & d_ok[None, :]

        q = tl.load(
            q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=gd_ok,
            other=0.0,
        )
        k_base = k_ptr + slot64 * stride_ks + kvh * stride_kh
        v_base = v_ptr + slot64 * stride_vs + kvh * stride_vh

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(0, n_ctx, BLOCK_N):
            cols = start + offs_n
            c_ok = cols < n_ctx
            kt = tl.load(  # [BLOCK_D, BLOCK_N]: k transposed by addressing
                k_base + cols[None, :].to(tl.int64) * stride_kn + offs_d[:, None] * stride_kd,
                mask=d_ok[:, None] & c_ok[None, :],
                other=0.0,
            )
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale_log2e
            s = tl.where(c_ok[None, :], s, float("-inf"))
            # every block holds >= 1 valid column (start < n_ctx), so m_new is finite
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_base + cols[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd,
                mask=c_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # pad rows: 0 / 1
        tl.store(
            o_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(o_ptr.dtype.element_ty),
            mask=gd_ok,
        )


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_config(q_per_kv: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Compile-time block sizes: tl.dot wants every dimension >= 16 (query heads are padded)."""
    block_d = max(16, _next_pow2(head_dim))
    return dict(
        BLOCK_G=max(16, _next_pow2(q_per_kv)),
        BLOCK_D=block_d,
        BLOCK_N=64 if block_d <= 128 else 32,
        # fp32 is the test dtype: keep it exact instead of tf32 (ignored for bf16/fp16)
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=4,
    )


def ragged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_of: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ragged_attention_reference; slot_of/positions int32 (or int64) [T]."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; use attention='torch'")
    T, H, D = q.shape
    S, C, KV, Dk = k_cache.shape
    if H % KV or Dk != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"shapes: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    o = torch.empty_like(q) if out is None else out
    cfg = launch_config(H // KV, D, q.dtype)
    _ragged_attention_kernel[(T, KV)](
        q,
        k_cache,
        v_cache,
        o,
        slot_of,
        positions,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *o.stride(),
        slot_of.stride(0),
        positions.stride(0),
        C,
        float(scale) * 1.4426950408889634,  # exp(x) = exp2(x * log2(e))
        Q_PER_KV=H // KV,
        HEAD_DIM=D,
        **cfg,
    )
    return o


def triton_interpreted() -> bool:
    """True when the kernel was built for the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return HAVE_TRITON and type(_ragged_attention_kernel).__name__ == "InterpretedFunction"
