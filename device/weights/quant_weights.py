"""GGUF matrices kept quantized: their file bytes by row, and their int4 digits for the kernels.

A `GGUFMatrix` is one 2-D GGUF tensor as its bytes, one row of blocks per output row (rows can
be reordered and concatenated without decoding: llama.cpp's Q/K row permutation is undone on
the bytes, and q|k|v or gate|up fuse by stacking rows). A fused projection whose parts differ in
type (a Q4_K_M file's attn_v in Q6_K beside Q4_K q and k) is a `RowBands`: parts stacked by row.

The matmul kernels (torch's int4 CPU kernel; device/weights/triton_quant_matmul.py on CUDA) take
weights as int4 *digits*, each
    W[n, k] = codes[n, k] * scale[n, k // G] + zero[n, k // G]     codes in [0, 15], float32
and a weight is the sum of one or two digits. Every GGUF type whose codes span at most 256 values
in groups of at least 32 maps onto digits exactly: a code c (scale s, offset o, from
gguf_quants.block_codes) is written u = c - base in [0, 256) and split u = 16 * hi + lo, so
    s * c + o = hi * (16 s) + lo * s + (base * s + o)
16 s and base * s are exact in float32 (powers of two and small integers times an f16 value),
and base * s + o is rounded only where both are nonzero (no type here has both). Types whose
groups are 16 wide (Q2_K, Q3_K, Q6_K) have no digit form for the group-32 kernels: they are
widened at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringleader.device.weights.gguf_quants import BLOCK_LAYOUTS, block_codes, dequantize

# ggml type -> (the lowest code, digits): codes span [base, base + 16 ** digits)
DIGIT_FORMS: dict[str, tuple[int, int]] = {
    "Q4_0": (-8, 1),
    "Q4_1": (0, 1),
    "Q4_K": (0, 1),
    "Q5_0": (-16, 2),
    "Q5_1": (0, 2),
    "Q5_K": (0, 2),
    "Q8_0": (-128, 2),
}
GROUP = 32  # every type of DIGIT_FORMS has one scale per 32 elements (K-quants: per sub-block)


@dataclass(frozen=True)
class Digit:
    """W = codes * scale + zero, per group of GROUP elements along K (see the module docstring)."""

    codes: torch.Tensor  # uint8 [N, K], each in [0, 15]
    scale: torch.Tensor  # float32 [N, K // GROUP]
    zero: torch.Tensor  # float32 [N, K // GROUP]


@dataclass
class GGUFMatrix:
    """One quantized 2-D GGUF tensor as its bytes: raw uint8 [N, row_bytes], torch shape (N, K)."""

    raw: torch.Tensor
    qtype: str
    shape: tuple[int, int]
    name: str = ""

    @property
    def has_digits(self) -> bool:
        return self.qtype in DIGIT_FORMS

    def dense(self, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
        return dequantize(self.raw, self.qtype, self.shape, dtype=dtype, device=device, name=self.name)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 rows `index` (an embedding lookup), decoded from their bytes only."""
        picked = self.raw.index_select(0, index.reshape(-1))
        out = dequantize(picked, self.qtype, (picked.shape[0], self.shape[1]), device=picked.device)
        return out.reshape(*index.shape, self.shape[1])

    def digits(self) -> list[Digit]:
        """The weight as int4 digits (exact, see the module docstring); only for DIGIT_FORMS."""
        base, n_digits = DIGIT_FORMS[self.qtype]
        n, k = self.shape
        type_size = BLOCK_LAYOUTS[self.qtype][1]
        codes, scale, offset = block_codes(self.raw.reshape(-1, type_size), self.qtype)
        u = (codes.to(torch.int32) - base).reshape(n, k)
        scale = scale.reshape(n, k // GROUP)
        low_zero = base * scale if offset is None else base * scale + offset.reshape(n, k // GROUP)
        if n_digits == 1:
            return [Digit(u.to(torch.uint8), scale, low_zero)]
        return [
            Digit((u >> 4).to(torch.uint8), 16 * scale, torch.zeros_like(scale)),
            Digit((u & 15).to(torch.uint8), scale, low_zero),
        ]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


Part = torch.Tensor | GGUFMatrix


@dataclass
class RowBands:
    """Row bands stacked into one weight: dense tensors and GGUF matrices, in row order."""

    parts: list[Part]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])


Weight = torch.Tensor | GGUFMatrix | RowBands


def cat_rows(parts: list[Weight]) -> Weight:
    """torch.cat(parts) for dense tensors; otherwise the bands, adjacent GGUF matrices of one
    type merged into one (their bytes stacked), so q|k|v of one type stays one matrix."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, 0)  # type: ignore[arg-type]
    flat: list[Part] = []
    for p in parts:
        flat.extend(p.parts if isinstance(p, RowBands) else [p])
    merged: list[Part] = []
    for p in flat:
        last = merged[-1] if merged else None
        if isinstance(p, GGUFMatrix) and isinstance(last, GGUFMatrix) and last.qtype == p.qtype:
            raw = torch.cat([last.raw, p.raw], 0)
            merged[-1] = GGUFMatrix(raw, p.qtype, (last.shape[0] + p.shape[0], p.shape[1]), last.name)
        else:
            merged.append(p)
    return merged[0] if len(merged) == 1 else RowBands(merged)
