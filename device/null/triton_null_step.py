"""The null model's whole step as one Triton launch (null_step.NullStep on CUDA): the pattern's
lookup for every live sample entry, the logprobs records of the entries that asked, and the fixed
busy time as a spin on the GPU's global timer (%globaltimer, nanoseconds) in the first program.
A program per 64 sample entries (a step has at most n_slots of them). Bit for bit
NullStep's torch form (tests/test_null_model.py runs both under Triton's interpreter)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ringleader.device.null.null_logits import record_logprobs
from ringleader.device.sampling.sampler import LOGPROBS_WORD, LOGPROBS_WORDS
from ringleader.device.step.triton_launch import launch
from ringleader.ipc.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from ringleader.device.step.step_layout import StepLayout

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: NullStep's torch form still runs
    triton = None
    tl = None

HAVE_TRITON = triton is not None
MAX_BLOCK = 64  # sample entries per program: a [64, 32] tile of record words stays in registers

if HAVE_TRITON:
    from triton.language.extra.cuda import globaltimer

    @triton.jit
    def _spin_ns(spin_ns):
        start = globaltimer()
        while globaltimer() - start < spin_ns:
            pass

    @triton.jit
    def _null_step_kernel(
        table_ptr,
        token_ids_ptr,
        sample_row_ptr,
        sample_slot_ptr,
        n_samples_ptr,
        top_n_ptr,
        top_n_stride,
        next_token_ptr,
        records_ptr,
        n_entries,
        bucket,
        n_slots,
        vocab,
        spin_ns,
        token_lp,
        other_lp,
        BLOCK: tl.constexpr,
        TOP: tl.constexpr,
        TOP_BLOCK: tl.constexpr,
        WORDS: tl.constexpr,
        W_N_TOP: tl.constexpr,
        W_IDS: tl.constexpr,
        W_LPS: tl.constexpr,
        SPIN: tl.constexpr,
    ):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = (i < n_entries) & (i < tl.load(n_samples_ptr))
        row = tl.load(sample_row_ptr + i, mask=live, other=0)
        row = tl.minimum(tl.maximum(row, 0), bucket - 1)
        t = tl.load(token_ids_ptr + row, mask=live, other=0)
        t = tl.minimum(tl.maximum(t, 0), vocab - 1)
        tok = tl.load(table_ptr + t, mask=live, other=0)
        slot = tl.load(sample_slot_ptr + i, mask=live, other=0)
        slot = tl.minimum(tl.maximum(slot, 0), n_slots - 1)
        tl.store(next_token_ptr + slot, tok, mask=live)

        top_n = tl.load(top_n_ptr + i * top_n_stride, mask=live, other=-1)
        asked = live & (top_n >= 0)
        record = records_ptr + slot.to(tl.int64) * WORDS
        head = tl.zeros([BLOCK], dtype=tl.float32) + token_lp
        tl.store(record, head.to(tl.int32, bitcast=True), mask=asked)
        tl.store(record + W_N_TOP, tl.minimum(top_n, TOP), mask=asked)
        j = tl.arange(0, TOP_BLOCK)[None, :]
        tok2 = tok[:, None]
        ids = tl.where(j == 0, tok2, (j - 1) + ((j - 1) >= tok2).to(tl.int32))
        lps = tl.where(j == 0, token_lp, other_lp) + tl.zeros([BLOCK, TOP_BLOCK], dtype=tl.float32)
        cols = asked[:, None] & (j < TOP)
        tl.store(record[:, None] + W_IDS + j, ids, mask=cols)
        tl.store(record[:, None] + W_LPS + j, lps.to(tl.int32, bitcast=True), mask=cols)
        if SPIN:  # noqa: SIM102 - a constexpr branch: compiled out, not tested per launch
            if tl.program_id(0) == 0:  # the launch ends when its last program does
                _spin_ns(spin_ns)


def null_step_triton(
    table: torch.Tensor, n_slots: int, step_ns: int, bucket: int, layout: StepLayout
) -> None:
    """NullStep.run in one launch over the pattern's `table` (int32 [vocab]): entries [0,
    min(bucket, n_slots)), live below n_samples (read on the device); then `step_ns` busy."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; use NullStep(kernel='torch')")
    records = layout.step_logprobs
    if records.dtype != torch.int32 or records.stride() != (LOGPROBS_WORDS, 1):
        raise ValueError(f"null_step_triton: step_logprobs must be a dense int32 [S, {LOGPROBS_WORDS}]")
    n_entries, vocab = min(bucket, n_slots), table.shape[0]
    top_n = layout.params["logprobs"]
    token_lp, other_lp = record_logprobs(vocab)
    block = min(MAX_BLOCK, max(16, triton.next_power_of_2(n_entries)))
    launch(
        _null_step_kernel,
        (triton.cdiv(n_entries, block),),
        table,
        layout.token_ids,
        layout.sample_row,
        layout.sample_slot,
        layout.n_samples,
        top_n,
        top_n.stride(0),
        layout.next_token,
        records,
        n_entries,
        bucket,
        n_slots,
        vocab,
        step_ns,
        token_lp,
        other_lp,
        BLOCK=block,
        TOP=MAX_LOGPROBS,
        TOP_BLOCK=triton.next_power_of_2(MAX_LOGPROBS),
        WORDS=LOGPROBS_WORDS,
        W_N_TOP=LOGPROBS_WORD["n_top"],
        W_IDS=LOGPROBS_WORD["top_ids"],
        W_LPS=LOGPROBS_WORD["top_logprobs"],
        SPIN=step_ns > 0,
        num_warps=4,
    )
