"""One Llama-family decoder layer: its weights and the one body both steps run.

The body is shared by the eager step (`LlamaModel.step`, the CPU backend) and the static step
(`StaticStep.run`, captured into CUDA graphs). What legitimately differs between them is passed
in: the KV-cache side as a `CacheAttention` (RoPE with the k/v write into the cache, and
attention reading it back: `EagerAttention` with a Python-side plan, or `StaticAttention` with
fixed shapes and index tensors), and the pointwise kernels as `PointwiseKernels` (torch's
device/model/ops.py, or the fused Triton kernels of device/step/triton_fused.py). The matrix
products and the order of everything are written here once.

The residual stream travels as (x, delta): each block's output is added by the next block's
norm (`add_rms_norm`), so that add costs no kernel of its own; the trunk's final norm takes the
last delta.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ringleader.device.model.config import ModelConfig

Device = str | torch.device


class CacheAttention(Protocol):
    """The KV-cache side of a step, for layer `layer` of the model.

    rope_and_store: qkv [T, (H + 2 KV) * D] -> rotated q [T, H, D]; rotated k and v go into the
    cache rows of the step's T rows. attend: q [T, H, D] -> [T, H, D], each row over its slot's
    cached prefix, its own k/v included (rope_and_store runs first).
    """

    def rope_and_store(self, layer: int, qkv: torch.Tensor) -> torch.Tensor: ...

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor: ...


class PointwiseKernels(Protocol):
    """device/model/ops.py (torch) or device/step/triton_fused.py (one launch each)."""

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """The weight and eps of one RMSNorm; the math is the kernels' add_rms_norm."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: Device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: Device) -> None:
        super().__init__()
        c = config
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        kw = dict(dtype=dtype, device=device)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **kw)
        self.qkv = nn.Linear(c.hidden_size, q_dim + 2 * kv_dim, bias=c.attention_bias, **kw)
        self.o = nn.Linear(q_dim, c.hidden_size, bias=c.attention_out_bias, **kw)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **kw)
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False, **kw)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, **kw)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cache: CacheAttention,
        kernels: PointwiseKernels,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, delta) [T, hidden], the residual stream and the previous block's output not yet
        added (None before the first layer) -> the same pair after this layer."""
        T, HD = x.shape[0], self.n_heads * self.head_dim
        an, mn = self.attn_norm, self.mlp_norm
        x, h = kernels.add_rms_norm(x, delta, an.weight, an.eps)
        # every row lands in the cache first, so attention reads its own k/v from there too
        q = cache.rope_and_store(layer, self.qkv(h))
        attn = cache.attend(layer, q)
        x, h = kernels.add_rms_norm(x, self.o(attn.reshape(T, HD)), mn.weight, mn.eps)
        return x, self.down(kernels.silu_mul(self.gate_up(h)))
