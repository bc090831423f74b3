"""The eager step's KV-cache side: ragged attention over the paged cache, driven by a host-side
StepPlan.

Rows are written to (block_table[slot, pos // PS], pos % PS). Each segment's context is read
back by gathering only the pages it needs: the decode rows in the plan's groups, each padded to
the pages of its longest context (one SDPA call per group), each prefill chunk its slot's first
ceil(ctx_end / PS) pages (one SDPA call each). Shapes follow the step's content, so this is fast on the CPU but
not capturable; the CUDA backend uses `StaticAttention` (device/model/static_step.py) instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringleader.device.model.kv_cache import KVCache
from ringleader.device.model.ops import rope_split
from ringleader.device.model.step_batch import StepBatch, StepPlan


def ragged_attention(
    q: torch.Tensor,
    batch: StepBatch,
    plan: StepPlan,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]; each row attends causally over its slot's positions [0, pos],
    read from the pages k/v_cache [P, PS, KV, D] through block_table [n_slots, M] (int64).

    GQA without repeating k/v: the G query heads sharing a kv head are folded into the
    query-length axis, so k/v keep their num_kv_heads heads.
    """
    T, H, D = q.shape
    n_pages, PS, KV = k_cache.shape[:3]
    G = H // KV
    dev = q.device
    whole = plan.decode_groups[0][0] is None if plan.decode_groups else False
    out = None if whole else torch.empty_like(q)
    for rows, max_ctx in plan.decode_groups:
        qd = q if rows is None else q.index_select(0, rows)
        slots = batch.slot_of if rows is None else batch.slot_of.index_select(0, rows)
        pos = batch.positions if rows is None else batch.positions.index_select(0, rows)
        B = qd.shape[0]
        # padded only to the pages of the group's longest context; a shorter row's entries
        # past its context are arbitrary: clamped in bounds, their columns masked
        n_read = -(-max_ctx // PS)
        pages = block_table[slots, :n_read].clamp(0, n_pages - 1)  # [B, n_read]
        L = n_read * PS
        kd = k_cache[pages].view(B, L, KV, D).transpose(1, 2)  # [B, KV, L, D]
        vd = v_cache[pages].view(B, L, KV, D).transpose(1, 2)
        mask = torch.arange(L, device=dev)[None, :] <= pos[:, None]  # [B, L]
        od = F.scaled_dot_product_attention(qd.view(B, KV, G, D), kd, vd, attn_mask=mask[:, None, None, :])
        od = od.reshape(B, H, D)
        if rows is None:
            out = od
        else:
            out.index_copy_(0, rows, od)
    for slot, start, n, ctx_end in plan.prefill:
        qs = q[start : start + n].view(n, KV, G, D).permute(1, 2, 0, 3).reshape(1, KV, G * n, D)
        pages = block_table[slot, : -(-ctx_end // PS)]
        ks = k_cache[pages].view(-1, KV, D)[:ctx_end].transpose(0, 1)[None]  # [1, KV, ctx_end, D]
        vs = v_cache[pages].view(-1, KV, D)[:ctx_end].transpose(0, 1)[None]
        # offset causal mask: this chunk's first row sits at position ctx_end - n
        q_pos = torch.arange(ctx_end - n, ctx_end, device=dev)
        mask = torch.arange(ctx_end, device=dev)[None, :] <= q_pos[:, None]  # [n, ctx_end]
        os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.repeat(G, 1))
        out[start : start + n] = os_.view(KV, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
    return out


class EagerAttention:
    """CacheAttention for one eager step: row t's k/v go to page block_table[slot_of[t],
    positions[t] // PS] of `kv` at offset positions[t] % PS; cos/sin [T, head_dim] are the rows'
    RoPE entries."""

    def __init__(
        self,
        batch: StepBatch,
        plan: StepPlan,
        kv: KVCache,
        block_table: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        self.batch, self.plan, self.kv, self.cos, self.sin = batch, plan, kv, cos, sin
        self.block_table = block_table.long()
        PS = kv.page_size
        page = self.block_table[batch.slot_of, batch.positions // PS]
        self.cache_row = page * PS + batch.positions % PS  # row of the flat [P * PS, KV, D] view

    def rope_and_store(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        KV, D = self.kv.num_kv_heads, self.kv.head_dim
        k_cache, v_cache = self.kv.layer(layer)
        q, k, v = rope_split(qkv, self.cos, self.sin, KV, D)
        k_cache.view(-1, KV, D).index_copy_(0, self.cache_row, k.to(k_cache.dtype))
        v_cache.view(-1, KV, D).index_copy_(0, self.cache_row, v.to(v_cache.dtype))
        return q

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv.layer(layer)
        return ragged_attention(q, self.batch, self.plan, k_cache, v_cache, self.block_table)
