"""The decoder layer's pointwise ops as three fused Triton kernels, one launch each.

A decode step is captured in a CUDA graph per bucket, and what a graph replay costs is mostly
its kernel count: at decode sizes every kernel is a few microseconds of launch latency doing
almost no work. In aten the layer body is ~37 kernels (RMSNorm alone is 8: the cast, pow, mean,
add, rsqrt, mul, cast and weight mul; RoPE 5 per tensor; the casts and index_copy_ of the KV
write ...). Fused here:

  add_rms_norm   residual = x + delta, normed = rms_norm(residual): the residual add of the
                 previous sub-block and the next norm in one pass over the row.
  rope_store_kv  RoPE on q and k straight from the QKV projection's output, rotated k and raw
                 v stored into the layer's paged KV cache at the page the slot's block-table
                 row names (pad rows into a scratch page), rotated q returned: replaces the
                 split, two apply_rope, the casts and two index_copy_.
  silu_mul       silu(gate) * up of the gate_up projection's output.

A layer is then 9 kernels: add_rms_norm, the QKV GEMM, rope_store_kv, attention, the O GEMM,
add_rms_norm, the gate_up GEMM, silu_mul, the down GEMM (biases ride in the GEMMs). The torch
references, with the same contracts and the op order the kernels mirror, are in
device/model/ops.py (add_rms_norm / rms_norm, apply_rope, silu_mul): the CPU path, and the
tests' reference.

Rounding: each kernel loads in the tensor's dtype and computes in fp32. add_rms_norm and
silu_mul round wherever torch rounds (the add, the normalised row before the weight multiply,
silu before the product), so in bf16/fp16 they match torch up to fp32 ulps of rsqrt / exp that
rarely survive the final rounding. rope_store_kv computes x * cos + rotate_half(x) * sin in fp32
and rounds once, where torch in bf16/fp16 rounds each product and the sum: within half an ulp
of the exact value, so not bit-identical to apply_rope (about a third of the elements differ,
by up to ~1.5 ulps of the inputs' magnitude max(|x1|, |x2|)). fp32 matches torch to fp32 ulps.

Everything is static: grids depend on shapes only, the cache page and offset are computed on the
device from slot_of / positions and the block table, nothing syncs with the host, so all three
are capturable. Every launch goes through ringleader.device.step.triton_launch.launch, so under
a LaunchRecorder the wrappers run on meta-device tensors and are counted instead of launched.
The first call per dtype / shape / page size compiles (do it before capturing). Under
TRITON_INTERPRET=1 (set before triton is imported) the kernels run on CPU tensors.
"""

from __future__ import annotations

import torch

from ringleader.device.step.triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch ops in ops.py still work
    triton = None
    tl = None

HAVE_TRITON = triton is not None


