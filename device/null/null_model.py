"""The null model (`--model null`): no weights and no arithmetic, so what a run measures is the
runtime itself: the wire, the rings, the scheduler, the completion path and, on CUDA, the gap
between steps.

Each sampled row's next token is a lookup of the row's input token in the pattern's table, one
gather per step (device/null/null_step.py); the step can also hold its device busy for a fixed,
stated time (`step_us`), to stand in for a model of that cost. Its tokens are deterministic:
sampling settings (temperature, seed, penalties) do not change them. Its "logits", which its
logprobs report, are NULL_LOGIT at the pattern's token and 0 at every other id.

Patterns (the output a prompt ending in token t gets):
- next:   t+1, t+2, ... (mod the vocabulary), skipping the end-of-sequence ids, so a request runs
          to max_tokens and a client can check each token against the one before;
- repeat: t, t, t, ... (an end-of-sequence t: the next id that is not one);
- eos:    the end-of-sequence id at once: every request ends after one token with `stop` (unless
          ignore_eos), to measure admission and teardown.
The tokenizer is the byte-level one of the presets: ids below 256 are bytes, so text prompts
work and the ids above 263 decode to nothing.
"""

from __future__ import annotations

import torch

from ringleader.device.model.config import ModelConfig
from ringleader.device.null.null_logits import NULL_LOGIT as NULL_LOGIT  # the model's logits, re-exported
from ringleader.device.null.null_logits import record_logprobs as record_logprobs
from ringleader.device.null.null_options import NULL_MAX_CONTEXT, NULL_MODEL, NullOptions
from ringleader.device.text.tokenizer import ByteTokenizer


def null_config(options: NullOptions) -> ModelConfig:
    """A ModelConfig with no layers (so no KV bytes per token) and the byte tokenizer's ids."""
    return ModelConfig(
        vocab_size=options.vocab_size,
        hidden_size=0,
        intermediate_size=0,
        num_layers=0,
        num_heads=1,
        num_kv_heads=1,
        head_dim=2,
        max_position_embeddings=NULL_MAX_CONTEXT,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=[ByteTokenizer.EOS],
        name=NULL_MODEL,
    )


def pattern_table(pattern: str, vocab_size: int, eos_ids: list[int]) -> torch.Tensor:
    """int32 [vocab_size]: the token that follows input token t under `pattern`."""
    ids = torch.arange(vocab_size, dtype=torch.int64)
    if pattern == "eos":
        return torch.full((vocab_size,), eos_ids[0], dtype=torch.int32)
    out = (ids + 1) % vocab_size if pattern == "next" else ids.clone()
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.int64)
    for _ in range(len(eos)):  # each pass moves an id off one end-of-sequence id
        out = torch.where(torch.isin(out, eos), (out + 1) % vocab_size, out)
    return out.to(torch.int32)


class NullModel:
    """What the backends read of a model, for `--model null`: its config, its pattern's table on
    `device`, and that it keeps no weights."""

    def __init__(self, options: NullOptions, device: str | torch.device = "cpu") -> None:
        self.options = options
        self.config = null_config(options)
        self.device = torch.device(device)
        self.dtype = torch.float32
        self.table = pattern_table(options.pattern, options.vocab_size, self.config.eos_token_ids).to(device)

    def prepare(self, max_ctx: int) -> None:
        """Nothing to precompute (LlamaModel's RoPE tables)."""

    def weights_description(self) -> dict:
        return {"weight_mib": 0.0, "matrices": {}}

    # ---- what a backend builds around the model (LlamaModel answers the same calls) ----------

    def eager_step(self, n_slots: int, n_pages: int, page_size: int, kv_dtype: torch.dtype):
        """The gather step: no KV cache (the pages are ids only); n_slots: its sample places
        (RingConfig.sample_len)."""
        from ringleader.device.null.null_step import NullStep  # the step reads this module's types

        return NullStep(self, n_slots)

    def static_step(
        self,
        n_slots: int,
        n_pages: int,
        page_size: int,
        max_ctx: int,
        token_budget: int,
        attention: str,
        step_kernels: str = "fused",
        score_rows: int = 0,
        spec_tokens: int = 0,
    ):
        """The same step on CUDA: one Triton launch, so a one-node graph per bucket (no prompt
        logprobs: score_rows is 0 there); its sample places are n_slots * (1 + spec_tokens)."""
        return self.eager_step(n_slots * (1 + spec_tokens), n_pages, page_size, self.dtype)

    def description_fields(self, weights: str) -> dict:
        """A backend description's weights fields: none, whatever --weights says, and the options."""
        return {"weights": "none", **self.weights_description(), **self.describe()}

    def describe(self) -> dict:
        """The backend description's null-model fields (serve's start-up line, stats)."""
        o = self.options
        return {
            "null_vocab": o.vocab_size,
            "null_step_us": o.step_us,
            "null_pattern": o.pattern,
            "null_step_wait": o.step_wait,
        }
