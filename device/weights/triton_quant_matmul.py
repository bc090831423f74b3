"""y = x @ W.T on CUDA for W kept as int4 digits (GGUF-derived), dequantized inside the matmul.

A weight is one or two int4 *digits* (device/weights/quant_weights.py maps the GGUF types onto
them), each
    W_d[n, k] = codes_d[n, k] * scale_d[n, k // G] + zero_d[n, k // G]      codes in [0, 15]
and W = W_0 (+ W_1). The dense W never exists in global memory: `_int4_matmul_kernel` loads a
group's packed codes for BLOCK_N output rows, turns them into W's [G, BLOCK_N] tile in
registers (float32, both digits summed there, so W is rounded once, to the dot's dtype) and
feeds tl.dot; the accumulator is float32 and y leaves in x's dtype.

Packing: two codes a byte, by halves of each group: byte j of group g (row n) holds code
g*G + j in its low nibble and code g*G + G/2 + j in its high one (GGUF's own Q4_0 / Q4_1 block
layout). A group of a row is then one contiguous run of G/2 bytes (vectorized, coalesced
loads), and a byte's two nibbles are used by the thread that loaded it with the same scale and
zero: the low nibbles multiply x's columns g*G + [0, G/2), the high ones g*G + [G/2, G), as two
dots, with no interleave or shuffle of registers (pairs of neighbouring codes would need one).

Small M (decode, 1 to 16 rows): tl.dot wants 16 rows at least, so the block is 16 rows, the
missing ones masked (read as 0, never stored). The tensor cores then do up to 16x the needed
work, which costs nothing: decode is bound by reading the weight. What does matter is reading
it with the whole GPU: a few rows give only cdiv(N, BLOCK_N) programs, fewer than the SMs for
most projections (llama-8b's o / down: 64 on 132 SMs), so K is split (`choose_splits`): each
of n_splits programs of an output tile walks its own run of K tiles and writes a float32
partial, and one torch reduction sums them in a fixed order (deterministic, unlike atomics).
The split count depends only on static sizes and the GPU, so a CUDA graph replays the same
launches, and a weight under MIN_SPLIT_K * 2 columns is never split (the reduction would cost
more than it saves). Prefill rows get 32- and 64-row blocks (`launch_config`).

float32 x: the dot is "tf32x3" (three tf32 tensor-core passes: float32's precision; an "ieee"
dot on the FMA units takes every register); bfloat16 / float16 x: W's tile is rounded to x's
dtype. Meant for the decode sizes; the blocks are untuned (picked to compile without spills).

`reference_matmul` is the same function in plain torch (dense float32 W): the reference in
tests. Launches go through triton_launch.launch (bench/lab/triton_aot.py compiles them ahead of
time). Under TRITON_INTERPRET=1 (set before triton is imported) the kernel runs on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringleader.device.step.triton_attention import sm_count
from ringleader.device.step.triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: packing and the reference still work
    triton = None
    tl = None

HAVE_TRITON = triton is not None

GROUP_SIZES = (32, 64, 128)
MAX_DIGITS = 2
MAX_SPLITS = 16
MIN_SPLIT_K = 1024  # K elements a split reads at least
DOT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _digit_parts(digit: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, zero) from a tuple or from an object with those attributes (a Digit)."""
    if hasattr(digit, "codes"):
        return digit.codes, digit.scale, digit.zero
    codes, scale, zero = digit
    return codes, scale, zero


def dense_digits(digits: Sequence[Any], group_size: int) -> torch.Tensor:
    """The dense float32 W [N, K] of a list of digits: sum of codes * scale + zero per group."""
    w = None
    for digit in digits:
        codes, scale, zero = _digit_parts(digit)
        w_d = codes.float() * scale.float().repeat_interleave(group_size, dim=1)
        w_d = w_d + zero.float().repeat_interleave(group_size, dim=1)
        w = w_d if w is None else w + w_d
    if w is None:
        raise ValueError("a weight needs at least one digit")
    return w


