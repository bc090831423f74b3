"""The sampler's counter-based uniform (sampling.counter_uniform), its penalties and temperature
(sampling.penalize_and_scale) and its logprobs (sampling.store_logprobs) as one Triton launch each.

In torch the hash is about ninety tiny integer kernels (four 32-bit finalisers, each split into
16-bit halves so no int64 product overflows), which inside a captured decode step cost more
graph nodes than all the rest of the sampler. Here one program per block of rows computes it
with native uint32 arithmetic (wrapping multiplies), bit for bit the same value as the torch
function, so a seeded request draws the same tokens on the CPU backend and in the CUDA graph.

The penalties in torch are a dozen passes over [rows, vocab] plus a gather of each row's token
counts, every step of the graph whether any request has a penalty or not. Here one program per
(row, vocabulary block) reads the row's three penalties first and touches the counts only when
one is on (reading the count table through the row's slot), then divides by the row's divisor
(its temperature, 1 for greedy rows) into a new tensor: the raw logits stay for the logprobs.
Structured output's mask comes last (sampling.mask_disallowed): a row whose mask_at is >= 0
reads its block's words of the bitmask and sets -inf where a token has no bit; a row without a
constraint branches past it and reads nothing more. Then min_tokens (sampling.mask_ends): a row
whose counter is below its min_tokens sets -inf at its end ids (the model's, then its stop ids);
any other row reads its two scalars and no id. The arithmetic is penalize_and_scale's in
its order, with IEEE division and no fused multiply-add, so both forms give the same bits.

The logprobs in torch are a logsumexp, a top-k and a scatter over every row, every step, asked
or not. Here one program per row reads the row's top_n first and does nothing unless the row
asked (top_n >= 0) and is a live sample entry: then one pass over the vocabulary for the
logsumexp and the most likely token, and one more per further alternative, each the largest
entry after the previous pick in the order (value descending, id ascending).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ringleader.device.sampling.sampler import LOGPROBS_WORD, LOGPROBS_WORDS
from ringleader.device.step.triton_launch import launch
from ringleader.ipc.layout import PROMPT_MARK
from ringleader.ipc.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from ringleader.device.sampling.sampler import SamplingTensors

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: sampling.counter_uniform still works
    triton = None
    tl = None

HAVE_TRITON = triton is not None

if HAVE_TRITON:

    @triton.jit
    def _mix32(x):
        # lowbias32, as sampling._mix32; uint32 multiplies wrap mod 2**32
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _mask_row(grammar_ptr, mask_at, grammar_words):
        # the row's bitmask and its last readable word: a stale row's offset may be anything, so
        # the start and every word index stay inside the array (as sampling.mask_disallowed)
        start = tl.minimum(tl.maximum(mask_at, 0), grammar_words - 1)
        return grammar_ptr + start, grammar_words - 1 - start

    @triton.jit
    def _mask_words(mask_row, last_word, offs, load):
        # each token's word of the row's bitmask (all bits set where not loaded)
        return tl.load(mask_row + tl.minimum(offs >> 5, last_word), mask=load, other=-1)

    @triton.jit
    def _allowed(word, offs):
        # bit t & 31 of token t's word (ipc/automaton.py)
        return ((word >> (offs & 31)) & 1) != 0

    @triton.jit
    def _mask_end_ids(x, offs, end_ptr, n_end, stop_row, n_stop):
        # -inf at each of the row's end ids: n_end model ids, then n_stop stop ids (-1: none);
        # a row that is not below its min_tokens passes n_end = n_stop = 0 and reads no id
        for k in range(0, n_end):
            x = tl.where(offs == tl.load(end_ptr + k), float("-inf"), x)
        for k in range(0, n_stop):
            x = tl.where(offs == tl.load(stop_row + k), float("-inf"), x)
        return x

    @triton.jit
    def _counter_uniform_kernel(seed_ptr, counter_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        seed = tl.load(seed_ptr + offs, mask=ok, other=0).to(tl.int64)
        counter = tl.load(counter_ptr + offs, mask=ok, other=0).to(tl.int64)
        # two's-complement halves as uint32 (the torch version's `& 0xFFFFFFFF`)
        seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        ctr_lo = (counter & 0xFFFFFFFF).to(tl.uint32)
        ctr_hi = ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32)
        x = _mix32(seed_lo ^ 0x9E3779B9)
        x = _mix32(x ^ seed_hi)
        x = _mix32(x ^ ctr_lo)
        x = _mix32(x ^ ctr_hi ^ 0x85EBCA6B)
        u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        tl.store(out_ptr + offs, u, mask=ok)

    @triton.jit
    def _penalize_and_scale_kernel(
        logits_ptr,
        out_ptr,
        divisor_ptr,
        counts_ptr,
        slot_ptr,
        repetition_ptr,
        frequency_ptr,
        presence_ptr,
        grammar_ptr,
        mask_at_ptr,
        min_tokens_ptr,
        counter_ptr,
        end_ptr,
        stop_ptr,
        vocab,
        n_slots,
        grammar_words,
        n_end,
        n_stop,
        logits_stride,
        param_stride,
        mask_at_stride,
        min_tokens_stride,
        counter_stride,
        stop_stride,
        PROMPT_MARK: tl.constexpr,
        HAS_COUNTS: tl.constexpr,
        HAS_MASK: tl.constexpr,
        HAS_ENDS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < vocab
        x = tl.load(logits_ptr + row * logits_stride + offs, mask=ok, other=0.0)
        if HAS_COUNTS:
            r = tl.load(repetition_ptr + row * param_stride)
            f = tl.load(frequency_ptr + row * param_stride)
            p = tl.load(presence_ptr + row * param_stride)
            # a row without a penalty reads no counts (no token is below a limit of 0)
            limit = tl.where((r != 1.0) | (f != 0.0) | (p != 0.0), vocab, 0)
            hit = offs < limit
            slot = tl.minimum(tl.maximum(tl.load(slot_ptr + row), 0), n_slots - 1).to(tl.int64)
            c = tl.load(counts_ptr + slot * vocab + offs, mask=hit, other=0)
            count = (c & (PROMPT_MARK - 1)).to(tl.float32)
            repeated = tl.where(x > 0, tl.math.div_rn(x, r), x * r)
            penalized = tl.where(c != 0, repeated, x)
            penalized = penalized - f * count - p * (count > 0).to(tl.float32)
            x = tl.where(hit, penalized, x)
        divisor = tl.load(divisor_ptr + row)
        x = tl.math.div_rn(x, divisor)
        if HAS_MASK:
            mask_at = tl.load(mask_at_ptr + row * mask_at_stride)
            # a row without a constraint reads no mask word
            if mask_at >= 0:
                mask_row, last_word = _mask_row(grammar_ptr, mask_at, grammar_words)
                word = _mask_words(mask_row, last_word, offs, ok)
                x = tl.where(_allowed(word, offs), x, float("-inf"))
        if HAS_ENDS:
            min_tokens = tl.load(min_tokens_ptr + row * min_tokens_stride)
            below = tl.load(counter_ptr + row * counter_stride) < min_tokens
            x = _mask_end_ids(
                x,
                offs,
                end_ptr,
                tl.where(below, n_end, 0),
                stop_ptr + row * stop_stride,
                tl.where(below, n_stop, 0),
            )
        tl.store(out_ptr + row * vocab + offs, x, mask=ok)

    @triton.jit
    def _store_logprobs_kernel(
        table_ptr,
        slot_ptr,
        logits_ptr,
        tokens_ptr,
        top_n_ptr,
        n_valid_ptr,
        vocab,
        n_slots,
        logits_stride,
        slot_stride,
        tokens_stride,
        top_n_stride,
        RECORD_WORDS: tl.constexpr,
        TOP_IDS_WORD: tl.constexpr,
        TOP_LOGPROBS_WORD: tl.constexpr,
        MAX_TOP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        top_n = tl.load(top_n_ptr + row * top_n_stride)
        # a row nobody asked logprobs for (or a stale entry) reads no logits and writes nothing
        if (top_n >= 0) & (row < tl.load(n_valid_ptr)):
            x_ptr = logits_ptr + row.to(tl.int64) * logits_stride
            lanes = tl.arange(0, BLOCK)
            # pass 1, per lane: online max and sum of exp, and the id of the lane's maximum (vocab:
            # none yet; a lane takes its first entry, then only a larger one: ties keep the lowest id)
            lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
            lane_sum = tl.zeros([BLOCK], tl.float32)
            lane_arg = tl.zeros([BLOCK], tl.int32) + vocab
            for start in range(0, vocab, BLOCK):
                offs = start + lanes
                ok = offs < vocab
                x = tl.load(x_ptr + offs, mask=ok, other=float("-inf"))
                new_max = tl.maximum(lane_max, x)
                # a lane of -inf alone sums exp(-inf - 0) = 0 (not exp(-inf + inf) = nan)
                shift = tl.where(new_max == float("-inf"), 0.0, new_max)
                lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
                lane_arg = tl.where(ok & ((x > lane_max) | (lane_arg == vocab)), offs, lane_arg)
                lane_max = new_max
            row_max = tl.max(lane_max, axis=0)
            shift = tl.where(row_max == float("-inf"), 0.0, row_max)
            log_total = shift + tl.log(tl.sum(lane_sum * tl.exp(lane_max - shift), axis=0))
            pick_value = row_max
            pick_id = tl.min(tl.where(lane_max == row_max, lane_arg, vocab), axis=0)

            slot = tl.minimum(tl.maximum(tl.load(slot_ptr + row * slot_stride), 0), n_slots - 1)
            record = table_ptr + slot.to(tl.int64) * RECORD_WORDS
            token = tl.minimum(tl.maximum(tl.load(tokens_ptr + row * tokens_stride), 0), vocab - 1)
            logprob = tl.load(x_ptr + token) - log_total
            n_top = tl.minimum(top_n, tl.minimum(vocab, MAX_TOP))
            tl.store(record, logprob.to(tl.int32, bitcast=True))
            tl.store(record + 1, n_top)
            for k in range(0, n_top):
                if k > 0:
                    # the largest entry after the previous pick in (value descending, id ascending)
                    best = tl.full([BLOCK], float("-inf"), tl.float32)
                    best_id = tl.zeros([BLOCK], tl.int32) + vocab
                    for start in range(0, vocab, BLOCK):
                        offs = start + lanes
                        x = tl.load(x_ptr + offs, mask=offs < vocab, other=float("-inf"))
                        after = (x < pick_value) | ((x == pick_value) & (offs > pick_id))
                        take = (offs < vocab) & after & ((x > best) | (best_id == vocab))
                        best = tl.where(take, x, best)
                        best_id = tl.where(take, offs, best_id)
                    pick_value = tl.max(best, axis=0)
                    pick_id = tl.min(tl.where(best == pick_value, best_id, vocab), axis=0)
                # vocab - 1 only for a row with nan logits, where no entry compares
                tl.store(record + TOP_IDS_WORD + k, tl.minimum(pick_id, vocab - 1))
                top_logprob = pick_value - log_total
                tl.store(record + TOP_LOGPROBS_WORD + k, top_logprob.to(tl.int32, bitcast=True))


def counter_uniform_triton(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """sampling.counter_uniform(seed, counter) for 1-D int tensors of one length, one launch."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; use sampling.counter_uniform")
    (n,) = seed.shape
    out = torch.empty(n, dtype=torch.float32, device=seed.device)
    block = max(16, 1 << max(0, (n - 1).bit_length()))
    block = min(block, 1024)
    launch(_counter_uniform_kernel, (triton.cdiv(n, block),), seed, counter, out, n, BLOCK=block)
    return out


