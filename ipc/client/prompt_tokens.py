"""What a token message says of tokens besides its ids: a logprobs entry (a generated token's,
1.5, or a prompt token's) and the prompt as the server tokenized it (1.10: the first message of a
request that asked for prompt_logprobs, a token message of no ids, carries it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringleader.ipc.batch_frames import PROMPT_COLUMNS
from ringleader.ipc.prompt_message import prompt_logprob_entries

# the keys of the prompt (docs/protocol.md, revision 1.10) on a token map, a batch's columns too
PROMPT_IDS_KEY, PROMPT_LOGPROBS_KEY, PROMPT_TOKENS_KEY, PROMPT_TEXT_KEY = PROMPT_COLUMNS


@dataclass(slots=True)
class TokenLogprob:
    """One token's logprobs (a request with `logprobs`): its log-probability and the most likely
    alternatives, in descending order, with their texts where the server has a tokenizer (None
    otherwise)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    token: str | None = None
    top_tokens: list[str] | None = None


@dataclass(slots=True)
class PromptTokens:
    """The prompt as the server tokenized it, from a request's first message (1.10, a request
    with prompt_logprobs): its ids, each one's logprobs given the tokens before it (None for the
    first, which has none), and with a tokenizer each token's text alone and the prompt decoded."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None
    tokens: list[str] | None = None
    text: str | None = None


def logprob_entry(entry: Any) -> TokenLogprob:
    """One logprobs entry of a message; TypeError (or KeyError) when it is not one."""
    ids, values = entry["top_ids"], entry["top_logprobs"]
    token, tokens = entry.get("token"), entry.get("top_tokens")
    if (
        not isinstance(ids, list)
        or not isinstance(values, list)
        or len(ids) != len(values)
        or (token is not None and not isinstance(token, str))
        or (tokens is not None and (not isinstance(tokens, list) or len(tokens) != len(ids)))
    ):
        raise TypeError("malformed logprobs entry")
    return TokenLogprob(float(entry["logprob"]), ids, [float(v) for v in values], token, tokens)


def prompt_tokens_of(obj: dict) -> PromptTokens | None:
    """The prompt a token map carries (None when it carries none); TypeError when its lists do
    not fit together.  Its logprobs come as columns (prompt_message.prompt_logprob_entries reads them)."""
    ids = obj.get(PROMPT_IDS_KEY)
    if ids is None:
        return None
    tokens, text = obj.get(PROMPT_TOKENS_KEY), obj.get(PROMPT_TEXT_KEY)
    if (
        not isinstance(ids, list)
        or (tokens is not None and (not isinstance(tokens, list) or len(tokens) != len(ids)))
        or (text is not None and not isinstance(text, str))
    ):
        raise TypeError("malformed prompt tokens")
    entries = None
    if obj.get(PROMPT_LOGPROBS_KEY) is not None:
        try:
            raw = prompt_logprob_entries(obj)
        except (AttributeError, IndexError, KeyError, ValueError) as exc:
            raise TypeError(f"malformed prompt logprobs: {exc!r}") from None
        if len(raw) != len(ids) or raw[0] is not None:
            raise TypeError("malformed prompt logprobs: not one entry per prompt token")
        entries = [None if e is None else logprob_entry(e) for e in raw]
    return PromptTokens(ids, entries, tokens, text)
