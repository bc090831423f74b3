"""The step layout: the scheduler's arrays for one model step, as the tensors both steps read.

The scheduler (ringleader.ipc.layout.ARRAYS) writes the rows, segments, sample entries, the
block table (each slot's KV pages) and the header counts; a step reads them and writes
next_token. `StaticStep` (the CUDA-graph step) reads only what it can read on the device: the
rows, the block table, the sample entries and n_samples. `EagerStep` also reads the segments
and the counts on the host, which on the CPU are zero-copy views.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from ringleader.device.sampling.sampler import RING_DTYPES, SamplingTensors, store_logprobs
from ringleader.ipc import layout
from ringleader.ipc.sampling_params import FIELD

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
    "sample_params": (np.int32, "sample_params"),  # RlSampling [sample_len], its words
    "sample_counter": (np.int32, "sample_counter"),
    "sample_mask": (np.int32, "sample_mask"),  # per sample: its constraint's mask in grammar, or -1
    "n_tokens": (np.int32, "step.n_tokens"),  # RlStepHeader fields (uint32), shape [1]
    "n_segments": (np.int32, "step.n_segments"),
    "n_samples": (np.int32, "step.n_samples"),
    "n_decode": (np.int32, "step.n_decode"),  # the decoding slots' segments, which come first
    "next_token": (np.int32, "next_token"),
    "step_logprobs": (np.int32, "step_logprobs"),  # RlLogprobs [sample_len], its words per place
    "block_table": (np.int32, "block_table"),  # flat [n_slots * pages_per_slot] in the arrays
    "token_counts": (np.int32, "token_counts"),  # flat [n_slots * vocab_size] in the arrays
    "grammar": (np.int32, "grammar"),  # structured output's automata (ipc/automaton.py)
    # prompt logprobs: per score entry the row to score, the prompt token it scores, the
    # alternatives asked; the entries' count; the record the step writes per entry
    "score_row": (np.int32, "score_row"),
    "score_token": (np.int32, "score_token"),
    "score_top": (np.int32, "score_top"),
    "n_score": (np.int32, "step.n_score"),
    "step_prompt_logprobs": (np.int32, "step_prompt_logprobs"),  # RlLogprobs [score_rows], words
}
# [token_budget]; the counts [1]; block_table, token_counts [n_slots, ...]; the score entries
# [score_rows] (step_prompt_logprobs [score_rows, ...]); the sample entries and their places
# [sample_len] (n_slots * (1 + spec_tokens): step_logprobs [sample_len, ...]); the rest [n_slots]
_ROW_FIELDS = ("token_ids", "positions", "slot_of")
_SAMPLE_FIELDS = ("sample_row", "sample_slot", "sample_counter", "sample_mask", "next_token")
_SCORE_FIELDS = ("score_row", "score_token", "score_top")
# the scheduler arrays a step reads or writes (host-scheduled mode uploads them: LAYOUT_RUN)
SOURCE_ARRAYS = frozenset(src.split(".")[0] for _, src in _FIELDS.values())
# of those, the ones the step writes
STEP_OUTPUTS = frozenset({"next_token", "step_logprobs", "step_prompt_logprobs"})
# and the one the host writes itself, an automaton at a time (GrammarArena: never uploaded per step)
HOST_WRITTEN = frozenset({"grammar"})

# a count's int32 word in the step header (RlStepHeader, ringleader.ipc.layout.STEP)
_HEADER_WORD = {name: off // 4 for name, (_, off) in layout.STEP.numpy_dtype().fields.items()}
# per RlSampling field: (torch dtype, its word in the struct, in words of that dtype)
_SAMPLING = layout.SAMPLING
_PARAM_WORDS = {f.name: (RING_DTYPES[str(f.kind)], off // f.item_size) for f, off in _SAMPLING.offsets()}


def end_ids_for(eos_token_ids: Sequence[int], device: Device) -> torch.Tensor | None:
    """The model's end-of-sequence ids as the scheduler ends a request at them (RlConfig.eos_ids:
    the first MAX_EOS_IDS), int32 [E] on `device`: what a row below its min_tokens cannot draw,
    besides its stop ids (StepLayout.sampling's end_ids); None for a model without any."""
    ids = [int(i) for i in eos_token_ids][: layout.MAX_EOS_IDS]
    return torch.tensor(ids, dtype=torch.int32, device=device) if ids else None


def store_prompt_logprobs(layout: StepLayout, logits: torch.Tensor, n_score: int) -> None:
    """The eager form of a step's prompt logprobs: score entry i's record (its prompt token's
    logprob and top alternatives under fp32 `logits[i]`, the raw logits of its row) into
    step_prompt_logprobs[i], for the first n_score entries."""
    entries = torch.arange(n_score, device=logits.device)
    tokens = layout.score_token[:n_score].long().clamp(0, logits.shape[1] - 1)
    store_logprobs(layout.step_prompt_logprobs, entries, logits, tokens, layout.score_top[:n_score])


def sampling_views(words: torch.Tensor) -> dict[str, torch.Tensor]:
    """One strided tensor [n] per RlSampling field over `words`, the int32 words of an RlSampling
    array of n entries (the scheduler's sample_params)."""
    out = {}
    for name, (dtype, word) in _PARAM_WORDS.items():
        typed = words.view(dtype)
        stride = _SAMPLING.size // typed.element_size()
        out[name] = typed[word::stride]
    return out


def _views(array: Callable[[str, np.dtype], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every field as a view of the scheduler's arrays: `array(name, dtype)` views one whole array
    as dtype; a count is a [1] view of its word in the step header; the block table and the
    token counts are viewed as [n_slots, -1]."""
    header = array("step", np.dtype(np.int32))
    views = {}
    for name, (dtype, src) in _FIELDS.items():
        if src.startswith("step."):
            word = _HEADER_WORD[src[5:]]
            views[name] = header[word : word + 1]
        else:
            views[name] = array(src, np.dtype(dtype))
    n_slots = views["seg_slot"].shape[0]
    for name in ("block_table", "token_counts"):
        views[name] = views[name].view(n_slots, views[name].numel() // n_slots)
    for name in ("step_logprobs", "step_prompt_logprobs"):
        views[name] = views[name].view(-1, layout.LOGPROBS.size // 4)
    return views


@dataclass
class StepLayout:
    """Tensors mirroring the scheduler's step arrays (ringleader.ipc.layout.ARRAYS).

    token_ids, positions, slot_of: int32 [token_budget] (pad rows: slot_of = -1); seg_slot,
    seg_row_start, seg_n_rows: int32 [n_slots]; sample_row, sample_slot, sample_counter: int32
    [S] (S = sample_len, n_slots * (1 + spec_tokens): with speculative decoding a decoding slot
    samples each of its rows); sample_mask: int32 [S], each sample's constraint's mask, the word
    offset of its bitmask in `grammar` (int32 [grammar_words], ipc/automaton.py), -1 for none;
    sample_params: the RlSampling entries' int32 words [S * words] (`params`
    views one field each); n_tokens, n_segments, n_samples: int32 [1], the header's counts;
    next_token: int32 [S], written by a step's run at each entry's sample_slot (its place:
    the slot for a slot's first sample); step_logprobs: int32 [S, 42], the
    RlLogprobs record a step writes for each sample whose request asked; score_row,
    score_token, score_top: int32 [score_rows], the score entries of prompt logprobs (n_score
    [1] of them: the row whose logits score, the prompt token scored, the alternatives asked),
    and step_prompt_logprobs: int32 [score_rows, 42], the record a step writes per entry; block_table: int32 [n_slots,
    pages_per_slot], slot s's position p is in KV page block_table[s, p // page_size] (entries
    past a slot's context are arbitrary); token_counts: int32 [n_slots, vocab_size] (vocab_size
    0: none kept), a penalized slot's counts.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_of: torch.Tensor
    seg_slot: torch.Tensor
    seg_row_start: torch.Tensor
    seg_n_rows: torch.Tensor
    sample_row: torch.Tensor
    sample_slot: torch.Tensor
    sample_params: torch.Tensor
    sample_counter: torch.Tensor
    sample_mask: torch.Tensor
    n_tokens: torch.Tensor
    n_segments: torch.Tensor
    n_samples: torch.Tensor
    n_decode: torch.Tensor
    next_token: torch.Tensor
    step_logprobs: torch.Tensor
    block_table: torch.Tensor
    token_counts: torch.Tensor
    grammar: torch.Tensor
    score_row: torch.Tensor
    score_token: torch.Tensor
    score_top: torch.Tensor
    n_score: torch.Tensor
    step_prompt_logprobs: torch.Tensor

    def __post_init__(self) -> None:
        self.params = sampling_views(self.sample_params)

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
    def allocate(
        cls,
        n_slots: int,
        token_budget: int,
        device: Device,
        pages_per_slot: int,
        vocab_size: int = 0,
        grammar_words: int = 1,
        score_rows: int = 1,
        spec_tokens: int = 0,
    ) -> StepLayout:
        """Zeroed tensors of the right sizes (pad rows have slot_of = -1; every block-table
        entry names page 0; every sample entry holds the declared defaults; no score entry);
        spec_tokens: the scheduler's (each decoding slot samples up to 1 + spec_tokens rows)."""
        n_samples = n_slots * (1 + spec_tokens)

        def shape(name: str) -> tuple[int, ...]:
            if name in _ROW_FIELDS:
                return (token_budget,)
            if name in _SAMPLE_FIELDS:
                return (n_samples,)
            if name in _SCORE_FIELDS:
                return (max(1, score_rows),)
            if name == "step_prompt_logprobs":
                return (max(1, score_rows), layout.LOGPROBS.size // 4)
            if name == "block_table":
                return (n_slots, pages_per_slot)
            if name == "token_counts":
                return (n_slots, vocab_size)
            if name == "step_logprobs":
                return (n_samples, layout.LOGPROBS.size // 4)
            if name == "sample_params":
                return (n_samples * _SAMPLING.size // 4,)
            if name == "grammar":
                return (grammar_words,)
            return (1,) if _FIELDS[name][1].startswith("step.") else (n_slots,)

        out = {
            name: torch.zeros(shape(name), dtype=getattr(torch, np.dtype(dtype).name), device=device)
            for name, (dtype, _) in _FIELDS.items()
        }
        out["slot_of"].fill_(-1)
        out["sample_mask"].fill_(-1)
        made = cls(**out)
        for name, view in made.params.items():
            view.fill_(FIELD[name].ring_default)
        return made

    def copy_from_arrays(self, arrays: dict[str, np.ndarray], non_blocking: bool = False) -> None:
        """Uploads the scheduler's host arrays into these tensors (host-scheduled mode); what
        the step writes (STEP_OUTPUTS) and the host writes itself (HOST_WRITTEN) are left alone."""
        source = StepLayout.from_arrays(arrays)
        for f in fields(self):
            if f.name not in STEP_OUTPUTS | HOST_WRITTEN:
                getattr(self, f.name).copy_(getattr(source, f.name), non_blocking=non_blocking)

    def sampling(self, m: int, counts: bool = True, end_ids: torch.Tensor | None = None) -> SamplingTensors:
        """The sampling settings of sample entries [0, m), as views; with `counts` (and counts
        kept: vocab_size > 0) the token-count table and each entry's slot in it; structured
        output's masks (the grammar array and each entry's mask offset) always; `end_ids`, the
        model's (end_ids_for), kept out of an entry's draw while its sample_counter (the tokens
        its request generated) is below its min_tokens."""
        keep = counts and self.token_counts.shape[1] > 0
        params = {name: view[:m] for name, view in self.params.items()}
        return SamplingTensors(
            self.sample_counter[:m],
            self.token_counts if keep else None,
            self.sample_slot[:m] if keep else None,
            grammar=self.grammar,
            mask_at=self.sample_mask[:m],
            end_ids=end_ids,
            **params,
        )

    def read_counts(self) -> tuple[int, int, int]:
        """(n_tokens, n_segments, n_samples) read on the host: a device sync unless the layout
        is on the CPU, so only the eager step calls it."""
        return int(self.n_tokens.item()), int(self.n_segments.item()), int(self.n_samples.item())
