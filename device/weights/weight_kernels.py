"""The matmul kernels of the weights, chosen at load, and the layers that call them.

`KernelLinear` is nn.Linear's forward, y = x @ W.T (+ b), over W's row bands
(device/weights/quant_weights.py), each band computed by its own kernel and the outputs set side
by side:
- `CpuQuantMatmul` (cpu_quant_matmul.py): a GGUF matrix on the CPU, int8 activations times the
  file's int4/int8 codes in integer dot products, built for this CPU's ISA (AVX2, AVX-VNNI,
  AVX-512 VNNI, or plain loops). 3.1x torch's int4 kernel per decode step on an AVX-512-BF16
  machine, 6x on the AVX2 path (bench/results/2026-11-29-cpu-shared/).
- `CpuInt4Matmul`: torch's int4 weight-only kernel (`_weight_int4pack_mm_for_cpu`), one call per
  digit (Q4_x: one; Q5_x, Q8_0: two), kept for side-by-side runs
  (RINGLEADER_CPU_QUANT_KERNEL=torch). Its fast path takes bf16 activations (fp32 ones run a
  scalar loop ~30x slower), so activations, scales and zeros enter it in bf16; it accumulates
  in fp32.
- the Triton kernel of device/weights/triton_quant_matmul.py for the same digits on CUDA.
- `dense_matmul`: a dense weight. On the CPU its rows are split into one batch entry per torch
  thread and run as one bmm: torch runs a 1-row GEMM (a decode step at concurrency 1) on a
  single core, but a bmm's batch entries on all of them (measured: bench/results/
  2026-11-26-cpu-weights/).
`StoredEmbedding` looks rows up in a GGUF matrix and widens only the rows a step reads.

Where rounding enters against the file's own dequantization (gguf_quants, float32): CpuQuantMatmul
holds the weights exactly and rounds the activations to int8 per group of 32 (scale max|x|/127);
torch's int4 kernel rounds each group's scale and zero to bf16 (zero' = zero + 8 * scale: it
takes q - 8), and the activations to bf16; each sums in its own order. Dense fp32 weights are the
file's values exactly; only the summation order differs from one F.linear.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ringleader.device.weights.quant_weights import GROUP, Digit, GGUFMatrix, RowBands, Weight

CPU_QUANT_KERNEL_ENV = "RINGLEADER_CPU_QUANT_KERNEL"
CPU_ROWS_PER_PACK = 4096  # rows packed at once: the packing takes int32 codes (4 B each)
CPU_N_MULTIPLE = 16  # torch's CPU int4 packing wants N a multiple of 16: rows are padded
CPU_INT4_DTYPE = torch.bfloat16  # the activations' dtype of the kernel's vectorized path

Matmul = Callable[[torch.Tensor], torch.Tensor]


class CpuInt4Matmul:
    """x @ W.T for W a sum of int4 digits, through torch's CPU int4 weight-only kernel."""

    def __init__(self, digits: list[Digit], n: int) -> None:
        self.n = n
        pad = -n % CPU_N_MULTIPLE
        self.packed: list[torch.Tensor] = []
        self.scale_zeros: list[torch.Tensor] = []
        for d in digits:
            codes, scale, zero = d.codes, d.scale, d.zero + 8 * d.scale  # the kernel takes q - 8
            if pad:
                codes = F.pad(codes, (0, 0, 0, pad))
                scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
            chunks = [
                torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    codes[i : i + CPU_ROWS_PER_PACK].to(torch.int32), 1
                )
                for i in range(0, codes.shape[0], CPU_ROWS_PER_PACK)
            ]
            self.packed.append(torch.cat(chunks, 0))
            sz = torch.stack([scale.t(), zero.t()], -1).to(CPU_INT4_DTYPE).contiguous()  # [K/G, N, 2]
            self.scale_zeros.append(sz)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        xq = x.to(CPU_INT4_DTYPE)
        y = mm(xq, self.packed[0], GROUP, self.scale_zeros[0]).float()
        for packed, sz in zip(self.packed[1:], self.scale_zeros[1:], strict=True):
            y += mm(xq, packed, GROUP, sz)
        y = y.to(x.dtype)
        return y if y.shape[-1] == self.n else y[..., : self.n]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.packed, *self.scale_zeros))


