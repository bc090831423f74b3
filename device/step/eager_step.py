"""The model step in eager form: the CPU backend's step, and the reference for StaticStep.

`EagerStep.run(bucket, layout)` has `StaticStep.run`'s contract on the same `StepLayout`, the way
the CPU build of the scheduler shares the kernel's source: one step, one layout, one sampler.
What differs is what it may read on the host. It reads the layout's counts and segments (on the
CPU zero-copy views of the scheduler's arrays), so shapes follow the step's content: exactly
n_tokens rows with `EagerAttention` as the KV-cache side (through the layout's block table),
exactly n_samples sample entries, no pad rows and no scratch page. Not capturable; `StaticStep`
is the form for CUDA graphs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ringleader.device.sampling.sampler import any_penalty, mask_disallowed, sample, store_logprobs
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.step_batch import StepBatch
from ringleader.device.step.step_layout import StepLayout

if TYPE_CHECKING:  # a type only: the model builds its steps (LlamaModel.eager_step, static_step)
    from ringleader.device.model.llama import LlamaModel


class EagerStep:
    """The unified ragged step over `model` and its paged KV cache `kv` (the pages the layout's
    block table names; no scratch page)."""

    def __init__(self, model: LlamaModel, kv: KVCache) -> None:
        self.model, self.kv = model, kv

    @torch.inference_mode()
    def run(self, bucket: int, layout: StepLayout) -> torch.Tensor:
        """Runs rows [0, n_tokens) of `layout` (rows [n_tokens, bucket) are pad rows: skipped),
        writes next_token[sample_slot[i]] for its n_samples sample entries (and step_logprobs for
        those that asked); returns their fp32 logits [n_samples, vocab]. On the CPU the backend
        passes bucket = n_tokens."""
        n_tokens, n_segments, n_samples = layout.read_counts()
        if not 0 < n_tokens <= bucket:
            raise ValueError(f"the layout's {n_tokens} rows do not fit bucket {bucket}")
        batch = StepBatch.from_layout(layout, n_tokens, n_segments, n_samples)
        logits = self.model.step(batch, self.kv)
        if n_samples:
            params = layout.sampling(n_samples, counts=False)
            # host reads of host memory here: mask and gather counts only where some row needs it
            constrained = params.any_constrained()
            if not constrained:
                params = params.unconstrained()
            if any_penalty(params):
                full = layout.sampling(n_samples)
                tokens = sample(logits, full if constrained else full.unconstrained())
            elif bool((params.temperature <= 0).all()):
                # all greedy, nothing penalized: the argmax sample() would take, without its draw
                allowed = mask_disallowed(logits, params.grammar, params.mask_at) if constrained else logits
                tokens = allowed.argmax(dim=-1)
            else:
                tokens = sample(logits, params)
            slots = layout.sample_slot[:n_samples].long()
            layout.next_token.index_copy_(0, slots, tokens.to(torch.int32))
            if bool((params.logprobs >= 0).any()):  # a host read of host memory, as above
                store_logprobs(layout.step_logprobs, slots, logits, tokens, params.logprobs)
        return logits