def reference_matmul(x: torch.Tensor, digits: Sequence[Any], group_size: int) -> torch.Tensor:
    """x [..., K] @ W.T with W dequantized densely in float32; y [..., N] in x's dtype."""
    w = dense_digits(digits, group_size).to(x.device)
    return (x.float() @ w.T).to(x.dtype)


def pack_codes(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 codes [N, K] in [0, 15] -> uint8 [N, K // 2]: byte j of group g holds code g*G + j
    (low nibble) and code g*G + G/2 + j (high nibble)."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).reshape(n, k // group_size, 2, group_size // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def _check_digits(digits: Sequence[Any], group_size: int) -> tuple[int, int]:
    """(N, K) of valid digits; ValueError naming what is wrong otherwise."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group size {group_size} is not one of {GROUP_SIZES}")
    if not 1 <= len(digits) <= MAX_DIGITS:
        raise ValueError(f"a weight is 1 to {MAX_DIGITS} digits, got {len(digits)}")
    shape = None
    for i, digit in enumerate(digits):
        codes, scale, zero = _digit_parts(digit)
        if codes.dim() != 2:
            raise ValueError(f"digit {i}: codes must be 2-D [N, K], got shape {tuple(codes.shape)}")
        n, k = codes.shape
        if shape is None:
            shape = (n, k)
        elif (n, k) != shape:
            raise ValueError(f"digit {i}: codes shape {(n, k)} differs from digit 0's {shape}")
        if k % group_size:
            raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise ValueError(f"digit {i}: codes must be integers (uint8), got {codes.dtype}")
        for name, t in (("scale", scale), ("zero", zero)):
            if tuple(t.shape) != (n, k // group_size):
                raise ValueError(
                    f"digit {i}: {name} shape {tuple(t.shape)} is not [N, K // G] = {(n, k // group_size)}"
                )
            if not t.dtype.is_floating_point:
                raise ValueError(f"digit {i}: {name} must be floating point, got {t.dtype}")
        if codes.device.type != "meta" and codes.numel():  # a meta weight (ahead-of-time walk) has no values
            lo, hi = int(codes.min()), int(codes.max())
            if lo < 0 or hi > 15:
                raise ValueError(f"digit {i}: codes must lie in [0, 15], got values in [{lo}, {hi}]")
    assert shape is not None
    return shape


def launch_config(m: int, k: int, group_size: int, dtype: torch.dtype) -> dict[str, Any]:
    """Block sizes for m rows of x in `dtype` (compiled ahead of time without spills for
    sm_80-90: bench/lab/triton_aot.py).

    16-row blocks (tl.dot's least) up to 16 rows, 32 up to 32, then 64 (32 on 8 warps for
    float32, whose three-pass dot holds more registers). BLOCK_K is whole groups and divides K
    (no K tail to mask): the groups of the wanted tile, halved until they divide K's groups."""
    warps = 4
    if dtype == torch.float32:
        block_m, want_k = (16, 64) if m <= 16 else (32, 32)
        warps = 4 if m <= 16 else 8
    elif m <= 32:
        block_m, want_k = (16 if m <= 16 else 32), 128
    else:
        block_m, want_k = 64, 64
    groups = max(1, want_k // group_size)
    while (k // group_size) % groups:
        groups //= 2
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=groups * group_size,
        # float32 x: three tf32 passes (hi*hi + hi*lo + lo*hi) are float32's precision on
        # the tensor cores; an "ieee" dot runs on the FMA units and takes 255 registers
        DOT_PRECISION="tf32x3" if dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=3,
    )


def choose_splits(n_programs: int, k: int, n_sms: int, fill_waves: int = 1) -> int:
    """K splits for a launch of n_programs output tiles, from static sizes only.

    1 when the programs fill fill_waves waves of the SMs already; else about two waves,
    ceil(2 * n_sms / n_programs), capped at MAX_SPLITS and so that each split reads MIN_SPLIT_K
    of K at least (a small weight is read in less time than the partials' reduction takes)."""
    if n_programs >= fill_waves * n_sms:
        return 1
    two_waves = -(-2 * n_sms // max(n_programs, 1))
    return max(1, min(two_waves, MAX_SPLITS, k // MIN_SPLIT_K))


if HAVE_TRITON:

    @triton.jit
    def _int4_matmul_kernel(
        x_ptr,
        packed_ptr,
        scale_ptr,
        zero_ptr,
        y_ptr,
        M,
        N,
        K,
        tiles_per_split,
        stride_xm,
        stride_xk,
        stride_pd,
        stride_pn,
        stride_sd,
        stride_sn,
        stride_ys,
        stride_ym,
        stride_yn,
        GROUP: tl.constexpr,
        N_DIGITS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """y[split] tile (pid_m, pid_n) = x @ W.T over K tiles [split * tiles_per_split, +tiles_per_split).

        packed: uint8 [N_DIGITS, N, K / 2] (layout: the module docstring), scale / zero:
        [N_DIGITS, N, K / GROUP] (one stride pair for both); y: [splits, M, N] (float32
        partials) or [1, M, N]. A K tile is BLOCK_K / GROUP whole groups (BLOCK_K divides K),
        unrolled: each group's W tile is [GROUP / 2, BLOCK_N] per nibble, one scale and zero a
        column."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        HALF_G: tl.constexpr = GROUP // 2
        GROUPS_PER_TILE: tl.constexpr = BLOCK_K // GROUP
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_j = tl.arange(0, HALF_G)  # a group's byte = its low nibble's column
        m_ok = offs_m < M
        n_ok = offs_n < N
        n_groups = K // GROUP
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        # W's tile transposed by addressing: [HALF_G, BLOCK_N], a column per output row
        packed_cols = packed_ptr + offs_n[None, :] * stride_pn + offs_j[:, None]
        scale_cols = scale_ptr + offs_n * stride_sn
        zero_cols = zero_ptr + offs_n * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        first = pid_s * tiles_per_split
        last = tl.minimum(first + tiles_per_split, n_groups // GROUPS_PER_TILE)
        for tile in range(first, last):
            for g in tl.static_range(GROUPS_PER_TILE):
                group = tile * GROUPS_PER_TILE + g
                x_at = x_rows + (group * GROUP + offs_j)[None, :] * stride_xk
                x_lo = tl.load(x_at, mask=m_ok[:, None], other=0.0)
                x_hi = tl.load(x_at + HALF_G * stride_xk, mask=m_ok[:, None], other=0.0)
                w_lo = tl.zeros([HALF_G, BLOCK_N], dtype=tl.float32)
                w_hi = tl.zeros([HALF_G, BLOCK_N], dtype=tl.float32)
                for d in tl.static_range(N_DIGITS):
                    # past N: bytes, scales and zeros read 0, so W's column is 0
                    byte = tl.load(packed_cols + d * stride_pd + group * HALF_G, mask=n_ok[None, :], other=0)
                    at_group = d * stride_sd + group
                    scale = tl.load(scale_cols + at_group, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                    zero = tl.load(zero_cols + at_group, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                    w_lo += (byte & 15).to(tl.float32) * scale + zero
                    w_hi += (byte >> 4).to(tl.float32) * scale + zero
                acc = tl.dot(x_lo, w_lo.to(x_lo.dtype), acc, input_precision=DOT_PRECISION)
                acc = tl.dot(x_hi, w_hi.to(x_hi.dtype), acc, input_precision=DOT_PRECISION)
        y = y_ptr + pid_s * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


class TritonInt4Weight:
    """A weight of 1 or 2 int4 digits on the device, packed for `_int4_matmul_kernel`.

    packed: uint8 [digits, N, K // 2]; scale, zero: [digits, N, K // G] in scale_dtype."""

    def __init__(
        self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
    ) -> None:
        self.packed, self.scale, self.zero = packed, scale, zero
        self.group_size = group_size
        self.n_digits, self.n = packed.shape[0], packed.shape[1]
        self.k = packed.shape[2] * 2

    @classmethod
    def from_digits(
        cls,
        digits: Sequence[Any],
        group_size: int,
        device: torch.device | str,
        scale_dtype: torch.dtype = torch.float32,
    ) -> TritonInt4Weight:
        """digits: 1 or 2 of (codes uint8 [N, K] in [0, 15], scale [N, K // G], zero [N, K // G])
        (or objects with those attributes); K a multiple of group_size (32, 64 or 128).
        scale_dtype: how scale and zero are kept (bfloat16 / float16 halve their bytes but round
        them). Meta tensors give a meta weight (shapes only, values unchecked)."""
        _check_digits(digits, group_size)
        parts = [_digit_parts(d) for d in digits]
        # packed where the codes are (half the bytes to move), then moved
        packed = torch.stack([pack_codes(codes, group_size) for codes, _, _ in parts]).to(device)
        scale = torch.stack([s for _, s, _ in parts]).to(device, scale_dtype)
        zero = torch.stack([z for _, _, z in parts]).to(device, scale_dtype)
        return cls(packed.contiguous(), scale.contiguous(), zero.contiguous(), group_size)

    @property
    def nbytes(self) -> int:
        """Bytes held on the device: packed codes, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))

    def matmul(self, x: torch.Tensor, n_splits: int | None = None) -> torch.Tensor:
        """x [..., K] (float32, bfloat16 or float16) @ W.T -> y [..., N] in x's dtype, float32
        accumulation. n_splits: K splits (None: choose_splits for x's device's SMs)."""
        if not HAVE_TRITON:
            raise RuntimeError("triton is not installed: TritonInt4Weight needs it")
        if x.shape[-1] != self.k:
            raise ValueError(f"x has {x.shape[-1]} columns, the weight K={self.k}")
        if x.dtype not in DOT_DTYPES:
            raise ValueError(f"x must be one of {DOT_DTYPES}, got {x.dtype}")
        if x.device != self.packed.device:
            raise ValueError(f"x is on {x.device}, the weight on {self.packed.device}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        m = x2.shape[0]
        if m == 0:
            return x.new_empty((*lead, self.n))
        cfg = launch_config(m, self.k, self.group_size, x.dtype)
        grid_m, grid_n = -(-m // cfg["BLOCK_M"]), -(-self.n // cfg["BLOCK_N"])
        n_tiles = self.k // cfg["BLOCK_K"]
        if n_splits is None:
            n_splits = choose_splits(grid_m * grid_n, self.k, sm_count(x.device))
        if n_splits < 1:
            raise ValueError(f"n_splits must be >= 1, got {n_splits}")
        tiles_per_split = -(-n_tiles // n_splits)
        n_splits = -(-n_tiles // tiles_per_split)  # no empty split
        if n_splits == 1:
            y = torch.empty((1, m, self.n), dtype=x.dtype, device=x.device)
        else:
            y = torch.empty((n_splits, m, self.n), dtype=torch.float32, device=x.device)
        launch(
            _int4_matmul_kernel,
            (grid_m, grid_n, n_splits),
            x2,
            self.packed,
            self.scale,
            self.zero,
            y,
            m,
            self.n,
            self.k,
            tiles_per_split,
            *x2.stride(),
            self.packed.stride(0),
            self.packed.stride(1),
            self.scale.stride(0),
            self.scale.stride(1),
            *y.stride(),
            GROUP=self.group_size,
            N_DIGITS=self.n_digits,
            **cfg,
        )
        out = y[0] if n_splits == 1 else y.sum(0).to(x.dtype)
        return out.reshape(*lead, self.n)

    __call__ = matmul
