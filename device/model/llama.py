"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) with one unified ragged step.

A step takes rows from many requests at once (decode rows and prefill chunks), writes each
row's k/v into the paged KV cache (the pages its slot's block-table row names) and attends over
that slot's cached prefix.

`LlamaModel.forward` is the trunk both steps share (embedding, the layers, final norm and
lm_head on the sampled rows); each step passes in its own KV-cache side (`CacheAttention`):
`step` (a StepBatch through the eager one, device/model/eager_attention.py; `EagerStep.run`
calls it), `StaticStep.run` the capturable one, and its pointwise kernels (torch's ops, or the
fused Triton ones on the GPU).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ringleader.device.model import ops
from ringleader.device.model.checkpoint import hf_to_internal, load_config, load_state_dict
from ringleader.device.model.config import ModelConfig
from ringleader.device.model.decoder_layer import CacheAttention, DecoderLayer, PointwiseKernels, RMSNorm
from ringleader.device.model.eager_attention import EagerAttention
from ringleader.device.model.gguf_checkpoint import is_gguf, load_gguf
from ringleader.device.model.kv_cache import KVCache
from ringleader.device.model.ops import rope_tables
from ringleader.device.model.presets import LOGIT_STD, PRESETS, preset_config
from ringleader.device.model.step_batch import StepBatch

Device = str | torch.device


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
    def from_gguf(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: Device = "cpu"
    ) -> LlamaModel:
        """A Llama-family GGUF file, dequantized to `dtype` at load."""
        config, state = load_gguf(path, dtype, device)
        model = cls(config, dtype, "meta")
        model.load_state_dict(hf_to_internal(state, config), strict=True, assign=True)
        return model.requires_grad_(False)

    @classmethod
    def from_spec(
        cls, spec: str | Path, dtype: torch.dtype = torch.float32, device: Device = "cpu", seed: int = 0
    ) -> LlamaModel:
        """A preset name, a .gguf file, or else a checkpoint directory."""
        if isinstance(spec, str) and spec in PRESETS:
            return cls.from_preset(spec, dtype, device, seed)
        if is_gguf(spec):
            return cls.from_gguf(spec, dtype, device)
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
        """A cache of n_slots slots of max_ctx positions each, with its fixed slot_table."""
        return KVCache.for_slots(self.config, n_slots, max_ctx, dtype=dtype or self.dtype, device=self.device)

    def prepare(self, max_ctx: int) -> None:
        """Precomputes the RoPE cos/sin tables for positions [0, max_ctx) (once; step calls it
        too, but call it up front before capturing CUDA graphs)."""
        cos = self._cos
        if (
            cos is not None
            and cos.shape[0] >= max_ctx
            and (cos.device, cos.dtype) == (self.device, self.dtype)
        ):
            return  # (rebuilt after .to(): the tables are not parameters)
        self._cos, self._sin = rope_tables(self.config, max_ctx, self.dtype, self.device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    # ---- the step -------------------------------------------------------------------------

    def forward(
        self,
        token_ids: torch.Tensor,
        cache: CacheAttention,
        out_rows: torch.Tensor,
        kernels: PointwiseKernels = ops,
    ) -> torch.Tensor:
        """The trunk of both steps: token_ids [T] (int64); `cache` applies RoPE, writes and
        reads the KV cache; returns fp32 logits [len(out_rows), vocab]. Only the out_rows go
        through the final norm and the (large) lm_head."""
        x, delta = self.embed(token_ids), None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, cache, kernels, i)
        x = x.index_select(0, out_rows)
        delta = None if delta is None else delta.index_select(0, out_rows)
        _, h = kernels.add_rms_norm(x, delta, self.norm.weight, self.norm.eps)
        return F.linear(h, self.lm_head_weight).float()

    @torch.inference_mode()
    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """fp32 logits of the next token after `prompt_ids`, from one prefill into a scratch
        cache (parity checks against other implementations)."""
        kv = self.new_kv_cache(1, max(64, len(prompt_ids) + 1))
        batch = StepBatch.from_segments([(0, list(prompt_ids), 0)], device=self.device)
        return self.step(batch, kv)[0]

    def step(self, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """Runs all rows of `batch`, updating `kv` through batch.block_table (or, without one,
        kv.slot_table); returns fp32 logits [len(sample_rows), vocab]."""
        block_table = batch.block_table if batch.block_table is not None else kv.slot_table
        if block_table is None:
            raise ValueError(
                "no block table: the batch carries none and the KV cache has no slot_table "
                "(build it with KVCache.for_slots / LlamaModel.new_kv_cache)"
            )
        plan = batch.get_plan()
        self.prepare(block_table.shape[1] * kv.page_size)  # the longest context the table reaches
        cos = self._cos.index_select(0, batch.positions)
        sin = self._sin.index_select(0, batch.positions)
        cache = EagerAttention(batch, plan, kv, block_table, cos, sin)
        return self(batch.token_ids, cache, batch.sample_rows)


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
