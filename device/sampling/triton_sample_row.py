"""The whole sampler of a decode step (sampling.sample) as one Triton launch, one program per row.

sample() in torch is some sixty kernels a step (penalties, a softmax, a cumsum over the
vocabulary, a top-k of MAX_TOP_K candidates, two more cumsums, gathers); here one program per row
does what its row needs and nothing more, reading its parameters first:

  - fast path: a greedy row (temperature <= 0, or a stale entry i >= n_samples) with neutral
    penalties and no constraint takes the lm_head's argmax of the raw logits (`greedy_token`) and
    reads nothing else (below its min_tokens, it reads its end ids too, and keeps the fast path
    unless that argmax is one of them);
  - greedy with a penalty, a constraint or an end id to avoid: one pass, the argmax of the
    penalized, masked logits (first index on ties);
  - unrestricted (top_k off and top_p 1, min_p or not): a pass for the row max, one for the
    min_p-kept mass, one inclusive scan in vocabulary order that stops at the drawn token;
  - restricted (top_k or top_p): the row max (and, with top_k off, the mass top_p measures
    against), then a radix select of the K-th largest logit, K = min(V, MAX_TOP_K): the logits
    as order-preserving uint32 keys, four passes of an 8-bit digit histogram (tl.histogram)
    narrowing a key prefix, which stop early once every key that matches the prefix is a
    candidate; a gather pass writes the K candidates as (key << 32 | ~index) into a scratch
    row [K] of global memory, which is read back and sorted in registers (tl.sort, descending);
    then min_p, top_k and top_p masks, the cumsum and the draw exactly as sample() does.

Every pass walks the row in BLOCK_V chunks and recomputes its penalized, temperature-scaled
logits on the fly (penalize_and_scale's arithmetic in its order: IEEE division, no fused
multiply-add, so the same bits), then a constrained row's mask (-inf where its bitmask in
`grammar` has no bit; a row with mask_at < 0 reads no mask word) and, for a row below its
min_tokens, -inf at its end ids (the model's end_ids and its stop_ids row; every other row
loops over none), so no [rows, V] intermediate is ever written. Candidates tied at the
threshold key are taken lowest index first, and equal keys sort lowest index first: the order
(value descending, index ascending), which is what torch.topk gives for distinct values (-0.0
ranks below +0.0 here; torch ties them). Passes over the row: fast path none, greedy with a
penalty, a constraint or an end id to avoid 1, unrestricted 3 (the scan stops at the draw),
restricted at most 6 (7 with top_k off), and one sort of K entries. With USE_PDL the program waits (gdc_wait) before its first read
and lets the next kernel launch once its last input is read, just before its stores.

Where the result may differ from sample(): only where the draw's target (or the top_p cut, or
min_p's threshold) lies within float rounding of a boundary, since sums run in another order than
torch.cumsum's and tl.exp is not torch's exp. Guards: the vocabulary draw finds the crossing
chunk with the same per-chunk sums that made the total, so the target always falls in some
chunk, and both draws clamp to the last entry of positive mass, so rounding never selects a
token the masks dropped. A row whose logits hold nan or are all -inf gets some index in [0, V).
"""

from __future__ import annotations

import os

import torch

from ringleader.device.sampling.sampler import RING_NAMES, SamplingTensors
from ringleader.device.sampling.triton_sampler import check_ends, check_masks
from ringleader.device.step.triton_launch import launch, pdl_meta
from ringleader.ipc.layout import PROMPT_MARK
from ringleader.ipc.sampling_params import MAX_TOP_K

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: sampling.sample still works
    triton = None
    tl = None

HAVE_TRITON = triton is not None

# one program streams a whole row several times: wide chunks and 8 warps keep loads in flight,
# and 16 fp32 lanes per thread leave room for the candidate sort without spills
BLOCK_V = 2048
NUM_WARPS = 8

