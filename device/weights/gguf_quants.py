"""Dequantization of GGUF (llama.cpp / ggml) tensor data in torch.

`dequantize` turns the raw bytes of one GGUF tensor into a dense tensor on the CPU or directly on
the GPU at model load. Every block type is decoded with whole-tensor torch ops (no Python loop
over blocks), in float32 and in the same order of float32 operations as the `gguf` package's numpy
reference, so the results match it bit for bit before the cast to the serving dtype.

Block layouts (little-endian, blocks packed with no padding; "f16" is an IEEE half):
  Q8_0  34 B / 32:  f16 d, int8 q[32]                              x = d*q
  Q4_0  18 B / 32:  f16 d, qs[16] (low nibbles: x0..15, high: x16..31)   x = d*(q-8)
  Q4_1  20 B / 32:  f16 d, f16 m, qs[16]                           x = d*q + m
  Q5_0  22 B / 32:  f16 d, u32 qh (bit i: 5th bit of x_i), qs[16]  x = d*(q-16)
  Q5_1  24 B / 32:  f16 d, f16 m, u32 qh, qs[16]                   x = d*q + m
  Q2_K  84 B / 256: scales[16] (lo: scale, hi: min), qs[64] (2-bit), f16 d, f16 dmin
  Q3_K 110 B / 256: hmask[32], qs[64] (2-bit), scales[12] (6-bit, offset 32), f16 d
  Q4_K 144 B / 256: f16 d, f16 dmin, scales[12] (6-bit scales and mins), qs[128]
  Q5_K 176 B / 256: f16 d, f16 dmin, scales[12], qh[32], qs[128]
  Q6_K 210 B / 256: ql[128], qh[64], int8 scales[16], f16 d        x = d*scale*(q-32)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

QK_K = 256  # elements in a K-quant super-block

# ggml type name -> (elements per block, bytes per block)
BLOCK_LAYOUTS: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q2_K": (QK_K, 84),
    "Q3_K": (QK_K, 110),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}

SUPPORTED: tuple[str, ...] = tuple(BLOCK_LAYOUTS)

# Bounds the float32 output decoded at once (its temporaries are a few times this), so an 8B
# model's embedding does not need gigabytes of scratch on the device.
CHUNK_OUTPUT_BYTES = 64 << 20

_FLOAT_STORAGE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class UnsupportedQuantization(ValueError):
    """A GGUF tensor is stored in a ggml type this module cannot decode."""


def dequantize(
    raw: torch.Tensor,
    qtype: str,
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    name: str = "",
) -> torch.Tensor:
    """The GGUF tensor stored in `raw` (uint8, its bytes as in the file) as a `dtype` tensor of
    row-major `shape` on `device` (default: raw's device). Decoding happens on `device`, in float32.
    F32 data read as float32 on raw's device comes back as a view sharing raw's memory."""
    label = f"GGUF tensor {name}" if name else "GGUF tensor"
    if qtype not in BLOCK_LAYOUTS:
        raise UnsupportedQuantization(
            f"{label}: quantization {qtype} is not supported (supported: {', '.join(SUPPORTED)})"
        )
    if raw.dtype != torch.uint8:
        raise TypeError(f"{label}: raw data must be uint8 bytes, got {raw.dtype}")
    shape = tuple(int(d) for d in shape)
    _check_size(raw, qtype, shape, label)
    target = torch.device(device) if device is not None else raw.device
    data = raw.to(target).reshape(-1)
    if qtype in _FLOAT_STORAGE:
        return _reinterpret(data, _FLOAT_STORAGE[qtype]).to(dtype).reshape(shape)
    return _decode_in_chunks(data, qtype, dtype).reshape(shape)


def _check_size(raw: torch.Tensor, qtype: str, shape: tuple[int, ...], label: str) -> None:
    block_size, type_size = BLOCK_LAYOUTS[qtype]
    row_length = shape[-1] if shape else 1
    if row_length % block_size:
        raise ValueError(
            f"{label}: last dimension {row_length} of shape {shape} is not a multiple of "
            f"the {qtype} block size {block_size}"
        )
    n_elements = 1
    for dim in shape:
        n_elements *= dim
    expected = n_elements // block_size * type_size
    if raw.numel() != expected:
        raise ValueError(f"{label}: {qtype} data of shape {shape} takes {expected} bytes, got {raw.numel()}")


def _reinterpret(data: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    itemsize = torch.empty((), dtype=storage).element_size()
    if data.storage_offset() % itemsize:  # a dtype view needs its start aligned to the item size
        data = data.clone()
    return data.view(storage)


def _decode_in_chunks(data: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    block_size, type_size = BLOCK_LAYOUTS[qtype]
    n_blocks = data.numel() // type_size
    blocks = data.view(n_blocks, type_size)
    out = torch.empty(n_blocks, block_size, dtype=dtype, device=data.device)
    blocks_per_chunk = max(1, CHUNK_OUTPUT_BYTES // (block_size * 4))
    for start in range(0, n_blocks, blocks_per_chunk):
        stop = min(start + blocks_per_chunk, n_blocks)
        out[start:stop] = _decode_blocks(blocks[start:stop], qtype)
    return out


# --- bit-level helpers -------------------------------------------------------------------------


def _f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 at byte `offset` of every block, as a float32 column (n_blocks, 1)."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _unpack_fields(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Splits each byte of `packed` (..., k) into its 8/width bit fields, lowest first:
    result[..., j, p] = (packed[..., p] >> (j * width)) & (2**width - 1)."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device).view(-1, 1)
    return (packed.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _fifth_bits_q5(qh: torch.Tensor) -> torch.Tensor:
    """Bit i of the little-endian u32 `qh` (n_blocks, 4 bytes) for i in 0..31, as (n_blocks, 32)."""
    return _unpack_fields(qh, 1).transpose(-1, -2).reshape(qh.shape[0], 32)


def _low_then_high_nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """Each `run` bytes of qs give `run` elements from low nibbles, then `run` from high ones."""
    n_blocks = qs.shape[0]
    return _unpack_fields(qs.reshape(n_blocks, -1, run), 4).reshape(n_blocks, -1)


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins of Q4_K/Q5_K packed in 12 bytes:
    bytes 0-3 hold scales 0-3 (+2 high bits of scales 4-7), bytes 4-7 mins 0-3 (+2 high bits of
    mins 4-7), bytes 8-11 the low nibbles of scales 4-7 (low) and mins 4-7 (high)."""
    low_scales, low_mins, low_nibbles = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    high_scales = (low_nibbles & 0x0F) | ((low_scales >> 2) & 0x30)
    high_mins = (low_nibbles >> 4) | ((low_mins >> 2) & 0x30)
    scales = torch.cat((low_scales & 0x3F, high_scales), dim=-1)
    mins = torch.cat((low_mins & 0x3F, high_mins), dim=-1)
    return scales, mins


# --- block codes: uint8 blocks (n_blocks, type_size) -> GroupCodes ----------------------------


class GroupCodes(NamedTuple):
    """One block type's content as integers and per-group floats, before any rounding:
    x = scale * code (+ offset), in float32, per group of `group` elements.

    codes: signed integers (n_blocks, groups, group) in int16; scale and offset (n_blocks,
    groups, 1) float32 (offset None: none). The dense decode and the quantized matmul weights
    (device/model/quant_digits.py) are both built from this one reading of the bits."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None

    @property
    def group(self) -> int:
        return self.codes.shape[-1]


def _codes(
    q: torch.Tensor, n_groups: int, scale: torch.Tensor, offset: torch.Tensor | None = None
) -> GroupCodes:
    n_blocks = q.shape[0]
    view = (n_blocks, n_groups, 1)
    return GroupCodes(
        q.to(torch.int16).view(n_blocks, n_groups, -1),
        scale.view(view),
        None if offset is None else offset.view(view),
    )


def _codes_q8_0(blocks: torch.Tensor) -> GroupCodes:
    return _codes(blocks[:, 2:].view(torch.int8), 1, _f16_field(blocks, 0))


def _codes_q4_0(blocks: torch.Tensor) -> GroupCodes:
    q = _low_then_high_nibbles(blocks[:, 2:], 16).to(torch.int8) - 8
    return _codes(q, 1, _f16_field(blocks, 0))


def _codes_q4_1(blocks: torch.Tensor) -> GroupCodes:
    q = _low_then_high_nibbles(blocks[:, 4:], 16)
    return _codes(q, 1, _f16_field(blocks, 0), _f16_field(blocks, 2))


def _codes_q5_0(blocks: torch.Tensor) -> GroupCodes:
    q = _low_then_high_nibbles(blocks[:, 6:], 16) | (_fifth_bits_q5(blocks[:, 2:6]) << 4)
    return _codes(q.to(torch.int8) - 16, 1, _f16_field(blocks, 0))


def _codes_q5_1(blocks: torch.Tensor) -> GroupCodes:
    q = _low_then_high_nibbles(blocks[:, 8:], 16) | (_fifth_bits_q5(blocks[:, 4:8]) << 4)
    return _codes(q, 1, _f16_field(blocks, 0), _f16_field(blocks, 2))


def _codes_q2_k(blocks: torch.Tensor) -> GroupCodes:
    n_blocks = blocks.shape[0]
    scale_bytes = blocks[:, 0:16]
    d, dmin = _f16_field(blocks, 80), _f16_field(blocks, 82)
    # 16 sub-blocks of 16: each 32 bytes of qs hold 4 runs of 32 elements in bit pairs 0, 2, 4, 6
    q = _unpack_fields(blocks[:, 16:80].reshape(n_blocks, 2, 32), 2)
    # scale*q - offset as scale*q + (-offset): the same float32 result (negation is exact)
    return _codes(
        q, 16, d * (scale_bytes & 0x0F).to(torch.float32), -(dmin * (scale_bytes >> 4).to(torch.float32))
    )


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """16 signed 6-bit scales: low nibbles from bytes 0-7 (all low halves, then all high halves),
    top 2 bits from bytes 8-11 (bit pairs 0, 2, 4, 6 across the 4 bytes), minus 32."""
    n_blocks = packed.shape[0]
    low = _unpack_fields(packed[:, 0:8], 4).reshape(n_blocks, 16)
    high = _unpack_fields(packed[:, 8:12], 2).reshape(n_blocks, 16)
    return ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)


def _codes_q3_k(blocks: torch.Tensor) -> GroupCodes:
    n_blocks = blocks.shape[0]
    low = _unpack_fields(blocks[:, 32:96].reshape(n_blocks, 2, 32), 2).reshape(n_blocks, 16, 16)
    high = _unpack_fields(blocks[:, 0:32], 1).reshape(n_blocks, 16, 16)
    # a set hmask bit means "no offset"; a clear one subtracts 4
    q = low.to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)
    return _codes(q, 16, _f16_field(blocks, 108) * _q3_k_scales(blocks[:, 96:108]))


def _k_scale_offset(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the 8 sub-block scales d*sc and offsets -(dmin*m), float32 (n_blocks, 8)."""
    d, dmin = _f16_field(blocks, 0), _f16_field(blocks, 2)
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    return d * scales.to(torch.float32), -(dmin * mins.to(torch.float32))


def _codes_q4_k(blocks: torch.Tensor) -> GroupCodes:
    return _codes(_low_then_high_nibbles(blocks[:, 16:144], 32), 8, *_k_scale_offset(blocks))


def _codes_q5_k(blocks: torch.Tensor) -> GroupCodes:
    n_blocks = blocks.shape[0]
    low = _low_then_high_nibbles(blocks[:, 48:176], 32).view(n_blocks, 8, 32)
    high = _unpack_fields(blocks[:, 16:48], 1)  # sub-block j takes bit j of qh[0..31]
    return _codes(low | (high << 4), 8, *_k_scale_offset(blocks))


def _codes_q6_k(blocks: torch.Tensor) -> GroupCodes:
    n_blocks = blocks.shape[0]
    d = _f16_field(blocks, 208)
    # each half of 128 elements: 64 ql bytes (low nibbles, then high) and 32 qh bytes (4 bit pairs)
    low = _low_then_high_nibbles(blocks[:, 0:128], 64)
    high = _unpack_fields(blocks[:, 128:192].reshape(n_blocks, 2, 32), 2).reshape(n_blocks, QK_K)
    q = (low | (high << 4)).to(torch.int8) - 32
    return _codes(q, 16, d * blocks[:, 192:208].view(torch.int8).to(torch.float32))


_BLOCK_CODES: dict[str, Callable[[torch.Tensor], GroupCodes]] = {
    "Q8_0": _codes_q8_0,
    "Q4_0": _codes_q4_0,
    "Q4_1": _codes_q4_1,
    "Q5_0": _codes_q5_0,
    "Q5_1": _codes_q5_1,
    "Q2_K": _codes_q2_k,
    "Q3_K": _codes_q3_k,
    "Q4_K": _codes_q4_k,
    "Q5_K": _codes_q5_k,
    "Q6_K": _codes_q6_k,
}


def block_codes(blocks: torch.Tensor, qtype: str) -> GroupCodes:
    """The codes of uint8 `blocks` (n_blocks, type_size) of a quantized ggml type."""
    return _BLOCK_CODES[qtype](blocks)


def _decode_blocks(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 (n_blocks, block_size): scale * code (+ offset), the reference's float32 order."""
    codes, scale, offset = block_codes(blocks, qtype)
    x = scale * codes.to(torch.float32)
    return (x if offset is None else x + offset).reshape(blocks.shape[0], -1)
