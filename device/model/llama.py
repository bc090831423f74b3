"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) with one unified ragged step.

A step takes rows from many requests at once (decode rows and prefill chunks), writes each
row's k/v into the paged KV cache (the pages its slot's block-table row names) and attends over
that slot's cached prefix.

`LlamaModel.forward` is the trunk both steps share (embedding, the layers, final norm and
lm_head on the sampled rows); each step passes in its own KV-cache side (`CacheAttention`):
`step` (a StepBatch through the eager one, device/step/eager_attention.py; `EagerStep.run`
calls it), `StaticStep.run` the capturable one, and its pointwise kernels (torch's ops, or the
fused Triton ones on the GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ringleader.device.model import ops
from ringleader.device.model.config import ModelConfig
from ringleader.device.model.decoder_layer import CacheAttention, DecoderLayer, PointwiseKernels, RMSNorm
from ringleader.device.model.ops import rope_tables
from ringleader.device.model.presets import LOGIT_STD, PRESETS, preset_config
from ringleader.device.step.cpu_step_kernels import cpu_step_kernels
from ringleader.device.step.eager_attention import EagerAttention
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.step_batch import StepBatch
from ringleader.device.weights.checkpoint import hf_to_internal, load_config, load_state_dict
from ringleader.device.weights.gguf_checkpoint import is_gguf, load_gguf
from ringleader.device.weights.load_phase import load_phase
from ringleader.device.weights.quant_weights import GGUFMatrix, RowBands, Weight
from ringleader.device.weights.seeded_weights import fill_uniform_
from ringleader.device.weights.weight_kernels import (
    KernelLinear,
    Matmul,
    StoredEmbedding,
    band_kind,
    band_matmul,
    dense_matmul,
)

Device = str | torch.device

# how the weight matrices are stored: in the model's dtype, in bf16 (beside fp32 activations),
# or as the GGUF file's quantization (device/weights/weight_kernels.py)
WEIGHT_FORMS = ("dense", "bfloat16", "quantized")


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
        self._tied_head: Matmul | None = None  # the tied lm_head's kernel, when not dense
        self._tied_head_kind = ""
        self._head_splits = 1  # the tied dense lm_head's thread split (use_weight_kernels)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_preset(
        cls,
        name: str,
        dtype: torch.dtype = torch.float32,
        device: Device = "cpu",
        seed: int = 0,
        weights: str = "dense",
    ) -> LlamaModel:
        """Seeded random weights (the same seed gives the same weights on the same device type)."""
        config = dataclasses.replace(preset_config(name))
        with load_phase(f"making the random weights of {name} (seed {seed})"):
            model = cls(config, dtype, "meta").to_empty(device=device)
            model._init_random(seed)
        return model.use_weight_kernels(_dense_only(weights, name))

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: Device = "cpu",
        weights: str = "dense",
    ) -> LlamaModel:
        """HF-format directory: config.json + model.safetensors (or sharded with an index)."""
        config = load_config(path)
        with load_phase(f"reading the checkpoint {Path(path).name}"):
            state = hf_to_internal(load_state_dict(path, dtype=dtype, device=device), config)
        if "lm_head.weight" not in state and not config.tie_word_embeddings:
            config.tie_word_embeddings = True  # no lm_head tensor in the files: it is tied
        model = cls(config, dtype, "meta")
        model.load_state_dict(state, strict=True, assign=True)
        return model.requires_grad_(False).use_weight_kernels(_dense_only(weights, str(path)))

    @classmethod
    def from_gguf(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: Device = "cpu",
        weights: str = "dense",
    ) -> LlamaModel:
        """A Llama-family GGUF file: dequantized to `dtype` at load, or with weights="quantized"
        its quantized matrices kept as they are in the file (device/weights/quant_weights.py)."""
        config, state = load_gguf(path, dtype, device, keep_quantized=weights == "quantized")
        with load_phase(f"arranging the tensors as the model's {config.num_layers} layers"):
            internal = hf_to_internal(state, config)  # q|k|v and gate|up joined
            stored = {k: v for k, v in internal.items() if not isinstance(v, torch.Tensor)}
            model = cls(config, dtype, "meta")
            dense = {k: v for k, v in internal.items() if isinstance(v, torch.Tensor)}
            missing, _ = model.load_state_dict(dense, strict=False, assign=True)
        if set(missing) != set(stored):
            raise ValueError(
                f"{path}: weights missing from the file: {sorted(set(missing) - set(stored))[:8]}"
            )
        return model.requires_grad_(False).use_weight_kernels(weights, stored)

    @classmethod
    def from_spec(
        cls,
        spec: str | Path,
        dtype: torch.dtype = torch.float32,
        device: Device = "cpu",
        seed: int = 0,
        weights: str = "dense",
    ) -> LlamaModel:
        """A preset name, a .gguf file, or else a checkpoint directory; `weights` one of
        WEIGHT_FORMS ("quantized" needs a GGUF file)."""
        if weights not in WEIGHT_FORMS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMS)}, got {weights!r}")
        if isinstance(spec, str) and spec in PRESETS:
            return cls.from_preset(spec, dtype, device, seed, weights)
        if is_gguf(spec):
            return cls.from_gguf(spec, dtype, device, weights)
        return cls.from_checkpoint(spec, dtype, device, weights)

    def use_weight_kernels(
        self, weights: str = "dense", stored: dict[str, Weight] | None = None
    ) -> LlamaModel:
        """Puts each matrix behind its kernel (device/weights/weight_kernels.py): the `stored` ones
        (GGUF matrices kept quantized, by internal name) through theirs; on the CPU every dense
        one through the thread-split matmul, in bf16 with weights="bfloat16". On CUDA dense
        matrices stay nn.Linear. Returns self."""
        stored = stored or {}
        dev, dtype = self.device, self.dtype
        on_cpu = dev.type == "cpu"
        splits = torch.get_num_threads() if on_cpu else 1
        kept_dtype = torch.bfloat16 if weights == "bfloat16" else dtype
        kernels = {k: w for k, w in stored.items() if k != "embed.weight" or self.lm_head is None}
        work = _kernel_work(kernels, on_cpu, kept_dtype != dtype)  # "": the weights as they are
        with load_phase(work) if work else contextlib.nullcontext():
            self._put_behind_kernels(stored, kept_dtype, splits)
        return self

    def _put_behind_kernels(self, stored: dict[str, Weight], kept_dtype: torch.dtype, splits: int) -> None:
        dev, dtype = self.device, self.dtype
        on_cpu = dev.type == "cpu"

        def kernel_linear(name: str, module: nn.Module) -> nn.Module:
            weight = stored.get(name + ".weight")
            if weight is None:
                if not on_cpu and kept_dtype == dtype:
                    return module
                weight = module.weight.detach().to(kept_dtype)
            return KernelLinear(weight, module.bias, dtype, dev, splits)

        for i, layer in enumerate(self.layers):
            for attr in ("qkv", "o", "gate_up", "down"):
                setattr(layer, attr, kernel_linear(f"layers.{i}.{attr}", getattr(layer, attr)))
        if self.lm_head is not None:
            self.lm_head = kernel_linear("lm_head", self.lm_head)
        table = stored.get("embed.weight")
        if isinstance(table, GGUFMatrix):
            self.embed = StoredEmbedding(table, dtype)
            table_kernel = table
        else:
            if kept_dtype != dtype:  # the table (and the tied head) kept in bf16 too
                self.embed = StoredEmbedding(self.embed.weight.detach().to(kept_dtype), dtype)
            table_kernel = self.embed.weight if isinstance(self.embed, nn.Embedding) else self.embed.table
        if self.lm_head is None and not isinstance(table_kernel, torch.Tensor):
            self._tied_head = band_matmul(table_kernel, dtype, dev, splits)
            self._tied_head_kind = band_kind(table_kernel)
        self._head_splits = splits

    @torch.no_grad()
    def _init_random(self, seed: int) -> None:
        c = self.config
        counter = 0  # the next free counter of the seeded stream (the same weights on every device)

        def fill(p: torch.Tensor, std: float) -> None:
            nonlocal counter
            counter = fill_uniform_(p, std, seed, counter)

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
        """The dtype of the activations and the KV cache (the norms'; matrices may be stored
        otherwise, see use_weight_kernels)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_kv_cache(self, n_slots: int, max_ctx: int, dtype: torch.dtype | None = None) -> KVCache:
        """A cache of n_slots slots of max_ctx positions each, with its fixed slot_table."""
        return KVCache.for_slots(self.config, n_slots, max_ctx, dtype=dtype or self.dtype, device=self.device)

    # ---- what a backend builds around the model (NullModel answers the same calls) ------------

    def eager_step(self, n_slots: int, n_pages: int, page_size: int, kv_dtype: torch.dtype):
        """The CPU backend's step over a paged KV cache of n_pages pages (n_slots: the step's
        sample places, RingConfig.sample_len, which the eager step sizes per call)."""
        from ringleader.device.step.eager_step import EagerStep  # the steps read this module's types

        return EagerStep(self, KVCache.for_model(self.config, n_pages, page_size, kv_dtype, self.device))

    def static_step(
        self,
        n_slots: int,
        n_pages: int,
        page_size: int,
        max_ctx: int,
        token_budget: int,
        attention: str,
        step_kernels: str = "fused",
        score_rows: int = 0,
        spec_tokens: int = 0,
    ):
        """CUDA's step in static shapes, to capture per bucket, over the pool's pages and the
        scratch page pad rows write into (step_kernels: EngineConfig.step_kernels; score_rows
        and spec_tokens: the rings' RlConfig fields)."""
        from ringleader.device.step.static_step import StaticStep

        kv = StaticStep.new_kv_cache(self, n_pages, page_size)
        return StaticStep(
            self, kv, n_slots, max_ctx, token_budget, attention=attention, step_kernels=step_kernels,
            score_rows=score_rows, spec_tokens=spec_tokens,
        )  # fmt: skip

    def description_fields(self, weights: str) -> dict:
        """A backend description's fields about the weights (`weights`: the --weights form)."""
        return {"weights": weights, **self.weights_description()}

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

    def weights_description(self) -> dict:
        """What the weights take and how the matrices are kept: {"weight_mib": ..., "matrices":
        {"float32": 120, "Q4_1": 120, "Q8_0": 1, "Q6_K->dense": 4, ...}} (a fused projection
        counts once per band)."""
        seen: set[int] = set()
        total = 0
        for p in self.parameters():
            if p.untyped_storage().data_ptr() not in seen:
                seen.add(p.untyped_storage().data_ptr())
                total += p.untyped_storage().nbytes()
        kinds: dict[str, int] = {}
        for m in self.modules():
            if isinstance(m, KernelLinear):
                total += sum(getattr(b, "nbytes", 0) for b in m.bands)
                for kind in m.kinds:
                    kinds[kind] = kinds.get(kind, 0) + 1
            elif isinstance(m, StoredEmbedding):
                total += m.nbytes
            elif isinstance(m, nn.Linear):
                kind = str(m.weight.dtype).removeprefix("torch.")
                kinds[kind] = kinds.get(kind, 0) + 1
        if self._tied_head is not None:  # the tied lm_head, kept apart from its table
            total += getattr(self._tied_head, "nbytes", 0)
            kinds[self._tied_head_kind] = kinds.get(self._tied_head_kind, 0) + 1
        return {"weight_mib": round(total / (1 << 20), 1), "matrices": kinds}

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The dense lm_head matrix (the embedding table when tied)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [R, hidden] (final-normed) -> logits [R, vocab] in the model's dtype."""
        if self.lm_head is not None:
            return self.lm_head(h)
        if self._tied_head is not None:
            return self._tied_head(h)
        table = self.embed.weight if isinstance(self.embed, nn.Embedding) else self.embed.table
        return dense_matmul(h, table, self._head_splits)

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
        return self.logits(h).float()

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
        kernels = cpu_step_kernels() if block_table.device.type == "cpu" else None
        cache = EagerAttention(batch, plan, kv, block_table, cos, sin, kernels)
        return self(batch.token_ids, cache, batch.sample_rows, kernels or ops)


def _kernel_work(kernels: dict[str, Weight], on_cpu: bool, widening: bool) -> str:
    """What use_weight_kernels spends its time on, for the start-up log ("" when it only wraps
    the weights): repacking the int4 matrices of `kernels` (the stored matrices that get a
    matmul kernel) for it, or converting dense ones to bf16."""
    quantized = sum(
        any(isinstance(p, GGUFMatrix) and p.has_digits for p in (w.parts if isinstance(w, RowBands) else [w]))
        for w in kernels.values()
    )
    if quantized:
        kernel = "the CPU's quantized kernel" if on_cpu else "the Triton int4 kernel"
        return f"repacking {quantized} quantized matrices for {kernel}"
    return "converting the weights to bfloat16" if widening else ""


def _dense_only(weights: str, spec: str) -> str:
    if weights == "quantized":
        raise ValueError(
            f"--weights quantized keeps a GGUF file's quantization; {spec} is no GGUF file "
            "(use --weights auto, fp32 or bf16)"
        )
    return weights


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