if HAVE_TRITON:
    from ringleader.device.sampling.triton_sampler import (
        _allowed,
        _mask_end_ids,
        _mask_row,
        _mask_words,
        _mix32,
    )

    @triton.jit
    def _counter_uniform(seed, counter):
        # sampling.counter_uniform bit for bit (as triton_sampler's kernel computes it)
        x = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x9E3779B9)
        x = _mix32(x ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        x = _mix32(x ^ (counter & 0xFFFFFFFF).to(tl.uint32))
        x = _mix32(x ^ ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32) ^ 0x85EBCA6B)
        return ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)

    @triton.jit
    def _order_key(x):
        # fp32 -> uint32 in the same order: a negative float has all bits flipped, others the sign set
        bits = x.to(tl.uint32, bitcast=True)
        return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)

    @triton.jit
    def _key_value(key):
        bits = tl.where((key >> 31) != 0, key ^ 0x80000000, ~key)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _scaled_block(
        row_args, offs, HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ENDS: tl.constexpr,
        PROMPT_MARK: tl.constexpr,
    ):  # fmt: skip
        # penalize_and_scale on one chunk of the row; past the vocabulary -inf, and only a
        # penalized row (count_limit = vocab, else 0) reads its counts, only a constrained one
        # (mask_limit = vocab, else 0) its mask, only one below its min_tokens (n_end, n_stop
        # not 0) its end ids
        logits_row, counts_row, vocab, count_limit, repetition, frequency, presence, divisor = row_args[:8]
        x = tl.load(logits_row + offs, mask=offs < vocab, other=float("-inf"))
        if HAS_COUNTS:
            hit = offs < count_limit
            c = tl.load(counts_row + offs, mask=hit, other=0)
            count = (c & (PROMPT_MARK - 1)).to(tl.float32)
            repeated = tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition)
            penalized = tl.where(c != 0, repeated, x)
            penalized = penalized - frequency * count - presence * (count > 0).to(tl.float32)
            x = tl.where(hit, penalized, x)
        x = tl.math.div_rn(x, divisor)
        if HAS_MASK:
            mask_row, last_word, mask_limit = row_args[8:11]
            word = _mask_words(mask_row, last_word, offs, offs < mask_limit)
            x = tl.where(_allowed(word, offs), x, float("-inf"))
        if HAS_ENDS:
            end_ptr, n_end, stop_row, n_stop = row_args[11:]
            x = _mask_end_ids(x, offs, end_ptr, n_end, stop_row, n_stop)
        return x

    @triton.jit
    def _is_end_id(token, end_ptr, n_end, stop_row, n_stop):
        # whether `token` is one of the row's end ids (n_end model ids, n_stop stop ids)
        hit = token < 0
        for k in range(0, n_end):
            hit = hit | (tl.load(end_ptr + k) == token)
        for k in range(0, n_stop):
            hit = hit | (tl.load(stop_row + k) == token)
        return hit

    @triton.jit
    def _min_p_keeps(x, row_max, min_p):
        # sample()'s verdict, ~(relative < min_p): read by both draws, so both keep the same tokens
        return (tl.exp(x - row_max) < min_p) == 0

    @triton.jit
    def _kept_mass(x, row_max, min_p, in_vocab):
        # sample()'s relative = exp(scaled - max), zero where min_p drops it or past the vocabulary
        return tl.where(in_vocab & _min_p_keeps(x, row_max, min_p), tl.exp(x - row_max), 0.0)

    @triton.jit
    def _max_pass(
        row_args, BLOCK_V: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ENDS: tl.constexpr,
        PROMPT_MARK: tl.constexpr,
    ):  # fmt: skip
        # the row max and its first index (a lane keeps its first maximum, the lowest lane wins)
        vocab = row_args[2]
        lanes = tl.arange(0, BLOCK_V)
        lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
        lane_arg = tl.zeros([BLOCK_V], tl.int32) + vocab
        for start in range(0, vocab, BLOCK_V):
            offs = start + lanes
            x = _scaled_block(row_args, offs, HAS_COUNTS, HAS_MASK, HAS_ENDS, PROMPT_MARK)
            take = (offs < vocab) & ((x > lane_max) | (lane_arg == vocab))
            lane_arg = tl.where(take, offs, lane_arg)
            lane_max = tl.where(take, x, lane_max)
        row_max = tl.max(lane_max, axis=0)
        first = tl.min(tl.where(lane_max == row_max, lane_arg, vocab), axis=0)
        return row_max, tl.minimum(first, vocab - 1)

    @triton.jit
    def _mass_pass(
        row_args, row_max, min_p,
        BLOCK_V: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ENDS: tl.constexpr,
        PROMPT_MARK: tl.constexpr,
    ):  # fmt: skip
        # the min_p-kept mass of the whole row, summed chunk by chunk as _scan_draw re-sums it
        vocab = row_args[2]
        lanes = tl.arange(0, BLOCK_V)
        total = 0.0
        for start in range(0, vocab, BLOCK_V):
            offs = start + lanes
            x = _scaled_block(row_args, offs, HAS_COUNTS, HAS_MASK, HAS_ENDS, PROMPT_MARK)
            total += tl.sum(_kept_mass(x, row_max, min_p, offs < vocab), axis=0)
        return total

    @triton.jit
    def _scan_draw(
        row_args, row_max, min_p, target, total, token,
        BLOCK_V: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ENDS: tl.constexpr,
        PROMPT_MARK: tl.constexpr,
    ):  # fmt: skip
        # the first index whose inclusive prefix mass reaches target * total, in vocabulary order;
        # chunks after the crossing one are skipped (`carried` only grows)
        vocab = row_args[2]
        lanes = tl.arange(0, BLOCK_V)
        threshold = target * total
        carried = 0.0
        for start in range(0, vocab, BLOCK_V):
            if carried < threshold:
                offs = start + lanes
                x = _scaled_block(row_args, offs, HAS_COUNTS, HAS_MASK, HAS_ENDS, PROMPT_MARK)
                mass = _kept_mass(x, row_max, min_p, offs < vocab)
                chunk_total = tl.sum(mass, axis=0)
                if carried + chunk_total >= threshold:
                    below = (carried + tl.cumsum(mass, axis=0)) < threshold
                    last_kept = tl.max(tl.where(mass > 0, lanes, 0), axis=0)
                    token = start + tl.minimum(tl.sum(below.to(tl.int32), axis=0), last_kept)
                carried += chunk_total
        return token

    @triton.jit
    def _radix_select(
        row_args, n_candidates,
        BLOCK_V: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ENDS: tl.constexpr,
        PROMPT_MARK: tl.constexpr,
    ):  # fmt: skip
        # the key prefix (and its mask) that the n_candidates largest keys reach: those above it,
        # and the first `remaining` of those matching it; stops once all that match are taken
        vocab = row_args[2]
        lanes = tl.arange(0, BLOCK_V)
        bins = tl.arange(0, 256)
        prefix = tl.zeros([1], tl.uint32).sum(axis=0)
        prefix_mask = prefix
        digit_mask = prefix + 0xFF000000  # the digit's bits, most significant digit first
        shift = prefix + 24
        remaining = n_candidates + tl.zeros([1], tl.int32).sum(axis=0)
        matched = vocab + tl.zeros([1], tl.int32).sum(axis=0)
        for _ in range(0, 4):
            if remaining < matched:
                hist = tl.zeros([256], tl.int32)
                for start in range(0, vocab, BLOCK_V):
                    offs = start + lanes
                    x = _scaled_block(row_args, offs, HAS_COUNTS, HAS_MASK, HAS_ENDS, PROMPT_MARK)
                    key = _order_key(x)
                    match = (offs < vocab) & ((key & prefix_mask) == prefix)
                    hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=match)
                # the highest digit whose count from the top reaches the remaining candidates
                from_top = tl.cumsum(hist, axis=0, reverse=True)
                chosen = tl.max(tl.where(from_top >= remaining, bins, 0), axis=0)
                in_bin = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
                remaining -= tl.sum(tl.where(bins == chosen, from_top, 0), axis=0) - in_bin
                matched = in_bin
                prefix = prefix | (chosen.to(tl.uint32) << shift)
                prefix_mask = prefix_mask | digit_mask
            digit_mask = digit_mask >> 8
            shift = shift - 8
        return prefix, prefix_mask, remaining

    @triton.jit
    def _gather_candidates(
        row_args, scratch_row, n_candidates, prefix, prefix_mask, remaining,
        BLOCK_V: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ENDS: tl.constexpr,
        PROMPT_MARK: tl.constexpr,
    ):  # fmt: skip
        # writes the candidates as (key << 32 | ~index) into scratch_row[0, n_candidates): the
        # keys above the prefix first, then the lowest-index `remaining` that match it
        vocab = row_args[2]
        lanes = tl.arange(0, BLOCK_V)
        n_above = n_candidates - remaining
        seen_above = 0
        seen_tied = 0
        for start in range(0, vocab, BLOCK_V):
            if (seen_above < n_above) | (seen_tied < remaining):
                offs = start + lanes
                x = _scaled_block(row_args, offs, HAS_COUNTS, HAS_MASK, HAS_ENDS, PROMPT_MARK)
                key = _order_key(x)
                high = key & prefix_mask
                above = (offs < vocab) & (high > prefix)
                tied = (offs < vocab) & (high == prefix)
                above_rank = seen_above + tl.cumsum(above.to(tl.int32), axis=0) - 1
                tied_rank = seen_tied + tl.cumsum(tied.to(tl.int32), axis=0) - 1
                dest = tl.where(above, above_rank, n_above + tied_rank)
                packed = (key.to(tl.uint64) << 32) | (~offs.to(tl.uint32)).to(tl.uint64)
                keep = above | (tied & (tied_rank < remaining))
                tl.store(scratch_row + dest, packed.to(tl.int64, bitcast=True), mask=keep)
                seen_above += tl.sum(above.to(tl.int32), axis=0)
                seen_tied += tl.sum(tied.to(tl.int32), axis=0)

    @triton.jit
    def _candidate_draw(
        row_args, scratch_row, row_max, min_p, top_k, top_p, target, vocab_total,
        N_CANDIDATES: tl.constexpr, CANDIDATE_BLOCK: tl.constexpr,
        BLOCK_V: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ENDS: tl.constexpr,
        PROMPT_MARK: tl.constexpr,
    ):  # fmt: skip
        # sample()'s restricted draw over the K most likely tokens in descending order
        prefix, prefix_mask, remaining = _radix_select(
            row_args, N_CANDIDATES, BLOCK_V, HAS_COUNTS, HAS_MASK, HAS_ENDS, PROMPT_MARK
        )
        _gather_candidates(
            row_args, scratch_row, N_CANDIDATES, prefix, prefix_mask, remaining,
            BLOCK_V, HAS_COUNTS, HAS_MASK, HAS_ENDS, PROMPT_MARK,
        )  # fmt: skip
        # other threads wrote the scratch row: the barrier makes their stores visible
        tl.debug_barrier()
        rank = tl.arange(0, CANDIDATE_BLOCK)
        real = rank < N_CANDIDATES
        packed = tl.load(scratch_row + rank, mask=real, other=0, cache_modifier=".cg")
        packed = tl.sort(packed.to(tl.uint64, bitcast=True), descending=True)
        value = _key_value((packed >> 32).to(tl.uint32))
        index = (~(packed & 0xFFFFFFFF).to(tl.uint32)).to(tl.int32)
        # min_p as the vocabulary's verdict (same value, same expression), then top_k by rank
        rank_limit = tl.where(top_k > 0, top_k, CANDIDATE_BLOCK)
        kept = real & _min_p_keeps(value, row_max, min_p) & (rank < rank_limit)
        value = tl.where(kept, value, float("-inf"))
        if top_k > 0:
            kept_max = tl.max(value, axis=0)
            log_total = kept_max + tl.log(tl.sum(tl.exp(value - kept_max), axis=0))
        else:
            log_total = row_max + tl.log(vocab_total)
        probs = tl.exp(value - log_total)
        before = tl.cumsum(probs, axis=0) - probs
        # top_p >= 1 keeps everything (and the top token is always kept)
        in_top_p = (before < tl.where(top_p >= 1.0, float("inf"), top_p)) | (rank == 0)
        weight = tl.where(in_top_p, probs, 0.0)
        cum = tl.cumsum(weight, axis=0)
        below = real & (cum < target * tl.max(cum, axis=0))
        last_kept = tl.max(tl.where(weight > 0, rank, 0), axis=0)
        pos = tl.minimum(tl.sum(below.to(tl.int32), axis=0), last_kept)
        # the radix counts are exact, so every entry was written; the clamp keeps a token in range anyway
        token = tl.sum(tl.where(rank == pos, index, 0), axis=0)
        return tl.minimum(tl.maximum(token, 0), row_args[2] - 1)

    @triton.jit
    def _sample_row_kernel(
        logits_ptr, out_ptr, n_samples_ptr, greedy_token_ptr, next_token_ptr, sample_slot_ptr,
        scratch_ptr, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, repetition_ptr, frequency_ptr,
        presence_ptr, seed_ptr, counter_ptr, min_tokens_ptr, counts_ptr, count_slot_ptr, grammar_ptr,
        mask_at_ptr, end_ptr, stop_ptr,
        vocab, n_count_rows, n_next, grammar_words, n_end, n_stop, logits_stride, counts_stride,
        temperature_stride, top_p_stride, top_k_stride, min_p_stride, repetition_stride,
        frequency_stride, presence_stride, seed_stride, counter_stride, min_tokens_stride,
        count_slot_stride, greedy_token_stride, sample_slot_stride, mask_at_stride, stop_stride,
        N_CANDIDATES: tl.constexpr, CANDIDATE_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
        PROMPT_MARK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_COUNT_SLOT: tl.constexpr,
        HAS_MASK: tl.constexpr, HAS_ENDS: tl.constexpr, HAS_GREEDY_TOKEN: tl.constexpr,
        HAS_NEXT_TOKEN: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        if USE_PDL:
            # the logits, the parameters and the counts are earlier kernels' writes
            tl.extra.cuda.gdc_wait()
        valid = row < tl.load(n_samples_ptr)
        temperature = tl.load(temperature_ptr + row * temperature_stride).to(tl.float32)
        greedy = (temperature <= 0.0) | (valid == 0)
        logits_row = logits_ptr + row.to(tl.int64) * logits_stride
        count_limit = 0
        repetition = 1.0
        frequency = 0.0
        presence = 0.0
        counts_row = counts_ptr
        if HAS_COUNTS:
            repetition = tl.load(repetition_ptr + row * repetition_stride).to(tl.float32)
            frequency = tl.load(frequency_ptr + row * frequency_stride).to(tl.float32)
            presence = tl.load(presence_ptr + row * presence_stride).to(tl.float32)
            penalized = (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)
            count_limit = tl.where(penalized, vocab, 0)
            if HAS_COUNT_SLOT:
                count_slot = tl.load(count_slot_ptr + row * count_slot_stride).to(tl.int32)
                count_slot = tl.minimum(tl.maximum(count_slot, 0), n_count_rows - 1)
            else:
                count_slot = row
            counts_row = counts_ptr + count_slot.to(tl.int64) * counts_stride
        mask_row = grammar_ptr
        last_word = 0
        mask_limit = 0
        if HAS_MASK:
            mask_at = tl.load(mask_at_ptr + row * mask_at_stride)
            mask_row, last_word = _mask_row(grammar_ptr, mask_at, grammar_words)
            # a stale row's token is never used: it skips its mask (and keeps the fast path)
            mask_limit = tl.where(valid & (mask_at >= 0), vocab, 0)
        n_end_row = 0
        n_stop_row = 0
        if HAS_ENDS:
            # a row below its min_tokens reads its end ids in every pass; the others none (a
            # stale row's token is never used: it skips them too)
            min_tokens = tl.load(min_tokens_ptr + row * min_tokens_stride)
            below = valid & (tl.load(counter_ptr + row * counter_stride) < min_tokens)
            n_end_row = tl.where(below, n_end, 0)
            n_stop_row = tl.where(below, n_stop, 0)
        stop_row = stop_ptr + row.to(tl.int64) * stop_stride
        if HAS_GREEDY_TOKEN:
            use_greedy_token = greedy & (count_limit == 0) & (mask_limit == 0)
            if HAS_ENDS:  # noqa: SIM102 (a constexpr branch: the runtime test below is a tensor)
                # below min_tokens the head's argmax stands unless it is an end id (the mask
                # lowers only those)
                if use_greedy_token & ((n_end_row + n_stop_row) > 0):
                    head = tl.load(greedy_token_ptr + row * greedy_token_stride).to(tl.int32)
                    use_greedy_token = _is_end_id(head, end_ptr, n_end_row, stop_row, n_stop_row) == 0
        else:
            use_greedy_token = row < 0
        if use_greedy_token:
            token = tl.load(greedy_token_ptr + row * greedy_token_stride).to(tl.int32)
        else:
            # greedy rows divide by 1: their argmax is that of the penalized, masked logits
            divisor = tl.where(greedy, 1.0, temperature)
            row_args = (
                logits_row, counts_row, vocab, count_limit, repetition, frequency, presence, divisor,
                mask_row, last_word, mask_limit, end_ptr, n_end_row, stop_row, n_stop_row,
            )  # fmt: skip
            row_max, token = _max_pass(row_args, BLOCK_V, HAS_COUNTS, HAS_MASK, HAS_ENDS, PROMPT_MARK)
            if greedy == 0:
                top_p = tl.load(top_p_ptr + row * top_p_stride).to(tl.float32)
                top_k = tl.load(top_k_ptr + row * top_k_stride).to(tl.int32)
                min_p = tl.load(min_p_ptr + row * min_p_stride).to(tl.float32)
                seed = tl.load(seed_ptr + row * seed_stride).to(tl.int64)
                counter = tl.load(counter_ptr + row * counter_stride).to(tl.int64)
                target = _counter_uniform(seed, counter)
                # with top_k off, top_p measures against the whole min_p-kept mass
                vocab_total = 1.0
                if top_k <= 0:
                    vocab_total = _mass_pass(
                        row_args, row_max, min_p, BLOCK_V, HAS_COUNTS, HAS_MASK, HAS_ENDS, PROMPT_MARK
                    )
                if (top_k <= 0) & (top_p >= 1.0):
                    token = _scan_draw(
                        row_args, row_max, min_p, target, vocab_total, token,
                        BLOCK_V, HAS_COUNTS, HAS_MASK, HAS_ENDS, PROMPT_MARK,
                    )  # fmt: skip
                else:
                    scratch_row = scratch_ptr + row.to(tl.int64) * N_CANDIDATES
                    token = _candidate_draw(
                        row_args, scratch_row, row_max, min_p, top_k, top_p, target, vocab_total,
                        N_CANDIDATES, CANDIDATE_BLOCK, BLOCK_V, HAS_COUNTS, HAS_MASK, HAS_ENDS, PROMPT_MARK,
                    )  # fmt: skip
        if HAS_NEXT_TOKEN:
            next_slot = tl.load(sample_slot_ptr + row * sample_slot_stride).to(tl.int32)
        if USE_PDL:
            # every input of this row is read; the next kernel's gdc_wait still waits for our stores
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(out_ptr + row, token.to(tl.int64))
        if HAS_NEXT_TOKEN:
            next_slot = tl.minimum(tl.maximum(next_slot, 0), n_next - 1)
            tl.store(next_token_ptr + next_slot, token, mask=valid)


# the per-row fields in the kernel's argument order, and those that are integers (the rest: floats)
_KERNEL_FIELDS: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_KERNEL_FIELDS += ("frequency_penalty", "presence_penalty", "seed", "counter", "min_tokens")
_INT_FIELDS = ("top_k", "seed", "counter", "min_tokens")


def candidate_count(vocab: int) -> int:
    """K, the candidates of a restricted draw: min(vocab, MAX_TOP_K), as sample() takes them."""
    return min(vocab, MAX_TOP_K)


def _check_rows(name: str, t: torch.Tensor, m: int, device: torch.device, integer: bool) -> None:
    kind = "an integer" if integer else "a floating"
    if t.shape != (m,):
        raise ValueError(f"sample_rows_triton: {name} must be [{m}] (one per row), got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"sample_rows_triton: {name} is on {t.device}, the logits on {device}")
    if integer == t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"sample_rows_triton: {name} must have {kind} dtype, got {t.dtype}")


def sample_rows_triton(
    logits: torch.Tensor,
    params: SamplingTensors,
    n_samples: torch.Tensor,
    greedy_token: torch.Tensor | None,
    next_token: torch.Tensor | None = None,
    sample_slot: torch.Tensor | None = None,
    use_pdl: bool = False,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """sampling.sample(logits, params, valid=arange(m) < n_samples[0]) as one launch: every row's
    token, int64 [m]. No host sync, static shapes: capturable in a CUDA graph.

    logits: fp32 [m, V] with a unit inner stride, never written. params: rows [m] (strided views
    are fine; any int / float width), its token_counts table [S, V] (dense rows) read through
    params.slot (None: row i's counts are row i), or None (no penalties apply). n_samples: int32
    [1] on the device; rows i >= n_samples[0] are stale: greedy, and they write no next_token.
    params.grammar / params.mask_at: structured output's masks (int32 [G], integers [m]), or
    None; a stale row ignores its mask (its token is never used, so it keeps the fast path).
    params.end_ids / params.stop_ids: min_tokens' end ids (integers [E] and [m, S], -1 for none,
    unit inner stride), or None: a valid row whose counter is below its min_tokens never draws
    them.
    greedy_token: int32 [m], each row's argmax of the raw logits (first index on ties), taken by
    greedy rows with neutral penalties and no constraint without reading their logits; None:
    computed here.
    next_token (int32 [S']) and sample_slot (int [m]): when given, each valid row's token is also
    written to next_token[clamp(sample_slot[i], 0, S' - 1)]. use_pdl: programmatic dependent
    launch (pdl_meta; never under the Triton interpreter). scratch: int64 [m, K] (candidate_count),
    the restricted draws' candidate rows; None: a torch.empty here (fine inside a capture too).
    """
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; use sampling.sample")
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(
            f"sample_rows_triton: logits must be fp32 [m, V] with a unit inner stride, got "
            f"{logits.dtype} {list(logits.shape)} strides {list(logits.stride())}"
        )
    m, vocab = logits.shape
    device = logits.device
    if vocab < 1 or vocab >= 2**31:
        raise ValueError(f"sample_rows_triton: a vocabulary of {vocab} (1 to 2**31 - 1)")
    fields = {name: getattr(params, name) for name in RING_NAMES} | {"counter": params.counter}
    for name in _KERNEL_FIELDS:
        _check_rows(name, fields[name], m, device, name in _INT_FIELDS)
    if n_samples.shape != (1,) or n_samples.dtype != torch.int32 or n_samples.device != device:
        raise ValueError("sample_rows_triton: n_samples must be int32 [1] on the logits' device")
    if greedy_token is not None:
        _check_rows("greedy_token", greedy_token, m, device, integer=True)
    if (next_token is None) != (sample_slot is None):
        raise ValueError("sample_rows_triton: next_token and sample_slot come together")
    if next_token is not None and sample_slot is not None:
        if next_token.dim() != 1 or next_token.dtype != torch.int32 or next_token.device != device:
            raise ValueError("sample_rows_triton: next_token must be int32 [S] on the logits' device")
        if next_token.stride(0) != 1 or next_token.shape[0] < 1:
            raise ValueError("sample_rows_triton: next_token must be dense and not empty")
        _check_rows("sample_slot", sample_slot, m, device, integer=True)
    counts, count_slot = params.token_counts, params.slot
    if counts is not None:
        if counts.dim() != 2 or counts.shape[1] != vocab or counts.stride(1) != 1 or counts.shape[0] < 1:
            raise ValueError(
                f"sample_rows_triton: token_counts must be [S, {vocab}] with a unit inner stride, "
                f"got {list(counts.shape)} strides {list(counts.stride())}"
            )
        if counts.dtype.is_floating_point or counts.device != device:
            raise ValueError("sample_rows_triton: token_counts must be integers on the logits' device")
        if count_slot is not None:
            _check_rows("slot", count_slot, m, device, integer=True)
        elif counts.shape[0] != m:
            raise ValueError("sample_rows_triton: without params.slot, token_counts has a row per row [m, V]")
    grammar, mask_at = check_masks("sample_rows_triton", params, m, device)
    end_ids, stop_ids = check_ends("sample_rows_triton", params, m, device)
    n_candidates = candidate_count(vocab)
    if scratch is None:
        scratch = torch.empty(m, n_candidates, dtype=torch.int64, device=device)
    elif scratch.shape != (m, n_candidates) or scratch.dtype != torch.int64 or not scratch.is_contiguous():
        raise ValueError(f"sample_rows_triton: scratch must be a dense int64 [{m}, {n_candidates}]")
    if use_pdl and os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("sample_rows_triton: the Triton interpreter has no PDL (use_pdl=False)")
    out = torch.empty(m, dtype=torch.int64, device=device)
    if m == 0:
        return out

    def rows(t: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        # an absent optional tensor: any pointer (its constexpr flag keeps it unread), stride 0
        return (out, 0) if t is None else (t, t.stride(0))

    per_row = [rows(fields[name]) for name in _KERNEL_FIELDS]
    slot_rows, greedy_rows, sample_slot_rows = rows(count_slot), rows(greedy_token), rows(sample_slot)
    mask_rows, stop_rows = rows(mask_at), rows(stop_ids)
    launch(
        _sample_row_kernel,
        (m,),
        logits,
        out,
        n_samples,
        greedy_rows[0],
        out if next_token is None else next_token,
        sample_slot_rows[0],
        scratch,
        *(tensor for tensor, _ in per_row),
        logits if counts is None else counts,
        slot_rows[0],
        out if grammar is None else grammar,
        mask_rows[0],
        out if end_ids is None else end_ids,
        stop_rows[0],
        vocab,
        0 if counts is None else counts.shape[0],
        0 if next_token is None else next_token.shape[0],
        1 if grammar is None else grammar.numel(),
        0 if end_ids is None else end_ids.shape[0],
        0 if stop_ids is None else stop_ids.shape[1],
        logits.stride(0),
        0 if counts is None else counts.stride(0),
        *(stride for _, stride in per_row),
        slot_rows[1],
        greedy_rows[1],
        sample_slot_rows[1],
        mask_rows[1],
        stop_rows[1],
        N_CANDIDATES=n_candidates,
        CANDIDATE_BLOCK=triton.next_power_of_2(n_candidates),
        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)),
        PROMPT_MARK=PROMPT_MARK,
        HAS_COUNTS=counts is not None,
        HAS_COUNT_SLOT=count_slot is not None,
        HAS_MASK=mask_at is not None,
        HAS_ENDS=end_ids is not None or stop_ids is not None,
        HAS_GREEDY_TOKEN=greedy_token is not None,
        HAS_NEXT_TOKEN=next_token is not None,
        num_warps=NUM_WARPS,
        # ptxas's own cap on sm_80 (80 registers at 8 warps) spilled; 128 fits (bench/lab/triton_aot.py)
        maxnreg=128,
        enable_fp_fusion=False,
        **pdl_meta(use_pdl),
    )
    return out