def dense_matmul(x: torch.Tensor, w: torch.Tensor, splits: int = 1) -> torch.Tensor:
    """x @ w.T in w's dtype (bf16 beside fp32 activations: cast in and out).

    splits > 1 (the CPU): w's rows as `splits` equal batch entries of one bmm, so that a GEMM of
    a few rows runs on every core (w is only viewed, never copied); 1, or rows that do not
    divide: one F.linear."""
    xw = x if x.dtype == w.dtype else x.to(w.dtype)
    n, k = w.shape
    if splits <= 1 or n % splits or xw.dim() != 2:
        y = F.linear(xw, w)
    else:
        m = xw.shape[0]
        halves = w.view(splits, n // splits, k).transpose(1, 2)
        y = torch.bmm(xw.expand(splits, m, k), halves).transpose(0, 1).reshape(m, n)
    return y if y.dtype == x.dtype else y.to(x.dtype)


class DenseMatmul:
    """dense_matmul over a band of its own (a GGUF type without digits, widened at load)."""

    def __init__(self, weight: torch.Tensor, splits: int = 1) -> None:
        self.weight, self.splits = weight, splits

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return dense_matmul(x, self.weight, self.splits)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def band_matmul(
    part: torch.Tensor | GGUFMatrix, dtype: torch.dtype, device: torch.device, splits: int
) -> Matmul:
    """The kernel for one row band: int4 digits where the type has them, else dense in `dtype`
    (a dense tensor keeps its own dtype)."""
    if isinstance(part, torch.Tensor):
        return DenseMatmul(part.to(device), splits)
    if not part.has_digits:
        return DenseMatmul(part.dense(dtype, device), splits)
    if device.type == "cuda":
        from ringleader.device.weights.triton_quant_matmul import TritonInt4Weight

        kernel = TritonInt4Weight.from_digits(part.digits(), GROUP, device)  # takes Digit as it is
        return kernel.matmul
    if cpu_quant_kernel() == "torch":
        return CpuInt4Matmul(part.digits(), part.shape[0])
    from ringleader.device.weights.cpu_quant_matmul import CpuQuantMatmul

    return CpuQuantMatmul.from_gguf(part)


def cpu_quant_kernel() -> str:
    """The CPU's kernel for GGUF matrices: "ringleader" (cpu_quant_matmul.py, the default) or
    "torch" (CpuInt4Matmul, kept for side-by-side runs), from RINGLEADER_CPU_QUANT_KERNEL."""
    name = os.environ.get(CPU_QUANT_KERNEL_ENV, "ringleader")
    if name not in ("ringleader", "torch"):
        raise ValueError(f"{CPU_QUANT_KERNEL_ENV}={name!r}: one of ringleader, torch")
    return name


def band_kind(part: torch.Tensor | GGUFMatrix) -> str:
    """How a band is stored, for the start-up line: Q4_1 (kept), Q6_K->dense, bfloat16."""
    if isinstance(part, torch.Tensor):
        return str(part.dtype).removeprefix("torch.")
    return part.qtype if part.has_digits else f"{part.qtype}->dense"


class KernelLinear(nn.Module):
    """nn.Linear's forward over a weight stored by row bands, each with its kernel."""

    def __init__(
        self,
        weight: Weight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device | str,
        splits: int = 1,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        parts = weight.parts if isinstance(weight, RowBands) else [weight]
        self.splits = splits
        self.kinds = [band_kind(p) for p in parts]
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)
        # a dense weight stays a parameter (state_dict() and .to() see it), read at each call
        self.weight = nn.Parameter(weight.to(device), False) if isinstance(weight, torch.Tensor) else None
        self.bands = [] if self.weight is not None else [band_matmul(p, dtype, device, splits) for p in parts]

    @classmethod
    def of_kernel(
        cls, matmul: Matmul, shape: tuple[int, int], kind: str, bias: torch.Tensor | None = None
    ) -> KernelLinear:
        """One band computed by a kernel built elsewhere (e.g. a TritonInt4Weight's matmul from
        digits made in a test or an ahead-of-time walk); shape (out, in), kind as band_kind."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        linear.splits, linear.kinds, linear.bands = 1, [kind], [matmul]
        linear.out_features, linear.in_features = shape
        linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        linear.weight = None
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            y = dense_matmul(x, self.weight, self.splits)
        elif len(self.bands) == 1:
            y = self.bands[0](x)
        else:
            y = torch.cat([band(x) for band in self.bands], dim=-1)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight and bias."""
        own = [t for t in (self.weight, self.bias) if t is not None]
        return sum(t.numel() * t.element_size() for t in own) + sum(
            getattr(b, "nbytes", 0) for b in self.bands
        )


class StoredEmbedding(nn.Module):
    """nn.Embedding's forward over a table stored otherwise (GGUF bytes, or bf16): only the rows
    looked up are widened to `dtype` (a GGUF row exactly as the file's dequantization gives it)."""

    def __init__(self, table: GGUFMatrix | torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = table.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.table, GGUFMatrix):
            return self.table.rows(ids).to(self.dtype)
        return F.embedding(ids, self.table).to(self.dtype)

    @property
    def nbytes(self) -> int:
        t = self.table
        return t.nbytes if isinstance(t, GGUFMatrix) else t.numel() * t.element_size()
