"""One Llama-family decoder layer: its weights and the one body both steps run.

The body is shared by the eager step (`LlamaModel.step`, the CPU backend) and the static step
(`StaticStep.run`, captured into CUDA graphs). What legitimately differs between them, where
this layer's k/v go in the KV cache and how attention reads it back, is passed in as a
`CacheAttention`: `EagerAttention` (ragged, Python-side plan) or `StaticAttention` (fixed
shapes, index tensors, no host syncs). Everything else (norms, QKV, RoPE, output projection,
residuals, MLP) is written here once, calling the ops in device/model/ops.py.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from device.model.config import ModelConfig
from device.model.ops import apply_rope, rms_norm, swiglu

Device = str | torch.device


class CacheAttention(Protocol):
    """The KV-cache side of a step, for layer `layer` of the model.

    write_kv: k, v [T, num_kv_heads, head_dim] (k already rotated) into the cache rows of the
    step's T rows. attend: q [T, num_heads, head_dim] -> [T, num_heads, head_dim], each row over
    its slot's cached prefix, its own k/v included (write_kv runs first).
    """

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: Device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: CacheAttention,
        layer: int,
    ) -> torch.Tensor:
        """x [T, hidden]; cos/sin [T, head_dim] (the rows' positions) -> x [T, hidden]."""
        T = x.shape[0]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        an, mn = self.attn_norm, self.mlp_norm
        q, k, v = self.qkv(rms_norm(x, an.weight, an.eps)).split([H * D, KV * D, KV * D], dim=-1)
        q = apply_rope(q.view(T, H, D), cos, sin)
        k = apply_rope(k.view(T, KV, D), cos, sin)
        # every row lands in the cache first, so attention reads its own k/v from there too
        cache.write_kv(layer, k, v.view(T, KV, D))
        attn = cache.attend(layer, q)
        x = x + self.o(attn.reshape(T, H * D))
        return x + self.down(swiglu(self.gate_up(rms_norm(x, mn.weight, mn.eps))))