if HAVE_TRITON:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,
        delta_ptr,
        w_ptr,
        res_ptr,
        out_ptr,
        stride_xt,
        stride_xc,
        stride_dt,
        stride_dc,
        stride_w,
        stride_rt,
        stride_ot,
        hidden,
        eps,
        HAS_DELTA: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        x = tl.load(x_ptr + row * stride_xt + cols * stride_xc, mask=ok, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * stride_dt + cols * stride_dc, mask=ok, other=0.0)
            # rounded to x's dtype as torch's add, and the norm reads the rounded residual
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_ptr + row * stride_rt + cols, x, mask=ok)
        h = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
        n = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # h.to(x.dtype) before the weight
        w = tl.load(w_ptr + cols * stride_w, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_ot + cols, (w * n).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_store_kv_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        bt_ptr,
        slot_ptr,
        pos_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        stride_xt,
        stride_xc,
        stride_ct,
        stride_cd,
        stride_st,
        stride_sd,
        stride_bt_s,
        stride_bt_m,
        stride_slot,
        stride_pos,
        stride_qt,
        stride_qh,
        stride_kp,
        stride_kn,
        stride_kh,
        stride_kd,
        stride_vp,
        stride_vn,
        stride_vh,
        stride_vd,
        max_pos,
        scratch_page,
        N_HEADS: tl.constexpr,
        N_KV: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)  # [0, N_HEADS): a q head; [N_HEADS, N_HEADS + N_KV): a kv head
        slot = tl.load(slot_ptr + row * stride_slot).to(tl.int64)
        pos = tl.minimum(tl.maximum(tl.load(pos_ptr + row * stride_pos).to(tl.int64), 0), max_pos)
        live = slot >= 0

        offs = tl.arange(0, BLOCK_HALF)
        ok = offs < HALF
        # q heads and k heads sit side by side in qkv's columns: head h starts at column h * D
        x_base = qkv_ptr + row * stride_xt + (head * 2 * HALF).to(tl.int64) * stride_xc
        x1 = tl.load(x_base + offs * stride_xc, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_base + (offs + HALF) * stride_xc, mask=ok, other=0.0).to(tl.float32)
        c_base = cos_ptr + pos * stride_ct
        s_base = sin_ptr + pos * stride_st
        c1 = tl.load(c_base + offs * stride_cd, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(c_base + (offs + HALF) * stride_cd, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(s_base + offs * stride_sd, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(s_base + (offs + HALF) * stride_sd, mask=ok, other=0.0).to(tl.float32)
        # x * cos + cat(-x2, x1) * sin, in fp32 with one rounding on store
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
        if head < N_HEADS:
            q_base = q_ptr + row * stride_qt + head * stride_qh
            tl.store(q_base + offs, o1.to(q_ptr.dtype.element_ty), mask=ok)
            tl.store(q_base + offs + HALF, o2.to(q_ptr.dtype.element_ty), mask=ok)
        else:
            # pad rows (slot_of < 0) write the scratch page at offset 0 and read no block table
            bt_entry = bt_ptr + tl.where(live, slot, 0) * stride_bt_s + (pos // PAGE_SIZE) * stride_bt_m
            page = tl.where(live, tl.load(bt_entry, mask=live, other=0).to(tl.int64), scratch_page)
            in_page = tl.where(live, pos % PAGE_SIZE, 0)
            kvh = head - N_HEADS
            k_base = k_ptr + page * stride_kp + in_page * stride_kn + kvh * stride_kh
            tl.store(k_base + offs * stride_kd, o1.to(k_ptr.dtype.element_ty), mask=ok)
            tl.store(k_base + (offs + HALF) * stride_kd, o2.to(k_ptr.dtype.element_ty), mask=ok)
            # v of this kv head: N_KV heads further right, past all of k
            v_src = x_base + (N_KV * 2 * HALF) * stride_xc
            v1 = tl.load(v_src + offs * stride_xc, mask=ok, other=0.0)
            v2 = tl.load(v_src + (offs + HALF) * stride_xc, mask=ok, other=0.0)
            v_base = v_ptr + page * stride_vp + in_page * stride_vn + kvh * stride_vh
            tl.store(v_base + offs * stride_vd, v1.to(v_ptr.dtype.element_ty), mask=ok)
            tl.store(v_base + (offs + HALF) * stride_vd, v2.to(v_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(
        gu_ptr,
        out_ptr,
        stride_gt,
        stride_gc,
        stride_ot,
        inter,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        base = gu_ptr + row * stride_gt
        g = tl.load(base + cols * stride_gc, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(base + (cols + inter) * stride_gc, mask=ok, other=0.0).to(tl.float32)
        # torch rounds silu(gate) to the dtype before the product (two ops, two roundings)
        s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_ot + cols, (s * u).to(out_ptr.dtype.element_ty), mask=ok)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _need_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; use the torch ops in device/model/ops.py")


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [T, hidden] -> (residual, normed): residual = x + delta (x itself, not a copy,
    when delta is None), normed = ops.rms_norm(residual, weight, eps) in weight * x's dtype.

    One program per row holding the whole row (hidden <= 8192 fits in registers), rows may be
    strided views.
    """
    _need_triton()
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"shapes: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} vs x {tuple(x.shape)} {x.dtype}")
    T, hidden = x.shape
    normed = torch.empty(T, hidden, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual = x if delta is None else torch.empty(T, hidden, dtype=x.dtype, device=x.device)
    d = x if delta is None else delta  # unread without HAS_DELTA: any tensor fills the slot
    block = _next_pow2(hidden)
    launch(
        _add_rms_norm_kernel,
        (T,),
        x,
        d,
        weight,
        residual,
        normed,
        *x.stride(),
        *d.stride(),
        weight.stride(0),
        residual.stride(0),
        normed.stride(0),
        hidden,
        float(eps),
        HAS_DELTA=delta is not None,
        BLOCK=block,
        # ~8-16 fp32 elements per thread at every hidden size
        num_warps=4 if block <= 2048 else 8 if block <= 4096 else 16,
    )
    return residual, normed


def rope_store_kv(
    qkv: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    block_table: torch.Tensor,
    slot_of: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scratch_page: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """RoPE on q and k of qkv [T, (H + 2 * KV) * D] (q | k | v columns), k and v into the paged
    cache, returns rotated q [T, H, D] (a new tensor in qkv's dtype).

    cos/sin_table [R, D] (ops.rope_tables, half-split convention of ops.apply_rope); block_table
    int32 (or int64) [S, M]; slot_of, positions int32 [T]; k/v_cache one layer's pages
    [P, PS, KV, D] (PS a power of two), any strides. Row t uses
    pos = clamp(positions[t], 0, min(R, M * PS) - 1) for its cos/sin row and writes page
    block_table[slot_of[t], pos // PS] at offset pos % PS; pad rows (slot_of[t] < 0) write page
    scratch_page at offset 0 and read no block table (pass cos_table[:max_ctx] to clamp at the
    step's max_ctx). k is rotated in fp32 and rounded once to the cache's dtype, v is cast to
    it. Grid (T, H + KV): one program per row and head.
    """
    _need_triton()
    H, KV, D = n_heads, n_kv_heads, head_dim
    T = qkv.shape[0]
    if D % 2 or qkv.dim() != 2 or qkv.shape[1] != (H + 2 * KV) * D or H % KV:
        raise ValueError(f"qkv {tuple(qkv.shape)} vs heads {H}, kv heads {KV}, head_dim {D}")
    P, PS = k_cache.shape[0], k_cache.shape[1]
    if tuple(k_cache.shape[2:]) != (KV, D) or v_cache.shape != k_cache.shape or PS & (PS - 1):
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} vs (pow2, {KV}, {D})")
    if cos_table.shape[1] != D or sin_table.shape != cos_table.shape or not 0 <= scratch_page < P:
        raise ValueError(f"cos/sin {tuple(cos_table.shape)}, scratch page {scratch_page} of {P}")
    if block_table.dim() != 2:
        raise ValueError(f"block table {tuple(block_table.shape)}: want [n_slots, pages per slot]")
    max_ctx = block_table.shape[1] * PS
    q = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
    launch(
        _rope_store_kv_kernel,
        (T, H + KV),
        qkv,
        cos_table,
        sin_table,
        block_table,
        slot_of,
        positions,
        q,
        k_cache,
        v_cache,
        *qkv.stride(),
        *cos_table.stride(),
        *sin_table.stride(),
        *block_table.stride(),
        slot_of.stride(0),
        positions.stride(0),
        q.stride(0),
        q.stride(1),
        *k_cache.stride(),
        *v_cache.stride(),
        min(cos_table.shape[0], max_ctx) - 1,
        scratch_page,
        N_HEADS=H,
        N_KV=KV,
        HALF=D // 2,
        BLOCK_HALF=_next_pow2(D // 2),
        PAGE_SIZE=PS,
        num_warps=1 if D <= 128 else 2,  # a head is D elements: one warp holds it
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate then up halves, any strides) -> silu(gate) * up [T, I], with
    ops.silu_mul's roundings. Grid (T, cdiv(I, BLOCK))."""
    _need_triton()
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)}: want [T, 2 * I]")
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _next_pow2(inter))
    launch(
        _silu_mul_kernel,
        (T, triton.cdiv(inter, block)),
        gate_up,
        out,
        *gate_up.stride(),
        out.stride(0),
        inter,
        BLOCK=block,
        num_warps=4,
    )
    return out
