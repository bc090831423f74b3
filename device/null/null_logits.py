"""The null model's logits, which its logprobs report: NULL_LOGIT at the pattern's token and 0 at
every other id (device/null/null_model.py); a module of its own because the model and both forms
of its step read it."""

from __future__ import annotations

import math

NULL_LOGIT = 20.0  # the pattern token's logit; every other id's is 0


def record_logprobs(vocab_size: int) -> tuple[float, float]:
    """(the pattern token's logprob, every other id's) under the null model's logits."""
    token = -math.log1p((vocab_size - 1) * math.exp(-NULL_LOGIT))
    return token, token - NULL_LOGIT
