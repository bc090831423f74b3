"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) with one unified ragged step.

A step takes rows from many requests at once (decode rows and prefill chunks), writes each
row's k/v into the per-slot KV cache and attends over that slot's cached prefix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from device.model.checkpoint import hf_to_internal, load_config, load_state_dict
from device.model.config import ModelConfig
from device.model.kv_cache import KVCache
from device.model.presets import LOGIT_STD, PRESETS, preset_config
from device.model.step_batch import StepBatch, StepPlan

Device = str | torch.device


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: Device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32, scale in the model dtype (as the HF reference does)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (fp32), with llama3 scaling when configured."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim]. Half-split (rotate_half) convention."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def ragged_attention(
    q: torch.Tensor,
    batch: StepBatch,
    plan: StepPlan,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]; each row attends causally over its slot's cache [0, pos].

    GQA without repeating k/v: the G query heads sharing a kv head are folded into the
    query-length axis, so k/v keep their num_kv_heads heads.
    """
    T, H, D = q.shape
    KV = k_cache.shape[2]
    G = H // KV
    dev = q.device
    all_decode = plan.n_decode == T and plan.decode_rows is None
    out = None if all_decode else torch.empty_like(q)
    if plan.n_decode:
        rows = plan.decode_rows
        qd = q if rows is None else q.index_select(0, rows)
        slots = batch.slot_of if rows is None else batch.slot_of.index_select(0, rows)
        pos = batch.positions if rows is None else batch.positions.index_select(0, rows)
        B, L = qd.shape[0], plan.decode_max_ctx
        # padded only to the longest context among these rows
        kd = k_cache[slots, :L].transpose(1, 2)  # [B, KV, L, D]
        vd = v_cache[slots, :L].transpose(1, 2)
        mask = torch.arange(L, device=dev)[None, :] <= pos[:, None]  # [B, L]
        od = F.scaled_dot_product_attention(qd.view(B, KV, G, D), kd, vd, attn_mask=mask[:, None, None, :])
        od = od.reshape(B, H, D)
        if rows is None:
            out = od
        else:
            out.index_copy_(0, rows, od)
    for slot, start, n, ctx_end in plan.prefill:
        qs = q[start : start + n].view(n, KV, G, D).permute(1, 2, 0, 3).reshape(1, KV, G * n, D)
        ks = k_cache[slot, :ctx_end].transpose(0, 1)[None]  # [1, KV, L, D]
        vs = v_cache[slot, :ctx_end].transpose(0, 1)[None]
        # offset causal mask: this chunk's first row sits at position ctx_end - n
        q_pos = torch.arange(ctx_end - n, ctx_end, device=dev)
        mask = torch.arange(ctx_end, device=dev)[None, :] <= q_pos[:, None]  # [n, L]
        os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.repeat(G, 1))
        out[start : start + n] = os_.view(KV, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
    return out


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

    def forward(self, x, cos, sin, batch: StepBatch, plan: StepPlan, k_cache, v_cache):
        T = x.shape[0]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        q, k, v = self.qkv(self.attn_norm(x)).split([H * D, KV * D, KV * D], dim=-1)
        q = apply_rope(q.view(T, H, D), cos, sin)
        k = apply_rope(k.view(T, KV, D), cos, sin)
        # every row lands in the cache first, so attention reads its own k/v from there too
        k_cache[batch.slot_of, batch.positions] = k.to(k_cache.dtype)
        v_cache[batch.slot_of, batch.positions] = v.view(T, KV, D).to(v_cache.dtype)
        attn = ragged_attention(q, batch, plan, k_cache, v_cache)
        x = x + self.o(attn.reshape(T, H * D))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: Device = "cpu"
    ) -> None:
        """Parameters are allocated uninitialised; use from_preset / from_checkpoint."""
        super().__init__()
        self.config = config
        c = config
        kw = dict(dtype=dtype, device=device)
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(c, dtype, device) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **kw)
        self.lm_head = (
            None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False, **kw)
        )
        self.requires_grad_(False)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_preset(
        cls, name: str, dtype: torch.dtype = torch.float32, device: Device = "cpu", seed: int = 0
    ) -> LlamaModel:
        """Seeded random weights (the same seed gives the same weights on the same device type)."""
        config = dataclasses.replace(preset_config(name))
        model = cls(config, dtype, "meta").to_empty(device=device)
        model._init_random(seed)
        return model

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: Device = "cpu"
    ) -> LlamaModel:
        """HF-format directory: config.json + model.safetensors (or sharded with an index)."""
        config = load_config(path)
        state = hf_to_internal(load_state_dict(path, dtype=dtype, device=device), config)
        if "lm_head.weight" not in state and not config.tie_word_embeddings:
            config.tie_word_embeddings = True  # no lm_head tensor in the files: it is tied
        model = cls(config, dtype, "meta")
        model.load_state_dict(state, strict=True, assign=True)
        return model.requires_grad_(False)

    @classmethod
    def from_spec(
        cls, spec: str | Path, dtype: torch.dtype = torch.float32, device: Device = "cpu", seed: int = 0
    ) -> LlamaModel:
        """A preset name, or else a checkpoint directory."""
        if isinstance(spec, str) and spec in PRESETS:
            return cls.from_preset(spec, dtype, device, seed)
        return cls.from_checkpoint(spec, dtype, device)

    @torch.no_grad()
    def _init_random(self, seed: int) -> None:
        c = self.config
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def fill(p: torch.Tensor, std: float) -> None:
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std)

        out_std = LOGIT_STD / math.sqrt(c.hidden_size)
        fill(self.embed.weight, out_std)
        for layer in self.layers:
            layer.attn_norm.weight.fill_(1.0)
            layer.mlp_norm.weight.fill_(1.0)
            fill(layer.qkv.weight, 1 / math.sqrt(c.hidden_size))
            fill(layer.o.weight, 1 / math.sqrt(c.num_heads * c.head_dim))
            fill(layer.gate_up.weight, 1 / math.sqrt(c.hidden_size))
            fill(layer.down.weight, 1 / math.sqrt(c.intermediate_size))
            for lin in (layer.qkv, layer.o):
                if lin.bias is not None:
                    lin.bias.zero_()
        self.norm.weight.fill_(1.0)
        if self.lm_head is not None:
            fill(self.lm_head.weight, out_std)

    # ---- properties -----------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_kv_cache(self, n_slots: int, max_ctx: int, dtype: torch.dtype | None = None) -> KVCache:
        return KVCache.for_model(self.config, n_slots, max_ctx, dtype or self.dtype, self.device)

    def prepare(self, max_ctx: int) -> None:
        """Precomputes the RoPE cos/sin tables for positions [0, max_ctx) (once; step calls it
        too, but call it up front before capturing CUDA graphs)."""
        if self._cos is not None and self._cos.shape[0] >= max_ctx and self._cos.device == self.device:
            return
        inv = rope_inv_freq(self.config).to(self.device)
        freqs = torch.outer(torch.arange(max_ctx, device=self.device, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """Runs all rows of `batch`, updating `kv`; returns fp32 logits [len(sample_rows), vocab]."""
        plan = batch.get_plan()
        self.prepare(kv.max_ctx)
        cos = self._cos.index_select(0, batch.positions)
        sin = self._sin.index_select(0, batch.positions)
        x = self.embed(batch.token_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch, plan, kv.k[i], kv.v[i])
        # only the sampled rows go through the final norm and the (large) lm_head
        h = self.norm(x.index_select(0, batch.sample_rows))
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w).float()


def generate_greedy(
    model: LlamaModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    slot: int = 0,
    kv: KVCache | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> list[int]:
    """Greedy decoding through `step`: the prompt as one segment, then 1-row decode steps.
    Returns only the new tokens (stops early on an id in eos_token_ids, if given)."""
    if kv is None:
        kv = model.new_kv_cache(slot + 1, len(prompt_ids) + max_new_tokens)
    stop = set(eos_token_ids or ())
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    batch = StepBatch.from_segments([(slot, list(prompt_ids), 0)], device=model.device)
    pos = len(prompt_ids)
    while True:
        tok = int(model.step(batch, kv)[0].argmax())
        out.append(tok)
        if len(out) >= max_new_tokens or tok in stop:
            return out
        batch = StepBatch.from_segments([(slot, [tok], pos)], device=model.device)
        pos += 1
