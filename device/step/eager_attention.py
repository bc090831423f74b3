"""The eager step's KV-cache side: ragged attention over the paged cache, driven by a host-side
StepPlan.

Rows are written to (block_table[slot, pos // PS], pos % PS). Each segment's context is read
back by gathering only the pages it needs: the decode rows in the plan's groups, each padded to
the pages of its longest context (one SDPA call per group), each prefill chunk its slot's first
ceil(ctx_end / PS) pages (one SDPA call each). Which pages and which mask are the same in every
layer: `StepGathers` builds them once per step. Shapes follow the step's content, so this is fast on the CPU but
not capturable; the CUDA backend uses `StaticAttention` (device/step/static_step.py) instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ringleader.device.model.ops import rope_split
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.step_batch import StepBatch, StepPlan

if TYPE_CHECKING:
    from ringleader.device.step.cpu_step_kernels import CpuStepKernels


@dataclass
class StepGathers:
    """What every layer's attention gathers the same way in one step, built once per step: each
    decode group's rows, page ids [B, n_read] and mask [B, 1, 1, L], and each prefill chunk's
    (row_start, n_rows, page ids, causal mask [G * n, ctx_end])."""

    decode: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]
    prefill: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    whole: bool  # one decode group over every row: its output is the step's

    @classmethod
    def build(
        cls,
        batch: StepBatch,
        plan: StepPlan,
        block_table: torch.Tensor,
        n_pages: int,
        page_size: int,
        group: int,
        with_decode: bool = True,
    ) -> StepGathers:
        """with_decode=False: the prefill chunks' only (the decode rows attend elsewhere)."""
        PS, dev = page_size, batch.positions.device
        decode = []
        for rows, max_ctx in plan.decode_groups if with_decode else ():
            slots = batch.slot_of if rows is None else batch.slot_of.index_select(0, rows)
            pos = batch.positions if rows is None else batch.positions.index_select(0, rows)
            # padded only to the pages of the group's longest context; a shorter row's entries
            # past its context are arbitrary: clamped in bounds, their columns masked
            n_read = -(-max_ctx // PS)
            pages = block_table[slots, :n_read].clamp(0, n_pages - 1)  # [B, n_read]
            mask = torch.arange(n_read * PS, device=dev)[None, :] <= pos[:, None]  # [B, L]
            decode.append((rows, pages, mask[:, None, None, :]))
        prefill = []
        for slot, start, n, ctx_end in plan.prefill:
            pages = block_table[slot, : -(-ctx_end // PS)]
            # offset causal mask: this chunk's first row sits at position ctx_end - n
            q_pos = torch.arange(ctx_end - n, ctx_end, device=dev)
            mask = torch.arange(ctx_end, device=dev)[None, :] <= q_pos[:, None]  # [n, ctx_end]
            prefill.append((start, n, pages, mask.repeat(group, 1)))
        whole = bool(decode) and decode[0][0] is None
        return cls(decode, prefill, whole)


def attend_gathered(
    q: torch.Tensor, gathers: StepGathers, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D] over the pages k/v_cache [P, PS, KV, D], as `gathers` says.

    GQA without repeating k/v: the G query heads sharing a kv head are folded into the
    query-length axis, so k/v keep their num_kv_heads heads.
    """
    T, H, D = q.shape
    PS, KV = k_cache.shape[1:3]
    G = H // KV
    out = None if gathers.whole else torch.empty_like(q)
    for rows, pages, mask in gathers.decode:
        qd = q if rows is None else q.index_select(0, rows)
        B, L = pages.shape[0], pages.shape[1] * PS
        kd = k_cache[pages].view(B, L, KV, D).transpose(1, 2)  # [B, KV, L, D]
        vd = v_cache[pages].view(B, L, KV, D).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd.view(B, KV, G, D), kd, vd, attn_mask=mask).reshape(B, H, D)
        if rows is None:
            out = od
        else:
            out.index_copy_(0, rows, od)
    attend_prefill(q, gathers, k_cache, v_cache, out)
    return out


def attend_prefill(
    q: torch.Tensor, gathers: StepGathers, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
) -> None:
    """The prefill chunks' part of attend_gathered, written into out's rows."""
    T, H, D = q.shape
    PS, KV = k_cache.shape[1:3]
    G = H // KV
    for start, n, pages, mask in gathers.prefill:
        ctx_end = mask.shape[1]
        qs = q[start : start + n].view(n, KV, G, D).permute(1, 2, 0, 3).reshape(1, KV, G * n, D)
        ks = k_cache[pages].view(-1, KV, D)[:ctx_end].transpose(0, 1)[None]  # [1, KV, ctx_end, D]
        vs = v_cache[pages].view(-1, KV, D)[:ctx_end].transpose(0, 1)[None]
        os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        out[start : start + n] = os_.view(KV, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)


def ragged_attention(
    q: torch.Tensor,
    batch: StepBatch,
    plan: StepPlan,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]; each row attends causally over its slot's positions [0, pos],
    read from the pages k/v_cache [P, PS, KV, D] through block_table [n_slots, M] (int64)."""
    n_pages, page_size, n_kv = k_cache.shape[:3]
    gathers = StepGathers.build(batch, plan, block_table, n_pages, page_size, q.shape[1] // n_kv)
    return attend_gathered(q, gathers, k_cache, v_cache)


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
        cpu_kernels: CpuStepKernels | None = None,
    ) -> None:
        """cpu_kernels: the CPU step's few-row kernels (rope and store, decode attention), when given."""
        self.batch, self.plan, self.kv, self.cos, self.sin = batch, plan, kv, cos, sin
        self.cpu_kernels = cpu_kernels
        self.block_table = block_table.long()
        PS = kv.page_size
        page = self.block_table[batch.slot_of, batch.positions // PS]
        self.cache_row = page * PS + batch.positions % PS  # row of the flat [P * PS, KV, D] view
        self._gathers: StepGathers | None = None
        self._in_place = False  # decode rows through cpu_kernels.decode_attention (set with _gathers)

    def rope_and_store(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        KV, D = self.kv.num_kv_heads, self.kv.head_dim
        k_cache, v_cache = self.kv.layer(layer)
        if self.cpu_kernels is not None:
            args = (self.cos, self.sin, self.cache_row, k_cache, v_cache, KV, D)
            q_rotated = self.cpu_kernels.rope_store(qkv, *args)
            if q_rotated is not None:
                return q_rotated
        q, k, v = rope_split(qkv, self.cos, self.sin, KV, D)
        k_cache.view(-1, KV, D).index_copy_(0, self.cache_row, k.to(k_cache.dtype))
        v_cache.view(-1, KV, D).index_copy_(0, self.cache_row, v.to(v_cache.dtype))
        return q

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv.layer(layer)
        b = self.batch
        if self._gathers is None:  # the same for every layer: built at the first one's call
            n_pages, page_size, n_kv = k_cache.shape[:3]
            # the decode rows read their pages in place, in C++, where the tensors allow it
            tables = (b.slot_of, b.positions, self.block_table)
            self._in_place = self.cpu_kernels is not None and self.cpu_kernels.attends_in_place(
                q, k_cache, v_cache, *tables
            )
            self._gathers = StepGathers.build(
                b, self.plan, self.block_table, n_pages, page_size, q.shape[1] // n_kv, not self._in_place
            )
        if not self._in_place:
            return attend_gathered(q, self._gathers, k_cache, v_cache)
        assert self.cpu_kernels is not None
        out = torch.empty_like(q)
        for rows, _ in self.plan.decode_groups:
            self.cpu_kernels.decode_attention(
                q, rows, b.slot_of, b.positions, self.block_table, k_cache, v_cache, out
            )
        attend_prefill(q, self._gathers, k_cache, v_cache, out)
        return out
