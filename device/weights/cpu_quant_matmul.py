"""x @ W.T on the CPU for a GGUF matrix kept quantized: int8 activations times int4/int8 codes.

The kernel (device/weights/cpu_quant_kernel.cpp) quantizes each row of x per group of 32 to int8
(scale max|x| / 127) inside the call and takes integer dot products of those codes with the
weight's codes, group by group (the approach of llama.cpp's q4_1 x q8_1 dot, written anew):
AVX2 maddubs/madd, AVX-512 or AVX-VNNI dpbusd, or plain loops ("generic", what runs on Arm).
torch's own int4 kernel (`CpuInt4Matmul` in weight_kernels.py) is fast only with AVX-512-BF16.

Weights, from `gguf_quants.block_codes` (W = scale * code + offset per group of 32 along K):
- Q4 form (Q4_0, Q4_1, Q4_K: codes span 16): u = code - base in [0, 15], two per byte, and per
  group d = scale, o = base * scale + offset (float32).
- Q8 form (Q5_0, Q5_1, Q5_K, Q8_0): the int8 code itself (Q5_1/Q5_K codes are 0..31, Q5_0's
  -16..15, Q8_0's -128..127), d = scale, o = offset (0 where the type has none); the VNNI builds
  take it biased to unsigned (code + 128), the kernel takes the bias off in integers.
Both forms give back the file's float32 dequantization bit for bit: code * scale is exact in
float32 (at most 8 bits times an f16 or f16 * 6-bit value) and where o = base * scale (Q4_0) the
sum u * d + o is the exact value (u - 8) * d; elsewhere the one rounding is the file's own.

Scales and offsets are fp16 where every one of the matrix is exactly an fp16 value (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0: the file's own f16 fields, and -8 * d) and the build converts them in vectors:
20 bytes per 32 Q4 weights, as the Q4_1 file. Q4_K/Q5_K (d * 6-bit sub-scale: 17 significant
bits) and the generic build keep float32 (24 bytes). fp16 measured ~11% faster where the weights
stream from memory (lm_head Q8_0, 1 thread: 829 against 928 us) and the same from cache.

The build (ISA chosen at compile time, this CPU's flags in the cache key, OpenMP on torch's own
pool) is device/backends/cpu_native.py's; `isa` None is its default (RINGLEADER_CPU_ISA, else
"native").

Packaging: the .cpp must ship beside this module (package-data "*.cpp" for
ringleader.device.weights).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ringleader.device.backends.cpu_native import (  # noqa: F401 (ISA_CPU_FLAGS, OPENMP_NOTE: re-exported for tests)
    ISA_CPU_FLAGS,
    ISA_FLAGS,
    OPENMP_NOTE,
    build_for_this_cpu,
    default_isa,
    isa_runs_here,
)
from ringleader.device.weights.gguf_quants import BLOCK_LAYOUTS, block_codes
from ringleader.device.weights.quant_weights import DIGIT_FORMS, GROUP, GGUFMatrix

SOURCE_PATH = Path(__file__).with_name("cpu_quant_kernel.cpp")

Q4_FORM, Q8_FORM, FORM_HALF = 0, 1, 2  # the kernel's form bits
ROWS_PER_PACK = 4096  # weight rows decoded and packed at once (bounds the int16/float temporaries)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name, args, res in (
        ("rl_cq_path", [], ctypes.c_char_p),
        ("rl_cq_tile_rows", [], i32),
        ("rl_cq_q8_bias", [], i32),
        ("rl_cq_lane_bytes", [], i32),
        ("rl_cq_half_scales_fast", [], i32),
        ("rl_cq_probe_threads", [], i32),
        ("rl_cq_last_threads", [], i32),
        ("rl_cq_quantize", [p, i64, i64, p, p, p], i32),
        ("rl_cq_matmul", [p, p, i64, p], i32),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


@functools.cache
def library(isa: str | None = None) -> ctypes.CDLL:
    """The kernel built for `isa` (default: cpu_native.default_isa()), once per process; the file
    is cached across processes. torch (imported above) has loaded its libgomp.so.1 already: the
    library's NEEDED entry of that soname resolves to the same file, not a second runtime."""
    return _bind(ctypes.CDLL(str(build_for_this_cpu("rlcpuquant", SOURCE_PATH, isa or default_isa()))))


def kernel_path(isa: str | None = None) -> str:
    """The code path the build for `isa` runs: "avx512-vnni", "avx2-vnni", "avx2" or "generic"."""
    return library(isa).rl_cq_path().decode()


def supported(matrix: GGUFMatrix) -> bool:
    """Whether this kernel takes `matrix`: the types with groups of 32 and codes of <= 8 bits."""
    return isinstance(matrix, GGUFMatrix) and matrix.qtype in DIGIT_FORMS and matrix.shape[1] % GROUP == 0


