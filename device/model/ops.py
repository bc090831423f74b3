"""The decoder's pointwise math in torch, each op written once: RMSNorm (+ the residual add),
RoPE and the SwiGLU gate.

These are the reference and the CPU path. The CUDA-graph step runs the fused Triton kernels of
device/step/triton_fused.py instead (one launch each, the same contract): the layer body
takes either as its `PointwiseKernels` (this module, or that one), and RoPE reaches it through
the step's `CacheAttention.rope_and_store`. The op order inside each function is what the
bit-identity tests pin down: keep it here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ringleader.device.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalises in fp32, scales in the model dtype (as the HF reference does)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual, normed): residual = x + delta (x itself when delta is None), normed its RMSNorm.
    The layer body carries each block's output as `delta` into the next norm, so a fused kernel
    does the add and the norm in one pass."""
    residual = x if delta is None else x + delta
    return residual, rms_norm(residual, weight, eps)


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


def rope_split(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_kv: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 KV) * D] (q | k | v columns) -> rotated q [T, H, D], rotated k and v
    [T, KV, D]; cos/sin [T, D] are the rows' entries."""
    T, KV, D = qkv.shape[0], n_kv, head_dim
    H = qkv.shape[1] // D - 2 * KV
    # q and k heads rotated together: one apply_rope, the same elementwise math as one each
    qk = apply_rope(qkv[:, : (H + KV) * D].view(T, H + KV, D), cos, sin)
    return qk[:, :H].contiguous(), qk[:, H:], qkv[:, (H + KV) * D :].view(T, KV, D)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate then up halves) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
