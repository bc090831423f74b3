"""Batched token sampling with a counter-based RNG.

Each row draws from a uniform that is a hash of (seed, counter), counter being the index of
the token within its request. So a seeded request samples the same tokens whatever else is in
the batch, and no torch RNG state is touched. Everything is static-shape tensor math (no
.item(), no boolean indexing, no host syncs), so it can run inside a CUDA graph.

Draw method: inverse CDF over the probabilities sorted in descending order (stable sort). The
sort is needed for top-k/top-p anyway, and this needs one hash per row instead of one per
vocab entry (as Gumbel-max would).
"""

from __future__ import annotations

import torch

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


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
) -> torch.Tensor:
    """Sampled token ids [N] (int64) from fp32 logits [N, V].

    Per row: temperature <= 0 -> argmax. Otherwise logits / temperature, keep the top_k
    largest (0 = no limit), then the smallest prefix whose probability reaches top_p
    (>= 1.0 = no limit; the top token is always kept), renormalise and draw with the uniform
    counter_uniform(seed, counter).
    """
    N, V = logits.shape
    logits = logits.float()
    temperature = temperature.to(logits.device, torch.float32)
    top_p = top_p.to(logits.device, torch.float32)
    top_k = top_k.to(logits.device, torch.int64)
    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / safe_t[:, None]

    sorted_vals, sorted_idx = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    in_top_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    sorted_vals = sorted_vals.masked_fill(~in_top_k, float("-inf"))
    probs = torch.softmax(sorted_vals, dim=-1)
    cum = probs.cumsum(dim=-1)
    # keep an entry if the mass strictly before it is still below top_p
    in_top_p = ((cum - probs) < top_p[:, None]) | (top_p[:, None] >= 1.0) | (rank == 0)
    probs = probs * (in_top_k & in_top_p)

    cum = probs.cumsum(dim=-1)
    target = counter_uniform(seed.to(logits.device), counter.to(logits.device)) * cum[:, -1]
    # first sorted position whose cumulative mass reaches the target
    pos = (cum < target[:, None]).sum(dim=-1).clamp_(max=V - 1)
    drawn = sorted_idx.gather(1, pos[:, None]).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)
