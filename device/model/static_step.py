"""The model step in static shapes, for capture as one CUDA graph per token-count bucket.

`StaticStep.run(bucket, layout)` reads the scheduler's step layout straight from device
tensors (`StepLayout`) and does what `LlamaModel.step` + `sample` do for the CPU backend (the
same trunk and decoder-layer body, with `StaticAttention` as the KV-cache side), but
without anything that depends on tensor values on the host: rows [0, bucket) are processed
(pad rows carry slot_of = -1), logits are computed for all n_slots sample entries, and only the
first n_samples entries (a device-side count) write next_token.

Scratch slot: pad rows still produce k/v; they are written to slot n_slots (position 0), so
the KV cache must have n_slots + 1 slots (`StaticStep.new_kv_cache`). Real slots are never
touched by pad rows.

Capture on CUDA (the capturing code's side):
  1. model.prepare(max_ctx) is called by StaticStep.__init__; build the StepLayout (device
     tensors that the scheduler writes) and the KV cache before capturing.
  2. step.warmup(layout, buckets): one eager run per bucket with an all-pad layout; compiles the
     Triton kernel, initialises cuBLAS and the allocator's pools. It overwrites the layout.
  3. per bucket b: capture `logits_b = step.run(b, layout)` on a side stream (capture_begin /
     capture_end, thread-local mode); keep the graph and logits_b alive.
  4. per step the scheduler fills the layout and picks the bucket; replay graph[bucket].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import numpy as np
import torch

from device.model.kv_cache import KVCache
from device.model.llama import LlamaModel
from device.model.sampling import sample
from device.model.triton_attention import ragged_attention_reference

Device = str | torch.device

# field -> (dtype the step reads it as, the scheduler array it mirrors)
_LAYOUT_FIELDS = {
    "token_ids": (np.int32, "token_ids"),
    "positions": (np.int32, "positions"),
    "slot_of": (np.int32, "slot_of"),
    "sample_row": (np.int32, "sample_row"),
    "sample_slot": (np.int32, "sample_slot"),
    "sample_temperature": (np.float32, "sample_temperature"),
    "sample_top_p": (np.float32, "sample_top_p"),
    "sample_top_k": (np.int32, "sample_top_k"),
    "sample_seed": (np.int64, "sample_seed"),  # uint64 seeds, same bits
    "sample_counter": (np.int32, "sample_counter"),
    "n_samples": (np.int32, None),  # RlStepHeader.n_samples (uint32), shape [1]
    "next_token": (np.int32, "next_token"),
}


def _array_view(arrays: dict[str, np.ndarray], name: str) -> np.ndarray:
    dtype, src = _LAYOUT_FIELDS[name]
    if src is None:
        return arrays["step"]["n_samples"].view(dtype)  # strided [1] view into the header
    return arrays[src].view(dtype)


@dataclass
class StepLayout:
    """Device tensors mirroring the scheduler's step arrays (ipc.layout.ARRAYS).

    token_ids, positions, slot_of: int32 [token_budget]; sample_*: [n_slots] (seed as int64);
    n_samples: int32 [1], read on the device only; next_token: int32 [n_slots], written by run.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_of: torch.Tensor
    sample_row: torch.Tensor
    sample_slot: torch.Tensor
    sample_temperature: torch.Tensor
    sample_top_p: torch.Tensor
    sample_top_k: torch.Tensor
    sample_seed: torch.Tensor
    sample_counter: torch.Tensor
    n_samples: torch.Tensor
    next_token: torch.Tensor

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], device: Device = "cpu") -> StepLayout:
        """On the CPU: zero-copy views of the scheduler's arrays (writes to next_token land in
        them). Elsewhere: freshly allocated device tensors holding a copy of their contents."""
        views = {name: torch.from_numpy(_array_view(arrays, name)) for name in _LAYOUT_FIELDS}
        if torch.device(device).type != "cpu":
            views = {name: t.to(device).contiguous() for name, t in views.items()}
        return cls(**views)

    @classmethod
    def allocate(cls, n_slots: int, token_budget: int, device: Device) -> StepLayout:
        """Zeroed tensors of the right sizes (pad rows have slot_of = -1)."""
        rows = ("token_ids", "positions", "slot_of")
        out = {
            name: torch.zeros(
                token_budget if name in rows else 1 if name == "n_samples" else n_slots,
                dtype=getattr(torch, np.dtype(dtype).name),
                device=device,
            )
            for name, (dtype, _) in _LAYOUT_FIELDS.items()
        }
        out["slot_of"].fill_(-1)
        return cls(**out)

    def copy_from_arrays(self, arrays: dict[str, np.ndarray], non_blocking: bool = False) -> None:
        """Uploads the scheduler's host arrays into these tensors (host-scheduled mode);
        next_token is left alone (the step writes it)."""
        for f in fields(self):
            if f.name != "next_token":
                src = torch.from_numpy(_array_view(arrays, f.name))
                getattr(self, f.name).copy_(src, non_blocking=non_blocking)