def check_masks(
    caller: str, params: SamplingTensors, n: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """params' (grammar, mask_at) as a kernel reads them, (None, None) without masks; ValueError
    naming what is wrong: a dense, non-empty int32 grammar [G] and integers mask_at [n], both on
    `device`."""
    grammar, mask_at = params.grammar, params.mask_at
    if mask_at is None:
        return None, None
    if grammar is None or grammar.dtype != torch.int32 or grammar.dim() != 1 or grammar.numel() < 1:
        raise ValueError(f"{caller}: grammar must be a non-empty int32 [G]")
    if grammar.stride(0) != 1 or grammar.device != device:
        raise ValueError(f"{caller}: grammar must be dense and on the logits' device")
    if mask_at.shape != (n,) or mask_at.dtype.is_floating_point or mask_at.device != device:
        raise ValueError(f"{caller}: mask_at must be integers [{n}] on the logits' device")
    return grammar, mask_at


def check_ends(
    caller: str, params: SamplingTensors, n: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """params' (end_ids, stop_ids) as a kernel reads them (a dense [E] and an [n, S] with a unit
    inner stride, None where absent); ValueError naming what is wrong: integers on `device`."""
    end_ids, stop_ids = params.end_ids, params.stop_ids
    for name, t, dims in (("end_ids", end_ids, 1), ("stop_ids", stop_ids, 2)):
        if t is None:
            continue
        if t.dim() != dims or t.dtype.is_floating_point or t.dtype == torch.bool or t.device != device:
            raise ValueError(
                f"{caller}: {name} must be integers [{'E' if dims == 1 else f'{n}, S'}] on the logits' device"
            )
        if t.stride(-1) != 1 or (dims == 2 and t.shape[0] != n):
            raise ValueError(f"{caller}: {name} must have a unit inner stride (and a row per logits row)")
    return end_ids, stop_ids


PENALTY_BLOCK = 1024


def penalize_and_scale_triton(
    logits: torch.Tensor, params: SamplingTensors, divisor: torch.Tensor
) -> torch.Tensor:
    """sampling.penalize_and_scale(logits, params, divisor) for fp32 logits [N, V] with a unit
    inner stride and an fp32 divisor [N], bit for bit, one launch, into a new tensor [N, V];
    `params` carries the count table [S, V] and each row's slot (a missing slot: row i's counts
    are row i), or no table (then only the division); and structured output's grammar (int32
    [G]) and mask_at (integers [N]), or none: a row with mask_at >= 0 gets -inf where its mask
    has no bit, one with mask_at < 0 reads no mask word; and min_tokens' end_ids ([E]) and
    stop_ids ([N, S]), or none: a row whose counter is below its min_tokens gets -inf at them."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; use sampling.penalize_and_scale")
    n, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("penalize_and_scale_triton: fp32 logits with unit inner stride")
    if divisor.dtype != torch.float32 or divisor.shape != (n,):
        raise ValueError("penalize_and_scale_triton: an fp32 divisor per row")
    counts = params.token_counts
    if counts is not None and counts.stride() != (vocab, 1):
        raise ValueError("penalize_and_scale_triton: dense counts [S, V]")
    penalties = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    if any(t.dtype != torch.float32 or t.stride(0) != penalties[0].stride(0) for t in penalties):
        raise ValueError("penalize_and_scale_triton: the three penalties as fp32 views of one stride")
    grammar, mask_at = check_masks("penalize_and_scale_triton", params, n, logits.device)
    end_ids, stop_ids = check_ends("penalize_and_scale_triton", params, n, logits.device)
    has_ends = end_ids is not None or stop_ids is not None
    min_tokens, counter = params.min_tokens, params.counter
    if has_ends and any(t.shape != (n,) or t.dtype.is_floating_point for t in (min_tokens, counter)):
        raise ValueError("penalize_and_scale_triton: min_tokens and counter as integers [N]")
    if counts is None:
        slot = None
    elif params.slot is not None:
        slot = params.slot
    else:
        slot = torch.arange(n, dtype=torch.int32, device=logits.device)
    out = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    grid = (n, triton.cdiv(vocab, PENALTY_BLOCK))
    launch(
        _penalize_and_scale_kernel,
        grid,
        logits,
        out,
        divisor.contiguous(),
        logits if counts is None else counts,  # unread without counts (HAS_COUNTS False)
        divisor if slot is None else slot,
        *penalties,
        logits if grammar is None else grammar,  # unread without masks (HAS_MASK False)
        divisor if mask_at is None else mask_at,
        min_tokens if has_ends else divisor,  # unread without end ids (HAS_ENDS False)
        counter if has_ends else divisor,
        divisor if end_ids is None else end_ids,
        divisor if stop_ids is None else stop_ids,
        vocab,
        0 if counts is None else counts.shape[0],
        1 if grammar is None else grammar.numel(),
        0 if end_ids is None else end_ids.shape[0],
        0 if stop_ids is None else stop_ids.shape[1],
        logits.stride(0),
        penalties[0].stride(0),
        0 if mask_at is None else mask_at.stride(0),
        min_tokens.stride(0) if has_ends else 0,
        counter.stride(0) if has_ends else 0,
        0 if stop_ids is None else stop_ids.stride(0),
        PROMPT_MARK=PROMPT_MARK,
        HAS_COUNTS=counts is not None,
        HAS_MASK=mask_at is not None,
        HAS_ENDS=has_ends,
        BLOCK=PENALTY_BLOCK,
        enable_fp_fusion=False,
    )
    return out


# one program per row streams the vocabulary (once, and once more per further alternative), so
# each program takes a wide block and more warps to keep loads in flight
LOGPROBS_BLOCK = 2048
LOGPROBS_WARPS = 8


def store_logprobs_triton(
    table: torch.Tensor,
    slot: torch.Tensor,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    top_n: torch.Tensor,
    n_valid: torch.Tensor,
) -> None:
    """sampling.store_logprobs(table, slot, logits, tokens, top_n, valid) with valid[i] = i <
    n_valid[0] (an int32 tensor [1] on the device), one launch, one program per row: a row with
    top_n < 0 or i >= n_valid reads and writes nothing. Writes the first n_top top entries of a
    record only (the rest stay as they were). fp32 logits [N, V] with a unit inner stride, table
    int32 [S, LOGPROBS_WORDS] dense; slot, tokens and top_n [N] of any int dtype and stride."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; use sampling.store_logprobs")
    n, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("store_logprobs_triton: fp32 logits with unit inner stride")
    if (
        table.dtype != torch.int32
        or table.shape[1:] != (LOGPROBS_WORDS,)
        or table.stride() != (LOGPROBS_WORDS, 1)
    ):
        raise ValueError(f"store_logprobs_triton: a dense int32 table [S, {LOGPROBS_WORDS}]")
    if any(t.shape != (n,) for t in (slot, tokens, top_n)) or n_valid.numel() != 1:
        raise ValueError("store_logprobs_triton: slot, tokens and top_n [N], n_valid [1]")
    launch(
        _store_logprobs_kernel,
        (n,),
        table,
        slot,
        logits,
        tokens,
        top_n,
        n_valid,
        vocab,
        table.shape[0],
        logits.stride(0),
        slot.stride(0),
        tokens.stride(0),
        top_n.stride(0),
        RECORD_WORDS=LOGPROBS_WORDS,
        TOP_IDS_WORD=LOGPROBS_WORD["top_ids"],
        TOP_LOGPROBS_WORD=LOGPROBS_WORD["top_logprobs"],
        MAX_TOP=MAX_LOGPROBS,
        BLOCK=LOGPROBS_BLOCK,
        num_warps=LOGPROBS_WARPS,
        # Triton 3.6's ptxas aimed at 40-48 registers on sm_80 and spilled (bench/lab/triton_aot.py)
        maxnreg=128,
    )
