"""The decoder's pointwise math, each op written once: RMSNorm, RoPE and the SwiGLU gate.

Both steps (the eager `LlamaModel.step` and the CUDA-graph `StaticStep.run`) reach these only
through `DecoderLayer.forward` and `LlamaModel.forward`, so a fused kernel (RMSNorm + residual,
RoPE + KV write, SiLU * up) replaces the call here and in the layer body, nowhere else. The op
order inside each function is what the bit-identity tests pin down: keep it when fusing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from device.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalises in fp32, scales in the model dtype (as the HF reference does)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (fp32), with llama3 scaling when configured (as HF's
    parameters, or as the per-frequency divisors GGUF files store)."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_freq_factors is not None:
        return inv / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    rs = config.rope_scaling
    if not rs:
        return inv
    factor, lo_f, hi_f = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    orig = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    # long wavelengths are slowed down by `factor`, short ones kept, the band between blended
    scaled = torch.where(wavelen > orig / lo_f, inv / factor, inv)
    smooth = (orig / wavelen - lo_f) / (hi_f - lo_f)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < orig / hi_f) & ~(wavelen > orig / lo_f)
    return torch.where(in_band, blended, scaled)


def rope_tables(
    config: ModelConfig, max_ctx: int, dtype: torch.dtype, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_ctx, head_dim] in `dtype`, for positions [0, max_ctx)."""
    inv = rope_inv_freq(config).to(device)
    freqs = torch.outer(torch.arange(max_ctx, device=device, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim]. Half-split (rotate_half) convention."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate then up halves) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
