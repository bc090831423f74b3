"""The eager step's KV-cache side: ragged attention driven by a host-side StepPlan.

Shapes follow the step's content (decode rows padded only to their longest context, one SDPA
call per prefill chunk), so this is fast on the CPU but not capturable; the CUDA backend uses
`StaticAttention` (device/model/static_step.py) instead.
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


class EagerAttention:
    """CacheAttention for one eager step: rows go to (slot_of, positions) of `kv`; cos/sin
    [T, head_dim] are the rows' RoPE entries."""

    def __init__(
        self, batch: StepBatch, plan: StepPlan, kv: KVCache, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        self.batch, self.plan, self.kv, self.cos, self.sin = batch, plan, kv, cos, sin

    def rope_and_store(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        b, k_cache, v_cache = self.batch, self.kv.k[layer], self.kv.v[layer]
        q, k, v = rope_split(qkv, self.cos, self.sin, self.kv.num_kv_heads, self.kv.head_dim)
        k_cache[b.slot_of, b.positions] = k.to(k_cache.dtype)
        v_cache[b.slot_of, b.positions] = v.to(v_cache.dtype)
        return q

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return ragged_attention(q, self.batch, self.plan, self.kv.k[layer], self.kv.v[layer])
