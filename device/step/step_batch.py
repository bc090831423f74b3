"""The input of one unified ragged model step: decode rows and prefill chunks mixed, and the
block table that maps their slots' positions to KV-cache pages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ringleader.device.step.step_layout import StepLayout


@dataclass
class StepPlan:
    """Host-side attention plan, derived from the segment arrays (no device syncs needed).

    Segments of one row ("decode-like", including a 1-token last prefill chunk) are attended
    together in padded batches, each padded to its longest context; longer segments each run
    on their own. Decode rows form one batch unless padding would more than double the reads;
    then they are grouped by context length in powers of two, so no row reads more than twice
    its own context (mixed lengths at many slots: one long row no longer pads every short one).
    """

    # (row ids [B] int64, or None = every row of the step in order; the longest context in it)
    decode_groups: list[tuple[torch.Tensor | None, int]]
    n_decode: int
    prefill: list[tuple[int, int, int, int]]  # (slot, row_start, n_rows, ctx_end) per segment

    @classmethod
    def from_numpy(
        cls,
        positions: np.ndarray,
        seg_slot: np.ndarray,
        seg_row_start: np.ndarray,
        seg_n_rows: np.ndarray,
        device: str | torch.device = "cpu",
        decode_segments: int = 0,
    ) -> StepPlan:
        """decode_segments: the scheduler's decoding slots' segments come first, this many
        (RlStepHeader.n_decode); each of their rows attends as a decode row, one with a draft
        (speculative decoding: several rows) too, so a verified token is computed as it would
        be without the draft."""
        n_rows_total = int(positions.shape[0])
        seg_n_rows = np.asarray(seg_n_rows)
        is_decode = seg_n_rows == 1
        longer = np.flatnonzero(~is_decode[:decode_segments])
        is_decode[:decode_segments] = True
        dec_starts = np.asarray(seg_row_start)[is_decode]
        if longer.size:  # every row of a verification segment, in row order
            starts, counts = np.asarray(seg_row_start)[is_decode], seg_n_rows[is_decode]
            dec_starts = (
                np.repeat(starts, counts)
                + np.arange(counts.sum())
                - np.repeat(np.cumsum(counts) - counts, counts)
            )
        n_decode = int(dec_starts.shape[0])
        groups: list[tuple[torch.Tensor | None, int]] = []
        if n_decode:
            ctx = positions[dec_starts].astype(np.int64) + 1
            if n_decode * int(ctx.max()) <= 2 * int(ctx.sum()):  # padding at most doubles the reads
                in_order = n_decode == n_rows_total and np.array_equal(dec_starts, np.arange(n_decode))
                rows = None if in_order else torch.from_numpy(dec_starts.astype(np.int64)).to(device)
                groups.append((rows, int(ctx.max())))
            else:
                level = np.ceil(np.log2(ctx)).astype(np.int64)
                for lv in np.unique(level):
                    members = level == lv
                    rows = torch.from_numpy(dec_starts[members].astype(np.int64)).to(device)
                    groups.append((rows, int(ctx[members].max())))
        prefill = []
        for s in np.flatnonzero(~is_decode):
            start, n = int(seg_row_start[s]), int(seg_n_rows[s])
            if n == 0:
                continue
            prefill.append((int(seg_slot[s]), start, n, int(positions[start + n - 1]) + 1))
        return cls(groups, n_decode, prefill)


@dataclass
class StepBatch:
    """Rows of one step, as int64 tensors already sliced to their real sizes.

    token_ids[T], positions[T], slot_of[T]: each row's token, its position in its request and
    its KV slot. Segments are contiguous runs of rows of one slot whose positions are
    consecutive and end at the slot's current context end: seg_slot[S], seg_row_start[S],
    seg_n_rows[S]. sample_rows[N]: rows whose logits are wanted, in output order.
    block_table [n_slots, M] (int64 or int32): the KV pages of each slot's positions (see
    KVCache); None: the cache's own slot_table.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_of: torch.Tensor
    seg_slot: torch.Tensor
    seg_row_start: torch.Tensor
    seg_n_rows: torch.Tensor
    sample_rows: torch.Tensor
    block_table: torch.Tensor | None = None
    plan: StepPlan | None = None

    @property
    def n_rows(self) -> int:
        return int(self.token_ids.shape[0])

    def get_plan(self) -> StepPlan:
        """The attention plan; computed from the tensors (a host copy) if not given."""
        if self.plan is None:
            dev = self.token_ids.device
            self.plan = StepPlan.from_numpy(
                self.positions.cpu().numpy(),
                self.seg_slot.cpu().numpy(),
                self.seg_row_start.cpu().numpy(),
                self.seg_n_rows.cpu().numpy(),
                device=dev,
            )
        return self.plan

    @classmethod
    def from_numpy(
        cls,
        token_ids: np.ndarray,
        positions: np.ndarray,
        slot_of: np.ndarray,
        seg_slot: np.ndarray,
        seg_row_start: np.ndarray,
        seg_n_rows: np.ndarray,
        sample_rows: np.ndarray,
        block_table: np.ndarray | None = None,
        device: str | torch.device = "cpu",
        decode_segments: int = 0,
    ) -> StepBatch:
        """From the scheduler's numpy (int32) arrays, already sliced to real sizes (block_table:
        the whole [n_slots, M] table).

        Cost: one small host->device copy per array plus an int64 widening; the plan is
        built from the numpy arrays, so no device->host sync happens.
        """

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device).long()

        plan = StepPlan.from_numpy(
            positions, seg_slot, seg_row_start, seg_n_rows, device=device, decode_segments=decode_segments
        )
        return cls(
            t(token_ids),
            t(positions),
            t(slot_of),
            t(seg_slot),
            t(seg_row_start),
            t(seg_n_rows),
            t(sample_rows),
            None if block_table is None else t(block_table),
            plan,
        )

    @classmethod
    def from_layout(
        cls, layout: StepLayout, n_tokens: int, n_segments: int, n_samples: int, n_score: int = 0
    ) -> StepBatch:
        """Rows [0, n_tokens), segments [0, n_segments) and sample entries [0, n_samples) of
        `layout`, read on the host (on the CPU: views of the scheduler's arrays, no copy); the
        rows of its first n_score score entries (prompt logprobs) follow the sample rows."""
        rows, segs = slice(0, n_tokens), slice(0, n_segments)

        def host(t: torch.Tensor) -> np.ndarray:
            return t.cpu().numpy()

        out_rows = host(layout.sample_row[:n_samples])
        if n_score:
            out_rows = np.concatenate([out_rows, host(layout.score_row[:n_score])])

        return cls.from_numpy(
            host(layout.token_ids[rows]),
            host(layout.positions[rows]),
            host(layout.slot_of[rows]),
            host(layout.seg_slot[segs]),
            host(layout.seg_row_start[segs]),
            host(layout.seg_n_rows[segs]),
            out_rows,
            host(layout.block_table),
            device=layout.token_ids.device,
            decode_segments=min(int(layout.n_decode.item()), n_segments),
        )

    @classmethod
    def from_segments(
        cls,
        segments: list[tuple[int, list[int], int]],
        sample_rows: list[int] | None = None,
        block_table: np.ndarray | torch.Tensor | None = None,
        device: str | torch.device = "cpu",
    ) -> StepBatch:
        """Convenience builder: segments = [(slot, token_ids, first_position), ...]. By default
        the last row of every segment is sampled, and the pages are the cache's slot_table."""
        tok, pos, slot_of, seg_slot, seg_start, seg_n, last = [], [], [], [], [], [], []
        for slot, ids, p0 in segments:
            seg_slot.append(slot)
            seg_start.append(len(tok))
            seg_n.append(len(ids))
            tok.extend(ids)
            pos.extend(range(p0, p0 + len(ids)))
            slot_of.extend([slot] * len(ids))
            last.append(len(tok) - 1)
        rows = last if sample_rows is None else sample_rows
        arr = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
        return cls.from_numpy(
            arr(tok),
            arr(pos),
            arr(slot_of),
            arr(seg_slot),
            arr(seg_start),
            arr(seg_n),
            arr(rows),
            None if block_table is None else torch.as_tensor(block_table).cpu().numpy(),
            device=device,
        )
