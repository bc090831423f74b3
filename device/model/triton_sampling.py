"""The sampler's counter-based uniform (sampling.counter_uniform) and its penalties
(sampling.apply_penalties) as one Triton launch each.

In torch the hash is about ninety tiny integer kernels (four 32-bit finalisers, each split into
16-bit halves so no int64 product overflows), which inside a captured decode step cost more
graph nodes than all the rest of the sampler. Here one program per block of rows computes it
with native uint32 arithmetic (wrapping multiplies), bit for bit the same value as the torch
function, so a seeded request draws the same tokens on the CPU backend and in the CUDA graph.

The penalties in torch are a dozen passes over [rows, vocab] plus a gather of each row's token
counts, every step of the graph whether any request has a penalty or not. Here one program per
(row, vocabulary block) reads the row's three penalties first and touches neither the logits
nor the counts unless one is on; it penalizes the logits in place, reading the count table
through each row's slot. The arithmetic is apply_penalties' in its order, with IEEE division and
no fused multiply-add, so both forms give the same bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ringleader.device.model.triton_launch import launch
from ringleader.ipc.layout import PROMPT_MARK

if TYPE_CHECKING:
    from ringleader.device.model.sampling import SamplingTensors

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
    def _penalties_kernel(
        logits_ptr,
        counts_ptr,
        slot_ptr,
        repetition_ptr,
        frequency_ptr,
        presence_ptr,
        vocab,
        n_slots,
        logits_stride,
        param_stride,
        PROMPT_MARK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        r = tl.load(repetition_ptr + row * param_stride)
        f = tl.load(frequency_ptr + row * param_stride)
        p = tl.load(presence_ptr + row * param_stride)
        # a row without a penalty reads and writes nothing (no token is below a limit of 0)
        limit = tl.where((r != 1.0) | (f != 0.0) | (p != 0.0), vocab, 0)
        ok = offs < limit
        slot = tl.minimum(tl.maximum(tl.load(slot_ptr + row), 0), n_slots - 1).to(tl.int64)
        x = tl.load(logits_ptr + row * logits_stride + offs, mask=ok, other=0.0)
        c = tl.load(counts_ptr + slot * vocab + offs, mask=ok, other=0)
        count = (c & (PROMPT_MARK - 1)).to(tl.float32)
        repeated = tl.where(x > 0, tl.math.div_rn(x, r), x * r)
        x = tl.where(c != 0, repeated, x)
        x = x - f * count - p * (count > 0).to(tl.float32)
        tl.store(logits_ptr + row * logits_stride + offs, x, mask=ok)


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


PENALTY_BLOCK = 1024


def apply_penalties_triton(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """sampling.apply_penalties(logits, params) for fp32 logits [N, V] with a unit inner stride,
    in place, one launch; `params` carries the count table [S, V] and each row's slot (a missing
    slot: row i's counts are row i). Returns `logits`."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; use sampling.apply_penalties")
    counts = params.token_counts
    if counts is None:
        return logits
    n, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1 or counts.stride() != (vocab, 1):
        raise ValueError("apply_penalties_triton: fp32 logits with unit inner stride, dense counts")
    slot = (
        params.slot if params.slot is not None else torch.arange(n, dtype=torch.int32, device=logits.device)
    )
    penalties = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    if any(t.dtype != torch.float32 or t.stride(0) != penalties[0].stride(0) for t in penalties):
        raise ValueError("apply_penalties_triton: the three penalties as fp32 views of one stride")
    grid = (n, triton.cdiv(vocab, PENALTY_BLOCK))
    launch(
        _penalties_kernel,
        grid,
        logits,
        counts,
        slot,
        *penalties,
        vocab,
        counts.shape[0],
        logits.stride(0),
        penalties[0].stride(0),
        PROMPT_MARK=PROMPT_MARK,
        BLOCK=PENALTY_BLOCK,
        enable_fp_fusion=False,
    )
    return logits
