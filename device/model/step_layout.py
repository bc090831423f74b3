"""The step layout: the scheduler's arrays for one model step, as the tensors both steps read.

The scheduler (ringleader.ipc.layout.ARRAYS) writes the rows, segments, sample entries, the
block table (each slot's KV pages) and the header counts; a step reads them and writes
next_token. `StaticStep` (the CUDA-graph step) reads only what it can read on the device: the
rows, the block table, the sample entries and n_samples. `EagerStep` also reads the segments
and the counts on the host, which on the CPU are zero-copy views.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch

from ringleader.device.model.sampling import SamplingTensors
from ringleader.ipc import layout

Device = str | torch.device

# field -> (dtype the step reads it as, the scheduler array it mirrors; "step.x": header field x)
_FIELDS = {
    "token_ids": (np.int32, "token_ids"),
    "positions": (np.int32, "positions"),
    "slot_of": (np.int32, "slot_of"),
    "seg_slot": (np.int32, "seg_slot"),
    "seg_row_start": (np.int32, "seg_row_start"),
    "seg_n_rows": (np.int32, "seg_n_rows"),
    "sample_row": (np.int32, "sample_row"),
    "sample_slot": (np.int32, "sample_slot"),
    "sample_temperature": (np.float32, "sample_temperature"),
    "sample_top_p": (np.float32, "sample_top_p"),
    "sample_top_k": (np.int32, "sample_top_k"),
    "sample_seed": (np.int64, "sample_seed"),  # uint64 seeds, same bits
    "sample_counter": (np.int32, "sample_counter"),
    "n_tokens": (np.int32, "step.n_tokens"),  # RlStepHeader fields (uint32), shape [1]
    "n_segments": (np.int32, "step.n_segments"),
    "n_samples": (np.int32, "step.n_samples"),
    "next_token": (np.int32, "next_token"),
    "block_table": (np.int32, "block_table"),  # flat [n_slots * pages_per_slot] in the arrays
}
# [token_budget]; the counts [1]; block_table [n_slots, pages_per_slot]; the rest [n_slots]
_ROW_FIELDS = ("token_ids", "positions", "slot_of")


# a count's int32 word in the step header (RlStepHeader, ringleader.ipc.layout.STEP)
_HEADER_WORD = {name: off // 4 for name, (_, off) in layout.STEP.numpy_dtype().fields.items()}


def _views(array: Callable[[str, np.dtype], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every field as a view of the scheduler's arrays: `array(name, dtype)` views one whole array
    as dtype; a count is a [1] view of its word in the step header; the block table is viewed
    as [n_slots, pages_per_slot]."""
    header = array("step", np.dtype(np.int32))
    views = {}
    for name, (dtype, src) in _FIELDS.items():
        if src.startswith("step."):
            word = _HEADER_WORD[src[5:]]
            views[name] = header[word : word + 1]
        else:
            views[name] = array(src, np.dtype(dtype))
    n_slots = views["seg_slot"].shape[0]
    views["block_table"] = views["block_table"].view(n_slots, -1)
    return views


@dataclass
class StepLayout:
    """Tensors mirroring the scheduler's step arrays (ringleader.ipc.layout.ARRAYS).

    token_ids, positions, slot_of: int32 [token_budget] (pad rows: slot_of = -1); seg_slot,
    seg_row_start, seg_n_rows: int32 [n_slots]; sample_*: [n_slots] (seed as int64); n_tokens,
    n_segments, n_samples: int32 [1], the header's counts; next_token: int32 [n_slots], written
    by a step's run; block_table: int32 [n_slots, pages_per_slot], slot s's position p is in
    KV page block_table[s, p // page_size] (entries past a slot's context are arbitrary).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_of: torch.Tensor
    seg_slot: torch.Tensor
    seg_row_start: torch.Tensor
    seg_n_rows: torch.Tensor
    sample_row: torch.Tensor
    sample_slot: torch.Tensor
    sample_temperature: torch.Tensor
    sample_top_p: torch.Tensor
    sample_top_k: torch.Tensor
    sample_seed: torch.Tensor
    sample_counter: torch.Tensor
    n_tokens: torch.Tensor
    n_segments: torch.Tensor
    n_samples: torch.Tensor
    next_token: torch.Tensor
    block_table: torch.Tensor

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], device: Device = "cpu") -> StepLayout:
        """On the CPU: zero-copy views of the scheduler's arrays (writes to next_token land in
        them), built once for every step. Elsewhere: freshly allocated device tensors holding a
        copy of their contents."""
        views = _views(lambda name, dtype: torch.from_numpy(arrays[name].view(dtype)))
        if torch.device(device).type != "cpu":
            views = {name: t.to(device).contiguous() for name, t in views.items()}
        return cls(**views)

    @classmethod
    def over_buffer(cls, tensor: Callable[[str, torch.dtype], torch.Tensor]) -> StepLayout:
        """Views of a device buffer that holds the scheduler's arrays, where it writes them
        (`tensor(name, dtype)` views one whole array: DeviceMemory.tensor)."""
        return cls(**_views(lambda name, dtype: tensor(name, getattr(torch, dtype.name))))

    @classmethod
    def allocate(cls, n_slots: int, token_budget: int, device: Device, pages_per_slot: int) -> StepLayout:
        """Zeroed tensors of the right sizes (pad rows have slot_of = -1; every block-table
        entry names page 0)."""

        def shape(name: str) -> tuple[int, ...]:
            if name in _ROW_FIELDS:
                return (token_budget,)
            if name == "block_table":
                return (n_slots, pages_per_slot)
            return (1,) if _FIELDS[name][1].startswith("step.") else (n_slots,)

        out = {
            name: torch.zeros(shape(name), dtype=getattr(torch, np.dtype(dtype).name), device=device)
            for name, (dtype, _) in _FIELDS.items()
        }
        out["slot_of"].fill_(-1)
        return cls(**out)

    def copy_from_arrays(self, arrays: dict[str, np.ndarray], non_blocking: bool = False) -> None:
        """Uploads the scheduler's host arrays into these tensors (host-scheduled mode);
        next_token is left alone (the step writes it)."""
        source = StepLayout.from_arrays(arrays)
        for f in fields(self):
            if f.name != "next_token":
                getattr(self, f.name).copy_(getattr(source, f.name), non_blocking=non_blocking)

    def sampling(self, m: int) -> SamplingTensors:
        """The sampling settings of sample entries [0, m), as views."""
        return SamplingTensors(
            self.sample_temperature[:m],
            self.sample_top_k[:m],
            self.sample_top_p[:m],
            self.sample_seed[:m],
            self.sample_counter[:m],
        )

    def read_counts(self) -> tuple[int, int, int]:
        """(n_tokens, n_segments, n_samples) read on the host: a device sync unless the layout
        is on the CPU, so only the eager step calls it."""
        return int(self.n_tokens.item()), int(self.n_segments.item()), int(self.n_samples.item())