def quantize_activations(x: torch.Tensor, isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's own int8 quantization of x [M, K] float32: (codes int8 [M, K], scales float32
    [M, K / 32]); x ~ codes * scale per group of 32."""
    x = _as_matrix(x, x.shape[-1]).float().contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    e = torch.empty(m, k // GROUP)
    es = torch.empty_like(e)
    rc = library(isa).rl_cq_quantize(x.data_ptr(), m, k, q.data_ptr(), e.data_ptr(), es.data_ptr())
    if rc:
        raise ValueError(f"activations of width {k}: not a multiple of {GROUP}")
    return q, e


def _as_matrix(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)}: its last dimension must be K = {k}")
    if k % GROUP:
        raise ValueError(f"K = {k} is not a multiple of {GROUP} (the quantization group)")
    return x.reshape(-1, k)


class _WeightDesc(ctypes.Structure):
    """The kernel's `Weight`: the packed bytes' address, form bits, N, K."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("form", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
    ]


class _Layout(NamedTuple):
    """What a build of the kernel takes (cpu_quant_kernel.cpp's header)."""

    tile_rows: int  # R: weight rows per tile
    q8_bias: int  # added to Q8-form codes (the VNNI builds take them unsigned)
    lane_bytes: int  # L: codes of one row per chunk (0: the whole row)
    half_fast: bool  # fp16 scales convert in vectors (the generic path converts them one by one)

    @classmethod
    def of(cls, lib: ctypes.CDLL) -> _Layout:
        return cls(
            lib.rl_cq_tile_rows(),
            lib.rl_cq_q8_bias(),
            lib.rl_cq_lane_bytes(),
            bool(lib.rl_cq_half_scales_fast()),
        )


def _digit_form(qtype: str) -> tuple[int, int]:
    """(form bits without FORM_HALF, the code base subtracted) of a DIGIT_FORMS type."""
    base, n_digits = DIGIT_FORMS[qtype]
    return (Q4_FORM, base) if n_digits == 1 else (Q8_FORM, 0)


def _fits_half(t: torch.Tensor) -> bool:
    return bool((t.to(torch.float16).to(torch.float32) == t).all())


