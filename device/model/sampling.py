"""Batched token sampling with a counter-based RNG.

Each row draws from a uniform that is a hash of (seed, counter), counter being the index of
the token within its request. So a seeded request samples the same tokens whatever else is in
the batch, and no torch RNG state is touched. Everything is static-shape tensor math (no
.item(), no boolean indexing, no host syncs), so it can run inside a CUDA graph.

Draw method: inverse CDF with one hash per row (Gumbel-max would need one per vocab entry).
Nothing sorts the vocabulary. Rows that restrict the draw (top_k > 0 or top_p < 1) draw from the
K = min(vocab, MAX_TOP_K) most likely tokens (`torch.topk`, in descending order): exact
whenever the kept set lies among them, which top_k <= MAX_TOP_K (the protocol's bound) always
does, and top_p does whenever those K tokens hold at least top_p of the mass; otherwise (a very
flat distribution) the nucleus is cut at those K, and a top_k above MAX_TOP_K acts as
MAX_TOP_K. Rows that restrict nothing draw from the whole vocabulary in vocabulary order:
exact, no candidates involved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringleader.ipc.sampling_params import MAX_TOP_K

_MASK32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 `a` in [0, 2**32) and a 32-bit constant `c`.

    Split into 16-bit halves so no int64 product overflows (signed overflow is not
    something to rely on): a*c = a_lo*c + (a_hi*c_lo mod 2**16) * 2**16   (mod 2**32).
    """
    lo = (a & 0xFFFF) * c
    hi = (((a >> 16) * (c & 0xFFFF)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply, "lowbias32" constants); a bijection with
    good avalanche. x must hold values in [0, 2**32), so >> is a logical shift."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Uniform fp32 in the open interval (0, 1), a pure function of (seed, counter) (int64)."""
    seed = seed.long()
    counter = counter.long()
    # & keeps the two's-complement low 32 bits also for negative seeds
    x = _mix32((seed & _MASK32) ^ 0x9E3779B9)
    x = _mix32(x ^ ((seed >> 32) & _MASK32))
    x = _mix32(x ^ (counter & _MASK32))
    x = _mix32(x ^ ((counter >> 32) & _MASK32) ^ 0x85EBCA6B)
    # 23 bits -> (k + 0.5) / 2**23: exactly representable in fp32, never 0 or 1
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingTensors:
    """Per-row sampling settings [N] of one sample() call: each row's SamplingParams as tensors,
    plus its RNG counter. Any device and integer/float width; sample() converts."""

    temperature: torch.Tensor  # <= 0: greedy
    top_k: torch.Tensor  # 0: no limit
    top_p: torch.Tensor  # >= 1.0: no limit
    seed: torch.Tensor  # int64 (a uint64 seed's bits)
    counter: torch.Tensor  # the index of the token within its request


def sample(
    logits: torch.Tensor,
    params: SamplingTensors,
    uniform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = counter_uniform,
) -> torch.Tensor:
    """Sampled token ids [N] (int64) from fp32 logits [N, V], row i under params' row i.

    Per row: temperature <= 0 -> argmax. Otherwise logits / temperature, keep the top_k
    largest (0 = no limit), then the smallest prefix whose probability reaches top_p
    (>= 1.0 = no limit; the top token is always kept), renormalise and draw with the uniform
    counter_uniform(seed, counter) (`uniform`: the same function, e.g. its one-launch Triton
    form). See the module docstring for the candidate bound.
    """
    N, V = logits.shape
    dev = logits.device
    logits = logits.float()
    temperature = params.temperature.to(dev, torch.float32)
    top_p = params.top_p.to(dev, torch.float32)[:, None]
    top_k = params.top_k.to(dev, torch.int64)[:, None]
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    target = uniform(params.seed.to(dev), params.counter.to(dev))[:, None]  # in (0, 1)

    # the whole distribution, unnormalised, in vocabulary order: the unrestricted rows' draw,
    # and its total is the mass top_p measures against when top_k is off
    row_max = scaled.amax(-1, keepdim=True)
    cum_all = torch.exp(scaled - row_max).cumsum(dim=-1)
    from_vocab = (cum_all < target * cum_all[:, -1:]).sum(dim=-1).clamp_(max=V - 1)

    # the K most likely tokens, in descending order: the support of every restricted draw
    K = min(V, MAX_TOP_K)
    cand_vals, cand_idx = torch.topk(scaled, K, dim=-1)
    rank = torch.arange(K, device=dev)[None, :]
    in_top_k = (top_k <= 0) | (rank < top_k)
    cand_vals = cand_vals.masked_fill(~in_top_k, float("-inf"))
    # top_p measures mass over the top-k set, or over the whole vocabulary when top_k is off
    log_total = torch.where(top_k > 0, cand_vals.logsumexp(-1, keepdim=True), row_max + cum_all[:, -1:].log())
    probs = torch.exp(cand_vals - log_total)
    cum = probs.cumsum(dim=-1)
    # keep an entry if the mass strictly before it is still below top_p
    in_top_p = ((cum - probs) < top_p) | (top_p >= 1.0) | (rank == 0)
    cum = (probs * in_top_p).cumsum(dim=-1)
    pos = (cum < target * cum[:, -1:]).sum(dim=-1, keepdim=True).clamp_(max=K - 1)
    from_candidates = cand_idx.gather(1, pos).squeeze(1)

    unrestricted = ((top_k <= 0) & (top_p >= 1.0)).squeeze(1)
    drawn = torch.where(unrestricted, from_vocab, from_candidates)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)
