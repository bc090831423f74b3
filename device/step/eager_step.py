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

from ringleader.device.sampling.sampler import any_penalty, apply_masks, sample, store_logprobs
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.step_batch import StepBatch
from ringleader.device.step.step_layout import StepLayout, end_ids_for, store_prompt_logprobs

if TYPE_CHECKING:  # a type only: the model builds its steps (LlamaModel.eager_step, static_step)
    from ringleader.device.model.llama import LlamaModel


class EagerStep:
    """The unified ragged step over `model` and its paged KV cache `kv` (the pages the layout's
    block table names; no scratch page)."""

    def __init__(self, model: LlamaModel, kv: KVCache) -> None:
        self.model, self.kv = model, kv
        self._end_ids = end_ids_for(model.config.eos_token_ids, "cpu")  # min_tokens' (host reads)

    @torch.inference_mode()
    def run(self, bucket: int, layout: StepLayout) -> torch.Tensor:
        """Runs rows [0, n_tokens) of `layout` (rows [n_tokens, bucket) are pad rows: skipped),
        writes next_token[sample_slot[i]] for its n_samples sample entries (and step_logprobs for
        those that asked) and step_prompt_logprobs for its n_score score entries; returns the
        sample entries' fp32 logits [n_samples, vocab]. On the CPU the backend passes bucket =
        n_tokens."""
        n_tokens, n_segments, n_samples = layout.read_counts()
        if not 0 < n_tokens <= bucket:
            raise ValueError(f"the layout's {n_tokens} rows do not fit bucket {bucket}")
        n_score = int(layout.n_score.item())  # prompt logprobs' rows (host memory here)
        batch = StepBatch.from_layout(layout, n_tokens, n_segments, n_samples, n_score)
        out = self.model.step(batch, self.kv)
        logits = out[:n_samples]
        if n_score:
            store_prompt_logprobs(layout, out[n_samples:], n_score)
        if n_samples:
            params = layout.sampling(n_samples, counts=False, end_ids=self._end_ids)
            # host reads of host memory here: mask and gather counts only where some row needs it
            if not params.any_constrained():
                params = params.unconstrained()
            if not params.any_below_min_tokens():
                params = params.without_min_tokens()
            if any_penalty(params):
                full = layout.sampling(n_samples)
                masks = ("grammar", "mask_at", "end_ids", "stop_ids")
                tokens = sample(logits, full.replace(**{name: getattr(params, name) for name in masks}))
            elif bool((params.temperature <= 0).all()):
                # all greedy, nothing penalized: the argmax sample() would take, without its draw
                tokens = apply_masks(logits, params).argmax(dim=-1)
            else:
                tokens = sample(logits, params)
            slots = layout.sample_slot[:n_samples].long()
            layout.next_token.index_copy_(0, slots, tokens.to(torch.int32))
            if bool((params.logprobs >= 0).any()):  # a host read of host memory, as above
                store_logprobs(layout.step_logprobs, slots, logits, tokens, params.logprobs)
        return logits