class StaticAttention:
    """CacheAttention for one static step: fixed shapes, index tensors, no host syncs.

    Row t's k/v go to flat cache row cache_row[t] (slot * max_ctx + position; pad rows to the
    scratch slot) with index_copy_; `attend` has the signature of ragged_attention_reference.
    """

    def __init__(
        self,
        kv: KVCache,
        attend: Callable[..., torch.Tensor],
        cache_row: torch.Tensor,
        slot_of: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
    ) -> None:
        self.kv, self._attend, self.cache_row = kv, attend, cache_row
        self.slot_of, self.positions, self.scale = slot_of, positions, scale

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        KV, D = k.shape[1], k.shape[2]
        k_cache.view(-1, KV, D).index_copy_(0, self.cache_row, k.to(k_cache.dtype))
        v_cache.view(-1, KV, D).index_copy_(0, self.cache_row, v.to(v_cache.dtype))

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        return self._attend(q, k_cache, v_cache, self.slot_of, self.positions, self.scale)


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
    ) -> None:
        """attention: "triton", "torch" (the masked reference) or a function with the
        signature of ragged_attention_reference."""
        if kv.n_slots < n_slots + 1:
            raise ValueError(
                f"the KV cache needs n_slots + 1 = {n_slots + 1} slots (one scratch "
                f"slot for pad rows), has {kv.n_slots}; use StaticStep.new_kv_cache"
            )
        if kv.max_ctx < max_ctx:
            raise ValueError(f"KV cache max_ctx {kv.max_ctx} < {max_ctx}")
        if attention == "triton":
            from device.model.triton_attention import HAVE_TRITON, ragged_attention_triton

            if not HAVE_TRITON:
                raise RuntimeError("attention='triton' needs triton; use attention='torch'")
            self._attend = ragged_attention_triton
        elif attention == "torch":
            self._attend = ragged_attention_reference
        elif callable(attention):
            self._attend = attention
        else:
            raise ValueError(f"attention must be 'triton' or 'torch', got {attention!r}")
        c = model.config
        self.model, self.kv, self.attention = model, kv, attention
        self.n_slots, self.max_ctx, self.token_budget = n_slots, max_ctx, token_budget
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = 1.0 / (c.head_dim**0.5)  # SDPA's default, as the eager step uses
        self.scratch_slot = n_slots
        dev = model.device
        model.prepare(max_ctx)
        self._cos, self._sin = model._cos, model._sin  # kept: prepare() may swap them later
        self._entry_ids = torch.arange(n_slots, dtype=torch.int32, device=dev)
        # next_token plus one sink element that masked sample entries are scattered into
        self._token_sink = torch.zeros(n_slots + 1, dtype=torch.int32, device=dev)

    @staticmethod
    def new_kv_cache(
        model: LlamaModel, n_slots: int, max_ctx: int, dtype: torch.dtype | None = None
    ) -> KVCache:
        """A KV cache with the scratch slot (n_slots + 1 slots)."""
        return model.new_kv_cache(n_slots + 1, max_ctx, dtype)

    # ---- the step -----------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, bucket: int, layout: StepLayout) -> torch.Tensor:
        """Runs rows [0, bucket) of `layout`, writes next_token for the first n_samples sample
        entries; returns fp32 logits [n_slots, vocab] (rows >= n_samples are garbage)."""
        if not 0 < bucket <= self.token_budget:
            raise ValueError(f"bucket {bucket} not in [1, {self.token_budget}]")
        slot_of = layout.slot_of[:bucket]
        positions = layout.positions[:bucket]
        pos = positions.long().clamp(0, self.max_ctx - 1)
        # pad rows write their k/v to (scratch slot, position 0) instead of a real slot
        write_slot = torch.where(slot_of >= 0, slot_of.long(), self.scratch_slot)
        cache_row = write_slot * self.kv.max_ctx + pos
        cos = self._cos.index_select(0, pos)
        sin = self._sin.index_select(0, pos)
        cache = StaticAttention(self.kv, self._attend, cache_row, slot_of, positions, self.scale)
        rows = layout.sample_row.long().clamp(0, bucket - 1)  # stale entries may point anywhere
        logits = self.model(layout.token_ids[:bucket].long(), cos, sin, cache, rows)
        self._sample_into(logits, layout)
        return logits

    def _sample_into(self, logits: torch.Tensor, layout: StepLayout) -> None:
        valid = self._entry_ids < layout.n_samples  # [n_slots], n_samples read on the device
        # stale entries sample greedily (no NaN from stale parameters) and land in the sink
        temperature = torch.where(valid, layout.sample_temperature, 0.0)
        tokens = sample(
            logits,
            temperature,
            layout.sample_top_k,
            layout.sample_top_p,
            layout.sample_seed,
            layout.sample_counter,
        )
        target = torch.where(valid, layout.sample_slot.long().clamp(0, self.n_slots - 1), self.n_slots)
        sink = self._token_sink
        sink[: self.n_slots].copy_(layout.next_token)
        sink.index_copy_(0, target, tokens.to(torch.int32))
        layout.next_token.copy_(sink[: self.n_slots])

    def warmup(self, layout: StepLayout, buckets: Iterable[int]) -> None:
        """One eager run per bucket on an all-pad layout (no samples), before any capture:
        compiles the attention kernel and initialises libraries. Overwrites the layout's rows."""
        layout.slot_of.fill_(-1)
        layout.positions.zero_()
        layout.token_ids.zero_()
        layout.n_samples.zero_()
        for b in buckets:
            self.run(b, layout)
