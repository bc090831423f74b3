"""Random weights that are the same bits on every device, for the presets (`tiny`, `llama-1b`, ...).

A device generator cannot give that: CUDA's Philox stream and the CPU's Mersenne Twister draw
different numbers from one seed, so `tiny` seeded 0 was one model on the CPU and another on a GPU
(seen on the H200, 2026-11-28: the CPU backend and transformers-on-CUDA disagreed at the first
token). Here each element is a counter hash in integer arithmetic, exact on every device, turned
into a uniform float32 by an exact conversion and one rounded multiply; the uniform's bounds are
±√3·std, so the std is what the caller asked for.

Not the sampler's `counter_uniform` (device/sampling/sampler.py), which is as device-exact: its four
finalisers with 16-bit split products cost x2.2 this hash's time per element on the CPU, which a
1.2B-parameter preset pays at every start; this one keeps its products under 2^63 by its choice of
multipliers instead.
"""

from __future__ import annotations

import math

import torch

_M32 = 0xFFFFFFFF
# elements hashed at once: cache-sized on the CPU, large on a GPU (fewer launches), bounding the
# int64 temporaries either way
_CHUNK = {"cpu": 1 << 15}
_CHUNK_ELSEWHERE = 1 << 24
# Multipliers below 2^31: a 32-bit value times one stays under 2^63, so no int64 product wraps.
_MUL_1, _MUL_2 = 0x7FEB352D, 0x31848BAB


def _mix(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer hash (xor-shift-multiply) of values in [0, 2^32), as int64."""
    x = x ^ (x >> 16)
    x = (x * _MUL_1) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL_2) & _M32
    return x ^ (x >> 16)


def fill_uniform_(param: torch.Tensor, std: float, seed: int, offset: int) -> int:
    """Fills `param` with a uniform of standard deviation `std` drawn from the counters
    offset .. offset + numel under `seed`; returns the next free counter."""
    key = _mix(seed & _M32)
    scale = torch.tensor(std * math.sqrt(3.0) / (1 << 23), dtype=torch.float32, device=param.device)
    flat = param.view(-1)
    chunk = _CHUNK.get(param.device.type, _CHUNK_ELSEWHERE)
    for start in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - start)
        counter = torch.arange(offset + start, offset + start + n, dtype=torch.int64, device=param.device)
        bits = _mix(_mix((counter & _M32) ^ key) ^ (counter >> 32))
        centred = (bits >> 8) - (1 << 23)  # 24 bits, in [-2^23, 2^23): exact in float32
        flat[start : start + n].copy_(centred.to(torch.float32) * scale)
    return offset + flat.numel()
