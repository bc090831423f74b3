"""The fused decode step: what StaticStep runs for buckets of up to FUSED_MAX_ROWS rows.

Per layer five kernels (device/step/fused_projections.py, triton_gemv.py's design notes):

  qkv_rope_store   RMSNorm -> qkv projection -> RoPE -> k/v into the paged cache, q out
  attention        ragged decode attention, its splits reduced inside the one launch
  add_projection   o projection added into the residual stream
  gate_up_silu     RMSNorm -> gate/up projection -> silu(gate) * up
  add_projection   down projection added into the residual stream

and around the layers: the embedding lookup, `lm_head_argmax` (the final RMSNorm on the sampled
rows, the logits, and each row's argmax reduced inside the projection), one sampling kernel
(greedy rows with no penalty and no structured output constraint take that argmax and read
nothing else; a constrained row samples from its masked logits in every mode) and the logprobs
kernel (a row that asked none writes nothing). The residual stream is one [T, hidden] tensor
the o and down projections add into in place, so no kernel exists only for an add.

The layered step (`StaticStep` with its torch or Triton pointwise kernels and cuBLAS
projections) is the same function; it stays for larger buckets (prefill chunks, where the
projections are compute-bound and cuBLAS is the better GEMM), for models whose weights the
fused kernels cannot read (`FusedDecode.unsupported`: a projection made of row bands of mixed
kinds), and as `--step-kernels layered`.

Scratch (split-K partials, ticket counters, the lm_head's per-tile bests) is allocated once
here, before capture: a counter must start at zero and every kernel leaves it at zero, which a
per-call allocation inside a graph could not promise without a memset node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ringleader.device.sampling.triton_sample_row import sample_rows_triton
from ringleader.device.step.fused_projections import (
    HEAD_BLOCK_N,
    PROJECTION_BLOCK_N,
    add_projection,
    gate_up_silu,
    lm_head_argmax,
    qkv_rope_store,
)
from ringleader.device.step.step_layout import StepLayout
from ringleader.device.step.triton_attention import ragged_attention_triton, sm_count
from ringleader.device.step.triton_gemv import FUSED_MAX_ROWS, FusedWeight
from ringleader.device.step.triton_launch import pdl_supported
from ringleader.device.weights.triton_quant_matmul import MAX_SPLITS, choose_splits

if TYPE_CHECKING:
    from ringleader.device.step.static_step import StaticStep


def _head_projection(model) -> object:
    """What computes the logits: the lm_head, the tied head's kernel, or the embedding table
    (a tensor whenever there is no tied head kernel: LlamaModel.use_weight_kernels)."""
    if model.lm_head is not None:
        return model.lm_head
    if model._tied_head is not None:
        return model._tied_head
    return model.embed.weight if isinstance(model.embed, torch.nn.Embedding) else model.embed.table


class FusedDecode:
    """The fused kernels of one StaticStep: each weight resolved once, scratch allocated once."""

    def __init__(self, step: StaticStep) -> None:
        self.step = step
        model = step.model
        dev = model.device
        self.layers = []
        self.unsupported: str | None = None
        for i, layer in enumerate(model.layers):
            ws = {name: FusedWeight.of(getattr(layer, name)) for name in ("qkv", "o", "gate_up", "down")}
            missing = [name for name, w in ws.items() if w is None]
            if missing:
                self.unsupported = (
                    f"layer {i}: {', '.join(missing)} stored in a form the fused kernels cannot read "
                    "(row bands of mixed kinds)"
                )
                return
            self.layers.append((layer, ws))
        head = _head_projection(model)
        self.head = FusedWeight.from_dense(head) if isinstance(head, torch.Tensor) else FusedWeight.of(head)
        if self.head is None:
            self.unsupported = "the lm_head is stored in a form the fused kernels cannot read"
            return
        c = model.config
        self.use_pdl = pdl_supported(dev)
        hidden = c.hidden_size
        self.partials = torch.empty(MAX_SPLITS, FUSED_MAX_ROWS, hidden, dtype=torch.float32, device=dev)
        self.tickets = torch.zeros(-(-hidden // PROJECTION_BLOCK_N), dtype=torch.int32, device=dev)
        head_tiles = -(-self.head.n // HEAD_BLOCK_N)
        self.best = torch.empty(head_tiles, FUSED_MAX_ROWS, dtype=torch.float32, device=dev)
        self.best_idx = torch.empty(head_tiles, FUSED_MAX_ROWS, dtype=torch.int32, device=dev)
        self.head_ticket = torch.zeros(1, dtype=torch.int32, device=dev)
        self.attention_tickets = torch.zeros(FUSED_MAX_ROWS * c.num_kv_heads, dtype=torch.int32, device=dev)

    def weight_bytes_by_kernel(self) -> dict[str, float]:
        """Bytes of weights each projection kernel reads in one step, by kernel name (the
        profile's GB/s: bench/step_profile.py); norms, activations and the cache are left out."""

        def nbytes(w: FusedWeight) -> int:
            parts = (w.dense,) if w.dense is not None else (w.packed, w.scale, w.zero)
            return sum(t.numel() * t.element_size() for t in parts if t is not None)

        total = {"_qkv_rope_store_kernel": 0, "_add_projection_kernel": 0, "_gate_up_silu_kernel": 0}
        for _, ws in self.layers:
            total["_qkv_rope_store_kernel"] += nbytes(ws["qkv"])
            total["_add_projection_kernel"] += nbytes(ws["o"]) + nbytes(ws["down"])
            total["_gate_up_silu_kernel"] += nbytes(ws["gate_up"])
        assert self.head is not None
        return {**{k: float(v) for k, v in total.items()}, "_lm_head_argmax_kernel": float(nbytes(self.head))}

    def _splits(self, weight: FusedWeight) -> int:
        """An add projection's K splits: static sizes and the GPU's SM count only (graphs are
        captured once, so this runs at capture, not per step)."""
        n_tiles = -(-weight.n // PROJECTION_BLOCK_N)
        # split only under two waves of tiles: the last split's sum and residual add ride on it
        return choose_splits(n_tiles, weight.k, sm_count(self.step.model.device), fill_waves=2)

    def layer(self, i: int, x: torch.Tensor, layout: StepLayout, bucket: int) -> None:
        """Layer i's five kernels over the residual stream x [bucket, hidden], in place."""
        step, pdl = self.step, self.use_pdl
        kv = step.kv
        layer, ws = self.layers[i]
        slot_of, positions = layout.slot_of[:bucket], layout.positions[:bucket]
        cos, sin = step._cos[: step.max_ctx], step._sin[: step.max_ctx]
        an, mn = layer.attn_norm, layer.mlp_norm
        q = qkv_rope_store(
            x, an.weight, an.eps, ws["qkv"], layer.qkv.bias, cos, sin, layout.block_table, slot_of,
            positions, kv.k[i], kv.v[i], step.scratch_page, step.n_heads, kv.num_kv_heads, use_pdl=pdl,
        )  # fmt: skip
        attn = ragged_attention_triton(
            q, kv.k[i], kv.v[i], layout.block_table, slot_of, positions, step.scale,
            tickets=self.attention_tickets, use_pdl=pdl,
        )  # fmt: skip
        o_splits = self._splits(ws["o"])
        add_projection(
            attn.reshape(bucket, -1), ws["o"], layer.o.bias, x, self.partials, self.tickets, o_splits, pdl
        )
        act = gate_up_silu(x, mn.weight, mn.eps, ws["gate_up"], use_pdl=pdl)
        add_projection(act, ws["down"], None, x, self.partials, self.tickets, self._splits(ws["down"]), pdl)

    def run(self, bucket: int, layout: StepLayout) -> torch.Tensor:
        """StaticStep.run for bucket <= FUSED_MAX_ROWS: the same contract (next_token and
        step_logprobs written, the raw fp32 logits [min(bucket, sample_len), vocab] returned)."""
        step, model, pdl = self.step, self.step.model, self.use_pdl
        x = model.embed(layout.token_ids[:bucket].long())  # the residual stream, added into in place
        for i in range(len(self.layers)):
            self.layer(i, x, layout, bucket)
        m = min(bucket, step.sample_len)
        norm = model.norm
        logits, greedy = lm_head_argmax(
            x, layout.sample_row[:m], bucket, norm.weight, norm.eps, self.head, self.best, self.best_idx,
            self.head_ticket, use_pdl=pdl,
        )  # fmt: skip
        self._sample(logits, greedy, layout, m)
        if step.score_rows:  # prompt logprobs: their rows' own norm and lm_head
            step.store_scores(step.score_logits(x, layout, bucket), layout, min(bucket, step.score_rows))
        return logits

    def _sample(self, logits: torch.Tensor, greedy: torch.Tensor, layout: StepLayout, m: int) -> None:
        """StaticStep._sample_into's part here: one sampling kernel (greedy rows with nothing to
        apply take the lm_head's argmax) that writes next_token itself, then the logprobs."""
        # the layout's settings carry the grammar and each entry's mask (sample_mask[:m]), and the
        # model's end ids for the rows below their min_tokens
        params = layout.sampling(m, end_ids=self.step._end_ids)
        slot = layout.sample_slot[:m]
        tokens = sample_rows_triton(
            logits, params, layout.n_samples, greedy, layout.next_token, slot, use_pdl=self.use_pdl
        )
        self.step._store_logprobs(
            layout.step_logprobs, slot, logits, tokens, params.logprobs, layout.n_samples
        )
