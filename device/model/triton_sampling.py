"""The sampler's counter-based uniform (sampling.counter_uniform) as one Triton launch.

In torch the hash is about ninety tiny integer kernels (four 32-bit finalisers, each split into
16-bit halves so no int64 product overflows), which inside a captured decode step cost more
graph nodes than all the rest of the sampler. Here one program per block of rows computes it
with native uint32 arithmetic (wrapping multiplies), bit for bit the same value as the torch
function, so a seeded request draws the same tokens on the CPU backend and in the CUDA graph.
"""

from __future__ import annotations

import torch

from ringleader.device.model.triton_launch import launch

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
