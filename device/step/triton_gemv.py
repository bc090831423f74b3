"""The decode step's projections with their pointwise work inside: four skinny-GEMM kernels.

For the 1 to 32 rows of a decode step a projection reads its whole weight to make a few rows
of output, so its time is the weight's bytes over the memory bandwidth, and what a layer of
separate kernels adds is the kernel boundaries: each one stops the weight stream, pays a launch
inside the graph and re-reads the activations. Here every projection is one Triton kernel that
does the pointwise work around it as a prologue or an epilogue:

  qkv_rope_store   RMSNorm of the residual stream as the prologue; bias, RoPE and the k/v store
                   into the paged cache as the epilogue (a program owns the two half-columns of a
                   head that RoPE pairs); returns the rotated q.
  gate_up_silu     RMSNorm prologue; silu(gate) * up epilogue (a program owns the same columns
                   of the gate and of the up half).
  add_projection   y = a @ W.T (+ bias) added into the residual stream in place: the o and down
                   projections. Split along K when the output tiles alone would not fill the
                   GPU: each split writes a float32 partial, and the split that arrives last at
                   its tile (a ticket counter, reset by that split for the next replay) sums the
                   partials in split order (deterministic) and does the residual add.
  lm_head_argmax   RMSNorm prologue on the sampled rows (gathered by index); the logits, and
                   each row's argmax reduced inside the kernel: every program writes its tile's
                   (max, first index), and the last to arrive reduces them to `greedy_token`.

A layer is then qkv_rope_store, attention, add_projection (o), gate_up_silu, add_projection
(down): five kernels. The RMSNorm prologue needs each row's rsqrt(mean(x^2)), so each program
first reads its rows once (from L2: the residual rows are hidden * 2 bytes each).

Weights: dense [N, K] (float32, bfloat16, float16; bf16 weights beside fp32 activations
multiply in bf16 as dense_matmul does) or int4 digits packed as
device/weights/triton_quant_matmul.py packs them (`FusedWeight`). One row (bucket 1): the
products on the FMA units ([1, BLOCK_N, BLOCK_K] broadcast and sum); more rows: tl.dot on
16- or 32-row blocks (the missing rows masked; the tensor cores' spare work is free at
this arithmetic intensity). Weight tiles are K-contiguous rows, loaded 16 bytes at a time.

Rounding follows the layered step wherever it rounds: the projection's output in the weight's
dtype, then the activations' (`dense_matmul`), the normed row before the weight multiply, silu
before the product, the residual add; RoPE in fp32 from the rounded projection, rounded once
(as triton_fused.rope_store_kv). Only the summation order differs from cuBLAS: parity with the
layered step is margin-aware, not bitwise.

Programmatic dependent launch (`USE_PDL`, sm_90+): before `gdc_wait` a program only prefetches
its first weight tiles into L2 (weights are never written by a step), so the next kernel's
weight stream starts during this one's tail; everything that reads or writes activations, the
cache or the counters comes after the wait.

Everything is static (grids from the bucket and the shapes, pages and rows read on the device,
no host sync), so each kernel captures into the step's CUDA graph. Launches go through
triton_launch.launch (counted on the meta device; bench/lab/triton_aot.py compiles them ahead
of time). Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the layered step's torch path still works
    triton = None
    tl = None

HAVE_TRITON = triton is not None

FUSED_MAX_ROWS = 32  # buckets up to this many rows take the fused kernels
DOT_MIN = 16  # tl.dot's least block edge


@dataclass(frozen=True)
class FusedWeight:
    """A projection's weight as the fused kernels read it: dense [N, K] with K contiguous, or
    int4 digits (packed uint8 [D, N, K / 2], scale and zero [D, N, K / G])."""

    n: int
    k: int
    dense: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    group: int = 0

    @classmethod
    def of(cls, projection: Any) -> FusedWeight | None:
        """The weight behind an nn.Linear, a KernelLinear of one band (int4 digits, or dense:
        a GGUF type widened at load), or a bound TritonInt4Weight.matmul (a tied quantized
        head); None where the fused kernels cannot read it: row bands of mixed kinds (a Q4_K_M
        file's q|k|v with v in Q6_K), or anything else."""
        from ringleader.device.weights.triton_quant_matmul import TritonInt4Weight

        owner = getattr(projection, "__self__", None)
        if isinstance(owner, TritonInt4Weight):
            return cls.from_int4(owner)
        weight = getattr(projection, "weight", None)
        if isinstance(weight, torch.Tensor):
            return cls.from_dense(weight)
        bands = getattr(projection, "bands", None)
        if bands is not None and len(bands) == 1:
            band = bands[0]
            owner = getattr(band, "__self__", None)
            if isinstance(owner, TritonInt4Weight):
                return cls.from_int4(owner)
            if isinstance(getattr(band, "weight", None), torch.Tensor):  # a DenseMatmul band
                return cls.from_dense(band.weight)
        return None

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> FusedWeight | None:
        if weight.dim() != 2 or weight.stride(1) != 1:
            return None
        return cls(weight.shape[0], weight.shape[1], dense=weight)

    @classmethod
    def from_int4(cls, w: Any) -> FusedWeight:
        return cls(w.n, w.k, packed=w.packed, scale=w.scale, zero=w.zero, group=w.group_size)

    @property
    def is_int4(self) -> bool:
        return self.packed is not None

    def args(self) -> tuple:
        """w_ptr, scale_ptr, zero_ptr, stride_wd, stride_wn, stride_sd, stride_sn."""
        if self.packed is None:
            assert self.dense is not None
            d = self.dense
            return d, d, d, 0, d.stride(0), 0, 0
        assert self.scale is not None and self.zero is not None
        p, s = self.packed, self.scale
        return p, s, self.zero, p.stride(0), p.stride(1), s.stride(0), s.stride(1)

    def meta(self) -> dict[str, Any]:
        if self.packed is None:
            return dict(W_INT4=False, N_DIGITS=1, GROUP=32)
        return dict(W_INT4=True, N_DIGITS=self.packed.shape[0], GROUP=self.group)


if HAVE_TRITON:

    @triton.jit
    def _prefetch_l2(ptrs):
        # warms L2 with a weight tile before gdc_wait: weights are never written by a step
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )

    @triton.jit
    def _row_rstd(a_ptr, rows, t_ok, stride_at, K, eps, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
        """rsqrt(mean(x^2) + eps) of each of the program's rows, in fp32 (torch's rms_norm)."""
        squares = tl.zeros([BLOCK_T], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                a_ptr + rows[:, None] * stride_at + ks[None, :],
                mask=t_ok[:, None] & (ks < K)[None, :],
                other=0.0,
            ).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
        return tl.rsqrt(squares / K + eps)

    @triton.jit
    def _input_tile(a_ptr, rows, t_ok, stride_at, ks, k_ok, normw_ptr, rstd, NORM: tl.constexpr):
        """The activations' [BLOCK_T, len(ks)] tile, normed (RMSNorm with its weight) if NORM."""
        a = tl.load(
            a_ptr + rows[:, None] * stride_at + ks[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0
        )
        if NORM:
            w = tl.load(normw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            # rounded to x's dtype before the weight multiply, as rms_norm does
            n = (a.to(tl.float32) * rstd[:, None]).to(a.dtype).to(tl.float32)
            a = (n * w[None, :]).to(a.dtype)
        return a

    @triton.jit
    def _times(acc, a, w, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """acc [BLOCK_T, BLOCK_N] += a [BLOCK_T, BK] @ w [BLOCK_N, BK].T in w's dtype."""
        if USE_DOT:
            acc = tl.dot(a.to(w.dtype), tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:
            acc += tl.sum(a.to(w.dtype).to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        return acc

    @triton.jit
    def _int4_tile(w_ptr, scale_ptr, zero_ptr, cols, n_ok, group, stride_wd, stride_wn, stride_sd, stride_sn,
                   N_DIGITS: tl.constexpr, HALF_G: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        """A group's W tile of BLOCK_N rows as its low-nibble and high-nibble halves [BLOCK_N,
        G / 2] in fp32: codes * scale + zero, summed over the digits."""
        js = tl.arange(0, HALF_G)
        w_lo = tl.zeros([BLOCK_N, HALF_G], dtype=tl.float32)
        w_hi = tl.zeros([BLOCK_N, HALF_G], dtype=tl.float32)
        for d in tl.static_range(N_DIGITS):
            at = w_ptr + d * stride_wd + cols[:, None] * stride_wn + group * HALF_G + js[None, :]
            byte = tl.load(at, mask=n_ok[:, None], other=0)
            s_at = d * stride_sd + cols * stride_sn + group
            scale = tl.load(scale_ptr + s_at, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            zero = tl.load(zero_ptr + s_at, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            w_lo += (byte & 15).to(tl.float32) * scale + zero
            w_hi += (byte >> 4).to(tl.float32) * scale + zero
        return w_lo, w_hi

    @triton.jit
    def _prefetch_first(w_ptr, stride_wd, stride_wn, cols_a, cols_b, n_ok_a, n_ok_b, k_first,
                        TWO: tl.constexpr, W_INT4: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """L2 prefetch of the program's first K tile (one address per 128-byte line is plenty,
        but a per-row address is simpler and the tile is small)."""
        col = k_first // 2 if W_INT4 else k_first
        _prefetch_l2(w_ptr + tl.where(n_ok_a, cols_a, 0) * stride_wn + col)
        if TWO:
            _prefetch_l2(w_ptr + tl.where(n_ok_b, cols_b, 0) * stride_wn + col)

    @triton.jit
    def _start(w_ptr, stride_wd, stride_wn, cols_a, cols_b, n_ok_a, n_ok_b, k_first, TWO: tl.constexpr,
               W_INT4: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
        """With PDL: the first weight tiles into L2, then wait for the kernel before (everything
        after reads what it wrote) and let the next one launch (it waits for this one's end)."""
        if USE_PDL:
            _prefetch_first(
                w_ptr, stride_wd, stride_wn, cols_a, cols_b, n_ok_a, n_ok_b, k_first, TWO, W_INT4, BLOCK_K
            )
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _project(acc_a, acc_b, a_ptr, rows, t_ok, stride_at, normw_ptr, rstd, k_first, k_last, K,
                 w_ptr, scale_ptr, zero_ptr, stride_wd, stride_wn, stride_sd, stride_sn,
                 cols_a, cols_b, n_ok_a, n_ok_b,
                 NORM: tl.constexpr, TWO: tl.constexpr, W_INT4: tl.constexpr, N_DIGITS: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):  # fmt: skip
        """acc_a (and acc_b if TWO) += the input's K range [k_first, k_last) times W's rows
        cols_a (cols_b)."""
        for k0 in range(k_first, k_last, BLOCK_K):
            if W_INT4:
                HALF_G: tl.constexpr = GROUP // 2
                for g in tl.static_range(BLOCK_K // GROUP):
                    kg = k0 + g * GROUP
                    ks = kg + tl.arange(0, HALF_G)
                    k_ok = ks < K
                    a_lo = _input_tile(a_ptr, rows, t_ok, stride_at, ks, k_ok, normw_ptr, rstd, NORM)
                    a_hi = _input_tile(a_ptr, rows, t_ok, stride_at, ks + HALF_G, k_ok, normw_ptr, rstd, NORM)
                    group = kg // GROUP
                    w_lo, w_hi = _int4_tile(
                        w_ptr, scale_ptr, zero_ptr, cols_a, n_ok_a, group, stride_wd, stride_wn, stride_sd,
                        stride_sn, N_DIGITS, HALF_G, BLOCK_N,
                    )  # fmt: skip
                    # W rounded to the activations' dtype, as the int4 matmul feeds its dot
                    acc_a = _times(acc_a, a_lo, w_lo.to(a_lo.dtype), USE_DOT, DOT_PRECISION)
                    acc_a = _times(acc_a, a_hi, w_hi.to(a_hi.dtype), USE_DOT, DOT_PRECISION)
                    if TWO:
                        w_lo, w_hi = _int4_tile(
                            w_ptr, scale_ptr, zero_ptr, cols_b, n_ok_b, group, stride_wd, stride_wn,
                            stride_sd, stride_sn, N_DIGITS, HALF_G, BLOCK_N,
                        )  # fmt: skip
                        acc_b = _times(acc_b, a_lo, w_lo.to(a_lo.dtype), USE_DOT, DOT_PRECISION)
                        acc_b = _times(acc_b, a_hi, w_hi.to(a_hi.dtype), USE_DOT, DOT_PRECISION)
            else:
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                a = _input_tile(a_ptr, rows, t_ok, stride_at, ks, k_ok, normw_ptr, rstd, NORM)
                w = tl.load(w_ptr + cols_a[:, None] * stride_wn + ks[None, :], mask=n_ok_a[:, None] & k_ok[None, :],
                            other=0.0)  # fmt: skip
                acc_a = _times(acc_a, a, w, USE_DOT, DOT_PRECISION)
                if TWO:
                    w = tl.load(w_ptr + cols_b[:, None] * stride_wn + ks[None, :],
                                mask=n_ok_b[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
                    acc_b = _times(acc_b, a, w, USE_DOT, DOT_PRECISION)
        return acc_a, acc_b

    @triton.jit
    def _normed_pair(a_ptr, rows, t_ok, stride_at, K, eps, normw_ptr,
                     w_ptr, scale_ptr, zero_ptr, stride_wd, stride_wn, stride_sd, stride_sn, cols_a, cols_b, n_ok,
                     W_INT4: tl.constexpr, N_DIGITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):  # fmt: skip
        """rms_norm(the rows) @ W's rows cols_a and cols_b: two [BLOCK_T, BLOCK_N] fp32 sums."""
        rstd = _row_rstd(a_ptr, rows, t_ok, stride_at, K, eps, BLOCK_T, BLOCK_K)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        return _project(
            acc, acc, a_ptr, rows, t_ok, stride_at, normw_ptr, rstd, 0, K, K,
            w_ptr, scale_ptr, zero_ptr, stride_wd, stride_wn, stride_sd, stride_sn, cols_a, cols_b, n_ok, n_ok,
            True, True, W_INT4, N_DIGITS, GROUP, BLOCK_N, BLOCK_K, USE_DOT, DOT_PRECISION,
        )  # fmt: skip

    @triton.jit
    def _projected(acc, w_ptr, act_dtype: tl.constexpr, W_INT4: tl.constexpr):
        """The projection's output as the layered step rounds it: in a dense weight's dtype,
        then the activations' (dense_matmul); int4 digits: straight to the activations'."""
        if W_INT4:
            return acc.to(act_dtype)
        return acc.to(w_ptr.dtype.element_ty).to(act_dtype)


def _pow2_at_most(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def rows_block(rows: int) -> int:
    """The row block of a bucket: 1 (the FMA path), else 16 or 32 (tl.dot's blocks)."""
    if not 0 < rows <= FUSED_MAX_ROWS:
        raise ValueError(f"the fused kernels take 1 to {FUSED_MAX_ROWS} rows, got {rows}")
    return 1 if rows == 1 else 16 if rows <= 16 else 32


def tile_meta(rows: int, block_n: int, weight: FusedWeight, act_dtype: torch.dtype) -> dict[str, Any]:
    """The constexprs of a projection's tile: rows block, K block, dot or FMA, dot precision.

    Picked to compile without spills on sm_80-90 (bench/lab/triton_aot.py), untuned on a GPU:
    a dense K block is 256 bytes of a weight row (128 bf16, 64 fp32), shrunk on the FMA path so
    the [rows, BLOCK_N, BLOCK_K] product stays at most 8192 elements (64 registers a thread on 4
    warps); an int4 K block is two groups (one where K holds an odd number, or beside fp32
    activations on the dot path)."""
    block_t = rows_block(rows)
    use_dot = block_t >= DOT_MIN and block_n >= DOT_MIN
    if weight.is_int4:  # whole groups that divide K: no group past a row's end is ever read
        block_k = 2 * weight.group if weight.k % (2 * weight.group) == 0 else weight.group
        if act_dtype == torch.float32 and block_t > 1:
            block_k = weight.group  # tf32x3 dots of two digits' tiles: one group keeps them spill-free
    else:
        assert weight.dense is not None
        block_k = 256 // weight.dense.element_size()
        if use_dot and block_t > 16 and act_dtype == torch.float32:
            block_k = 32  # tf32x3 splits each operand in two: half the K tile keeps it spill-free
        if not use_dot:
            block_k = max(16, min(block_k, _pow2_at_most(8192 // (block_t * block_n), 256)))
    # float32: three tf32 passes keep float32's precision on the tensor cores
    precision = "tf32x3" if act_dtype == torch.float32 else "tf32"
    # 32-row blocks hold two [32, BLOCK_N] fp32 accumulators and the dot's operands: 8 warps
    warps = 8 if block_t > 16 else 4
    meta = dict(BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot, DOT_PRECISION=precision)
    if weight.is_int4 and act_dtype == torch.float32 and use_dot:
        # int4 digits into tf32x3 dots hold the most live values: ptxas's own register target
        # spilled a few on sm_80 and sm_87 (bench/lab/triton_aot.py); four warps may take 255
        warps, meta["maxnreg"] = 4, 255
    return {**meta, "num_warps": warps}
