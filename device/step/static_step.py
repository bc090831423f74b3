"""The model step in static shapes, for capture as one CUDA graph per token-count bucket.

`StaticStep.run(bucket, layout)` reads the scheduler's step layout straight from device
tensors (`StepLayout`) and does what `EagerStep.run` does for the CPU backend, its reference
(the same trunk and decoder-layer body and the same sampler, with `StaticAttention` as the
KV-cache side, or with `attention="triton"` the Triton attention, `FusedStaticAttention` and the
fused pointwise kernels of triton_fused), but without anything that depends on tensor values
on the host: rows [0, bucket) are processed (pad rows carry slot_of = -1), logits and samples
are computed for the first min(bucket, sample_len) sample entries (a step never samples more
entries than it has rows), and only the first n_samples of them (a device-side count) write
next_token. It never reads the layout's segments, n_tokens or n_segments.

Paging: the KV cache is a pool of pages; row t's k/v go to page block_table[slot_of[t],
pos // PS] at offset pos % PS (layout.block_table, written by the scheduler), and attention
reads each row's context through the same table.

Scratch page: pad rows still produce k/v; they are written to the cache's last page (offset
0), which the scheduler never hands out, so the cache has one page more than the scheduler's
pool (`StaticStep.new_kv_cache`). Real pages are never touched by pad rows.

Capture on CUDA (the capturing code's side):
  1. model.prepare(max_ctx) is called by StaticStep.__init__; build the StepLayout (device
     tensors that the scheduler writes) and the KV cache before capturing.
  2. step.warmup(layout, buckets): one eager run per bucket with an all-pad layout; compiles the
     Triton kernel, initialises cuBLAS and the allocator's pools. It overwrites the layout.
  3. per bucket b: capture `logits_b = step.run(b, layout)` on a side stream (capture_begin /
     capture_end, thread-local mode); keep the graph, and logits_b where replays are checked.
  4. per step the scheduler fills the layout and picks the bucket; replay graph[bucket].
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from ringleader.device.model import ops
from ringleader.device.model.decoder_layer import PointwiseKernels
from ringleader.device.model.ops import rope_split
from ringleader.device.sampling.sampler import counter_uniform, penalize_and_scale, sample, store_logprobs
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.step_layout import StepLayout, end_ids_for
from ringleader.device.step.triton_attention import ragged_attention_reference
from ringleader.device.step.triton_gemv import FUSED_MAX_ROWS
from ringleader.device.step.triton_launch import pdl_supported

if TYPE_CHECKING:  # a type only: the model builds its steps (LlamaModel.eager_step, static_step)
    from ringleader.device.model.llama import LlamaModel


# prompt logprobs in a captured graph: the score rows each step takes the logits of, live or not
# (static shapes), and so the lm_head rows it adds to every step: CUDA's default score_rows
GRAPH_SCORE_ROWS = 16


class StaticAttention:
    """CacheAttention for one static step in torch: fixed shapes, index tensors, no host syncs.

    Row t's k/v go to flat cache row page * PS + position % PS of the layer's pages viewed as
    [P * PS, KV, D], page = block_table[slot, position // PS] (pad rows: the scratch page,
    offset 0), with index_copy_; `attend` has the signature of ragged_attention_reference.
    """

    def __init__(
        self, step: StaticStep, block_table: torch.Tensor, slot_of: torch.Tensor, positions: torch.Tensor
    ) -> None:
        self.step, self.kv = step, step.kv
        self.block_table, self.slot_of, self.positions = block_table, slot_of, positions
        self._prepare_rows()

    def _prepare_rows(self) -> None:
        """Once per step: each row's cache row and RoPE entries."""
        step, PS = self.step, self.kv.page_size
        pos = self.positions.long().clamp(0, step.max_ctx - 1)
        live = self.slot_of >= 0
        page = self.block_table[self.slot_of.long().clamp(min=0), pos // PS].long()
        self.cache_row = torch.where(live, page * PS + pos % PS, step.scratch_page * PS)
        self.cos, self.sin = step._cos.index_select(0, pos), step._sin.index_select(0, pos)

    def rope_and_store(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv.layer(layer)
        KV, D = self.kv.num_kv_heads, self.kv.head_dim
        q, k, v = rope_split(qkv, self.cos, self.sin, KV, D)
        k_cache.view(-1, KV, D).index_copy_(0, self.cache_row, k.to(k_cache.dtype))
        v_cache.view(-1, KV, D).index_copy_(0, self.cache_row, v.to(v_cache.dtype))
        return q

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv.layer(layer)
        step = self.step
        return step._attend(q, k_cache, v_cache, self.block_table, self.slot_of, self.positions, step.scale)


class FusedStaticAttention(StaticAttention):
    """StaticAttention whose RoPE and k/v store are one Triton launch per layer
    (triton_fused.rope_store_kv reads the cos/sin tables and the block table itself)."""

    def _prepare_rows(self) -> None:
        pass  # the kernel does it per row

    def rope_and_store(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        from ringleader.device.step.triton_fused import rope_store_kv

        kv, step = self.kv, self.step
        return rope_store_kv(
            qkv,
            step._cos[: step.max_ctx],  # positions clamp to the step's max_ctx, as in torch
            step._sin[: step.max_ctx],
            self.block_table,
            self.slot_of,
            self.positions,
            kv.k[layer],
            kv.v[layer],
            step.scratch_page,
            step.n_heads,
            kv.num_kv_heads,
            kv.head_dim,
        )


class StaticStep:
    """The unified ragged step with static shapes; see the module docstring for capture."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        n_slots: int,
        max_ctx: int,
        token_budget: int,
        attention: str | Callable[..., torch.Tensor] = "triton",
        fused: bool | None = None,
        step_kernels: str = "fused",
        score_rows: int = 0,
        spec_tokens: int = 0,
    ) -> None:
        """kv: the paged cache, its last page the scratch page (StaticStep.new_kv_cache).
        attention: "triton", "torch" (the masked reference) or a function with the
        signature of ragged_attention_reference. fused: the pointwise work (RMSNorm + residual,
        RoPE + k/v store, SiLU * up) as the Triton kernels of triton_fused instead of torch
        ops; None: with attention="triton". step_kernels: "fused" runs buckets of up to
        FUSED_MAX_ROWS rows as device/step/fused_step.py's kernels (with attention="triton"
        and triton installed; else, or for weights those kernels cannot read, the layered step,
        and `fused_off` says why); "layered": this class's own step for every bucket.
        score_rows: the scheduler's (RlConfig.score_rows): each run takes the logits of
        min(bucket, score_rows) score rows for prompt logprobs (that many more lm_head rows a
        step, whether or not an entry is live); 0: none. spec_tokens: the scheduler's
        (RlConfig.spec_tokens): a step has up to n_slots * (1 + spec_tokens) sample entries
        and next_token places (a decoding slot samples each of its verification rows)."""
        if step_kernels not in ("fused", "layered"):
            raise ValueError(f"step_kernels must be 'fused' or 'layered', got {step_kernels!r}")
        self._attend: Callable[..., torch.Tensor]
        if attention == "triton":
            from ringleader.device.step.triton_attention import HAVE_TRITON, ragged_attention_triton

            if not HAVE_TRITON:
                raise RuntimeError("attention='triton' needs triton; use attention='torch'")
            # split-K's ticket counters, the step's own (zero, left zero by every launch): a
            # per-call allocation would be a memset node per layer in each captured graph
            tickets = torch.zeros(
                token_budget * model.config.num_kv_heads, dtype=torch.int32, device=model.device
            )
            self._attend = functools.partial(
                ragged_attention_triton, tickets=tickets, use_pdl=pdl_supported(model.device)
            )
        elif attention == "torch":
            self._attend = ragged_attention_reference
        elif callable(attention):
            self._attend = attention
        else:
            raise ValueError(f"attention must be 'triton' or 'torch', got {attention!r}")
        self.fused = attention == "triton" if fused is None else fused
        if self.fused:
            from ringleader.device.sampling.triton_sampler import (
                counter_uniform_triton,
                penalize_and_scale_triton,
                store_logprobs_triton,
            )
            from ringleader.device.step import triton_fused

            self._kernels: PointwiseKernels = triton_fused
            self._cache_side: type[StaticAttention] = FusedStaticAttention
            self._uniform, self._scale = counter_uniform_triton, penalize_and_scale_triton
            self._store_logprobs = store_logprobs_triton
        else:
            self._kernels, self._cache_side = ops, StaticAttention
            self._uniform, self._scale = counter_uniform, penalize_and_scale
            self._store_logprobs = self._store_logprobs_torch
        c = model.config
        self.model, self.kv, self.attention = model, kv, attention
        self.n_slots, self.max_ctx, self.token_budget = n_slots, max_ctx, token_budget
        self.score_rows = score_rows
        self.sample_len = n_slots * (1 + spec_tokens)  # sample entries, and next_token's places
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = 1.0 / (c.head_dim**0.5)  # SDPA's default, as the eager step uses
        self.scratch_page = kv.n_pages - 1
        dev = model.device
        model.prepare(max_ctx)
        assert model._cos is not None and model._sin is not None  # prepare() made them
        self._cos, self._sin = model._cos, model._sin  # kept: prepare() may swap them later
        self._entry_ids = torch.arange(max(self.sample_len, score_rows), dtype=torch.int32, device=dev)
        # next_token plus one sink element that masked sample entries are scattered into
        self._token_sink = torch.zeros(self.sample_len + 1, dtype=torch.int32, device=dev)
        # the model's end ids, which a row below its min_tokens cannot draw (a graph reads them)
        self._end_ids = end_ids_for(c.eos_token_ids, dev)
        self.fused_decode, self.fused_off = self._fused_decode(step_kernels)

    def _fused_decode(self, step_kernels: str):
        """(FusedDecode, None) when the fused kernels run the small buckets, else (None, why)."""
        if step_kernels == "layered":
            return None, "--step-kernels layered"
        if self.attention != "triton" or not self.fused:
            return None, "the fused step needs attention='triton' and the fused pointwise kernels"
        from ringleader.device.step.fused_step import FusedDecode

        fused = FusedDecode(self)
        return (None, fused.unsupported) if fused.unsupported else (fused, None)

    @staticmethod
    def new_kv_cache(
        model: LlamaModel, n_pages: int, page_size: int = 16, dtype: torch.dtype | None = None
    ) -> KVCache:
        """A paged KV cache of the scheduler's n_pages pages plus the scratch page (the last)."""
        return KVCache.for_model(model.config, n_pages + 1, page_size, dtype or model.dtype, model.device)

    # ---- the step -----------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, bucket: int, layout: StepLayout) -> torch.Tensor:
        """Runs rows [0, bucket) of `layout`, writes next_token[sample_slot[i]] for the first
        n_samples sample entries; returns their fp32 logits [min(bucket, sample_len), vocab]
        (rows >= n_samples are garbage; a captured graph's replays rewrite this tensor; the
        raw logits: penalties and temperature go to a copy), and step_logprobs[sample_slot[i]]
        for the entries whose request asked for logprobs."""
        if not 0 < bucket <= self.token_budget:
            raise ValueError(f"bucket {bucket} not in [1, {self.token_budget}]")
        reach = layout.block_table.shape[1] * self.kv.page_size
        if reach < self.max_ctx:  # a clamped position's page must be in the table
            raise ValueError(f"the block table reaches {reach} positions < max_ctx {self.max_ctx}")
        if self.fused_decode is not None and bucket <= FUSED_MAX_ROWS:
            return self.fused_decode.run(bucket, layout)
        cache = self._cache_side(self, layout.block_table, layout.slot_of[:bucket], layout.positions[:bucket])
        # a step samples at most one entry per row: the bucket bounds the sampled entries
        m = min(bucket, self.sample_len)
        rows = layout.sample_row[:m].long().clamp(0, bucket - 1)  # stale entries may point anywhere
        k = min(bucket, self.score_rows)  # a step scores at most one entry per row
        if k:
            rows = torch.cat([rows, layout.score_row[:k].long().clamp(0, bucket - 1)])
        out = self.model(layout.token_ids[:bucket].long(), cache, rows, self._kernels)
        logits = out[:m]
        self._sample_into(logits, layout, m)
        if k:
            self.store_scores(out[m:], layout, k)
        return logits

    def score_logits(self, x: torch.Tensor, layout: StepLayout, bucket: int) -> torch.Tensor:
        """fp32 logits [min(bucket, score_rows), vocab] of the score rows of the residual stream
        x [bucket, hidden] (the fused step's, which computes the sample rows' logits itself)."""
        k = min(bucket, self.score_rows)
        h = x.index_select(0, layout.score_row[:k].long().clamp(0, bucket - 1))
        _, h = self._kernels.add_rms_norm(h, None, self.model.norm.weight, self.model.norm.eps)
        return self.model.logits(h).float()

    def store_scores(self, logits: torch.Tensor, layout: StepLayout, k: int) -> None:
        """Prompt logprobs: score entry i's record from its row's raw logits [k, vocab] into
        step_prompt_logprobs[i], for the entries below n_score (read on the device)."""
        tokens = layout.score_token[:k].long().clamp(0, logits.shape[1] - 1)
        self._store_logprobs(
            layout.step_prompt_logprobs,
            self._entry_ids[:k],
            logits,
            tokens,
            layout.score_top[:k],
            layout.n_score,
        )

    def _sample_into(self, logits: torch.Tensor, layout: StepLayout, m: int) -> None:
        valid = self._entry_ids[:m] < layout.n_samples  # [m], n_samples read on the device
        # stale entries sample greedily with nothing applied (no NaN from stale parameters)
        # and land in the sink
        params = layout.sampling(m, end_ids=self._end_ids)
        tokens = sample(logits, params, uniform=self._uniform, valid=valid, scale=self._scale)
        n_places = self.sample_len
        slot = layout.sample_slot[:m].long().clamp(0, n_places - 1)
        target = torch.where(valid, slot, n_places)
        sink = self._token_sink
        sink[:n_places].copy_(layout.next_token)
        sink.index_copy_(0, target, tokens.to(torch.int32))
        layout.next_token.copy_(sink[:n_places])
        # from the raw logits (sample() leaves them as they are); a row that asked none, or a
        # stale entry, writes no record
        self._store_logprobs(layout.step_logprobs, slot, logits, tokens, params.logprobs, layout.n_samples)

    @staticmethod
    def _store_logprobs_torch(table, slot, logits, tokens, top_n, n_samples) -> None:
        valid = torch.arange(top_n.shape[0], device=top_n.device) < n_samples
        store_logprobs(table, slot, logits, tokens, top_n, valid)

    def warmup(self, layout: StepLayout, buckets: Iterable[int]) -> None:
        """One eager run per bucket on an all-pad layout (no samples), before any capture:
        compiles the attention kernel and initialises libraries. Overwrites the layout's rows."""
        layout.slot_of.fill_(-1)
        layout.positions.zero_()
        layout.token_ids.zero_()
        layout.n_samples.zero_()
        layout.n_score.zero_()
        for b in buckets:
            self.run(b, layout)
