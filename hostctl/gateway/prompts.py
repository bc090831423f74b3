"""What a request asks of its prompt, without I/O: the prompts of /v1/completions (one, or a batch),
and whether the prompt is echoed or scored.

`prompt` is a string, an array of token ids (one prompt, as before), or an array of those (a
batch, as OpenAI's legacy API and vLLM take it: each prompt is a request of its own, batched.py).

Scoring, as evaluation harnesses ask it (lm-eval's loglikelihood: `echo: true, logprobs: k,
max_tokens: 0 or 1`): `echo` puts the prompt before the completion, and with `logprobs` its
tokens' logprobs before the completion's (the server's prompt_logprobs, asked with the
completion's `logprobs` count unless the request gives its own, as vLLM does); vLLM's
`prompt_logprobs` is answered in vLLM's shape beside the choices (echo.py).  `max_tokens: 0`
generates nothing, and so goes with one of them; prompt logprobs come with a request's first
message, so a stream takes them only through echo, as vLLM refuses them with `stream`."""

from __future__ import annotations

import dataclasses
from typing import Any

from ringleader.hostctl.gateway.errors import APIError, bad
from ringleader.ipc.sampling_params import FIELD, SamplingParams, clipped_repr

MAX_PROMPTS = 1024  # prompts in one batch: each is a request in flight on the server
Prompt = tuple[str | None, list[int] | None]  # (text, token ids): one of them


def _token_ids(value: Any) -> list[int] | None:
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return value
    return None


def _one(value: Any) -> Prompt | None:
    if isinstance(value, str) and value:
        return value, None
    ids = _token_ids(value)
    return None if ids is None else (None, ids)


def completion_prompts(body: dict) -> list[Prompt]:
    """The prompts of a /v1/completions body, in order (one unless it sent a batch); a 400 naming
    `prompt` and, in a batch, which one (`prompt[2]: ...`)."""
    if body.get("prompt") is None:
        raise bad("prompt", "is required")
    p = body["prompt"]
    one = _one(p)
    if one is not None:
        return [one]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > MAX_PROMPTS:
            raise bad("prompt", f"a batch holds at most {MAX_PROMPTS} prompts, got {len(p)}")
        prompts = [_one(x) for x in p]
        for i, (x, got) in enumerate(zip(p, prompts)):
            if got is None:
                shown = clipped_repr(x)
                raise APIError(
                    400,
                    f"prompt[{i}]: must be a non-empty string or array of token ids, got {shown}",
                    param="prompt",
                )
        return [x for x in prompts if x is not None]
    if p == "":
        raise bad("prompt", "must not be empty")
    raise bad(
        "prompt",
        f"must be a string, an array of token ids, or a batch (an array of either), got {clipped_repr(p)}",
    )


def _named(body: dict, name: str) -> str:
    """The body's name of a sampling field (the first of its OpenAI names the body gives)."""
    names = FIELD[name].openai_names
    return next((n for n in names if body.get(n) is not None), names[-1])


def scoring_options(
    body: dict, sampling: SamplingParams, *, chat: bool, stream: bool
) -> tuple[SamplingParams, bool, bool]:
    """(the sampling settings the server gets, echo, whether vLLM's prompt_logprobs are answered):
    echo with logprobs asks the server for the prompt's logprobs; a 400 naming the field for
    echo that is not a bool, prompt_logprobs with stream, and max_tokens 0 with neither."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad("echo", f"must be true or false, got {clipped_repr(echo)}")
    echo = bool(echo) and not chat  # chat has no echo: refused as unknown before this
    asked = sampling.prompt_logprobs is not None
    if asked and stream:
        raise bad(
            _named(body, "prompt_logprobs"),
            "is not available with stream: true (as vLLM); send echo with logprobs to stream the "
            "prompt's logprobs first, or ask without stream",
        )
    if echo and sampling.logprobs is not None and not asked:
        sampling = dataclasses.replace(sampling, prompt_logprobs=sampling.logprobs)
    if sampling.max_tokens == 0 and not (echo or asked):
        raise bad(
            _named(body, "max_tokens"),
            "0 generates nothing: it goes with echo (the prompt scored, with logprobs) or prompt_logprobs",
        )
    return sampling, echo, asked