def _pack_rows(raw: torch.Tensor, qtype: str, k: int, layout: _Layout, half: bool) -> torch.Tensor | None:
    """Rows of `raw` (a whole number of tiles, or the last rows) in the kernel's layout; None when
    `half` and a scale or offset is not exactly an fp16 value."""
    form, base = _digit_form(qtype)
    r, g = layout.tile_rows, k // GROUP
    rows = raw.shape[0]
    codes, scale, offset = block_codes(raw.reshape(-1, BLOCK_LAYOUTS[qtype][1]), qtype)
    codes, scale = codes.reshape(rows, k), scale.reshape(rows, g)
    offset = torch.zeros_like(scale) if offset is None else offset.reshape(rows, g)
    if form == Q4_FORM:  # W = (code - base) * d + (base * d + o): exact (the module docstring)
        codes = codes - base
        zero = offset if base == 0 else base * scale + offset
    else:  # Q5_x / Q8_0 codes fit int8 as they are; the VNNI builds take them + 128
        codes = codes + layout.q8_bias
        zero = offset
    if half and not (_fits_half(scale) and _fits_half(zero)):
        return None
    pad = -rows % r
    if pad:  # the last tile's missing rows: zero codes and scales, never stored
        codes, scale, zero = (F.pad(v, (0, 0, 0, pad)) for v in (codes, scale, zero))
    t = (rows + pad) // r
    if form == Q4_FORM:  # [t, r, g, half, chunk, i]: the low nibble from the first half
        lane = layout.lane_bytes or 16
        c16 = codes.reshape(t, r, g, 2, 16 // lane, lane)
        byte = (c16[:, :, :, 0] | (c16[:, :, :, 1] << 4)).to(torch.uint8)
    else:
        lane = layout.lane_bytes or 32
        byte = (codes.reshape(t, r, g, 32 // lane, lane) & 0xFF).to(torch.uint8)
    chunks = byte.permute(0, 2, 3, 1, 4).reshape(t, g, -1)  # [t, g, chunk, r, i]
    floats = torch.stack([scale, zero], 0).reshape(2, t, r, g).permute(1, 3, 0, 2)  # [t, g, 2, r]
    floats = floats.to(torch.float16 if half else torch.float32).contiguous().view(torch.uint8)
    return torch.cat([floats.reshape(t, g, -1), chunks], -1).reshape(-1)


def _pack(matrix: GGUFMatrix, layout: _Layout, half_scales: bool | None) -> tuple[torch.Tensor, int]:
    """The weight in the kernel's layout as uint8, and its form bits. half_scales None: fp16
    scales where every one is exactly an fp16 value (never for Q4_K/Q5_K: d * sub-scale) and the
    build converts them in vectors (not the generic path)."""
    n, k = matrix.shape
    form, _ = _digit_form(matrix.qtype)
    half = half_scales if half_scales is not None else layout.half_fast and not matrix.qtype.endswith("_K")
    raw = matrix.raw.reshape(n, -1)
    r = layout.tile_rows
    step = max(r, ROWS_PER_PACK // r * r)
    while True:
        pieces = [_pack_rows(raw[i : i + step], matrix.qtype, k, layout, half) for i in range(0, n, step)]
        if all(p is not None for p in pieces):
            return torch.cat(pieces), form | (FORM_HALF if half else 0)
        if half_scales:
            raise ValueError(f"GGUF matrix {matrix.name}: its {matrix.qtype} scales are not all fp16 values")
        half = False


class CpuQuantMatmul:
    """x @ W.T for a GGUF matrix, int8 activations x int4/int8 weights, on the CPU."""

    def __init__(self, packed: torch.Tensor, form: int, shape: tuple[int, int], qtype: str, isa: str) -> None:
        self.packed, self.form, self.qtype, self.isa = packed, form, qtype, isa
        self.n, self.k = shape
        lib = library(isa)
        self.layout = _Layout.of(lib)
        self.path: str = lib.rl_cq_path().decode()
        self._matmul = lib.rl_cq_matmul
        self._desc = _WeightDesc(packed.data_ptr(), form, self.n, self.k)
        self._dptr = ctypes.addressof(self._desc)

    @classmethod
    def from_gguf(
        cls, matrix: GGUFMatrix, isa: str | None = None, half_scales: bool | None = None
    ) -> CpuQuantMatmul:
        """half_scales: fp16 scales and offsets (True; must be exact), float32 (False), or
        fp16 where exact (None)."""
        if matrix.shape[1] % GROUP:
            raise ValueError(f"GGUF matrix {matrix.name}: K = {matrix.shape[1]} is not a multiple of {GROUP}")
        if not supported(matrix):
            raise ValueError(
                f"GGUF matrix {matrix.name or ''} of type {matrix.qtype}, shape {matrix.shape}: the CPU "
                f"quantized matmul takes {', '.join(DIGIT_FORMS)} with K a multiple of {GROUP}"
            )
        packed, form = _pack(matrix, _Layout.of(library(isa)), half_scales)
        return cls(packed, form, matrix.shape, matrix.qtype, isa)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.n, self.k
        if x.dim() == 2 and x.shape[1] == k and x.dtype == torch.float32 and x.is_contiguous() and x.is_cpu:
            m = x.shape[0]  # the decode step's case: no reshape, no cast, no copy
            y = torch.empty(m, n)
            if m and self._matmul(self._dptr, x.data_ptr(), m, y.data_ptr()):
                raise ValueError(f"CPU quantized matmul of x [{m}, {k}] by W [{n}, {k}] refused")
            return y
        if x.dim() == 0 or x.shape[-1] != k:
            _as_matrix(x, k)  # raises, naming what is wrong
        if not x.is_cpu:
            raise ValueError(f"x is on {x.device}: the CPU quantized matmul takes CPU tensors")
        y = self(x.reshape(-1, k).to(torch.float32).contiguous())
        y = y.view(*x.shape[:-1], n)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    @property
    def half_scales(self) -> bool:
        return bool(self.form & FORM_HALF)

    def dequantized(self) -> torch.Tensor:
        """W as the kernel holds it, float32 [N, K]: code * d + o, decoded from the packed bytes."""
        r, g = self.layout.tile_rows, self.k // GROUP
        q8 = self.form & Q8_FORM
        scale_bytes = (4 if self.half_scales else 8) * r
        blocks = self.packed.view(-1, g, scale_bytes + (32 if q8 else 16) * r)
        dtype = torch.float16 if self.half_scales else torch.float32
        floats = blocks[:, :, :scale_bytes].contiguous().view(dtype).float().reshape(-1, g, 2, r)
        chunks = blocks[:, :, scale_bytes:]
        if not q8:
            lane = self.layout.lane_bytes or 16
            b = chunks.reshape(-1, g, 16 // lane, r, lane).to(torch.int32)
            codes = torch.stack([b & 15, b >> 4], 2)  # [t, g, half, chunk, r, i]
            codes = codes.permute(0, 4, 1, 2, 3, 5)  # [t, r, g, half, chunk, i]
        else:
            lane = self.layout.lane_bytes or 32
            b = chunks.reshape(-1, g, 32 // lane, r, lane)
            bias = self.layout.q8_bias
            codes = b.to(torch.int32) - bias if bias else b.view(torch.int8).to(torch.int32)
            codes = codes.permute(0, 3, 1, 2, 4)  # [t, r, g, chunk, i]
        codes = codes.reshape(-1, g, GROUP).to(torch.float32)
        d = floats[:, :, 0].permute(0, 2, 1).reshape(-1, g, 1)
        o = floats[:, :, 1].permute(0, 2, 1).reshape(-1, g, 1)
        return (codes * d + o).reshape(-1, self.k)[: self.n]

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def thread_probe(isa: str | None = None) -> int:
    """The threads an OpenMP parallel region of the kernel's library starts on this thread."""
    return library(isa).rl_cq_probe_threads()


def last_call_threads(isa: str | None = None) -> int:
    """The threads the calling thread's last matmul call (of the `isa` build) ran on."""
    return library(isa).rl_cq_last_threads()


def loaded_openmp_runtimes() -> list[str]:
    """The distinct OpenMP runtime files mapped into this process (/proc/self/maps)."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            name = os.path.basename(path)
            if name.startswith(("libgomp", "libiomp", "libomp")):
                found.add(os.path.realpath(path))
    return sorted(found)
