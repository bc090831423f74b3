"""The prompt in an answer, without I/O: `echo` (the choice's text starts with the prompt's, and
with logprobs OpenAI's legacy logprobs list the prompt's tokens first) and vLLM's
`prompt_logprobs` (beside each choice of a completion, at the top of a chat answer).

The server sends the prompt as it tokenized it with the request's first message (protocol 1.10,
a request with prompt_logprobs: ipc.client.PromptTokens); the prompt's text is the request's own
string, or for token ids the server's decoding of them.

OpenAI's legacy shape has no logprob for the first prompt token (nothing comes before it): its
`token_logprobs` and `top_logprobs` entries are null, as OpenAI's and vLLM's are.  vLLM's
`prompt_logprobs` is `[null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]`:
at each position the prompt's own token and the most likely alternatives, with their 1-based
rank among the alternatives; the prompt's token is ranked where it is one of them, and its
rank is null otherwise (vLLM counts its place in the whole vocabulary, which the server does
not send)."""

from __future__ import annotations

from typing import Any

from ringleader.hostctl.gateway.errors import APIError
from ringleader.hostctl.gateway.responses import completion_logprobs, floored, token_text
from ringleader.ipc.client import PromptTokens

VLLM_KEY = "prompt_logprobs"  # vLLM's response field


class PromptEcho:
    """A request's prompt as its answer shows it: `text` (what echo puts first) and, once the
    server sent it, `tokens` (its ids, logprobs and token texts)."""

    def __init__(self, text: str, tokens: PromptTokens | None):
        self.text = text
        self.tokens = tokens

    def legacy_logprobs(self) -> dict[str, list[Any]]:
        """The prompt's tokens in completions' legacy logprobs, offsets from the text's start:
        the first token's logprob and alternatives null."""
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        prompt = self.tokens
        if prompt is None or not prompt.token_ids or prompt.logprobs is None:
            return out
        names = self._names()
        out["tokens"].append(names[0])
        out["token_logprobs"].append(None)
        out["top_logprobs"].append(None)
        out["text_offset"].append(0)
        entries = [e for e in prompt.logprobs[1:] if e is not None]
        if len(entries) != len(prompt.token_ids) - 1:
            return out  # a malformed list (a gap past the first): only the first is shown
        rest = completion_logprobs(prompt.token_ids[1:], entries, len(names[0]), names[1:])
        for name, values in rest.items():
            out[name].extend(values)
        return out

    def vllm_prompt_logprobs(self) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's prompt_logprobs (see the module docstring); [] when the server sent none."""
        prompt = self.tokens
        if prompt is None or prompt.logprobs is None:
            return []
        names = self._names()
        out: list[dict[str, dict[str, Any]] | None] = []
        for token_id, name, entry in zip(prompt.token_ids, names, prompt.logprobs):
            if entry is None:
                out.append(None)
                continue
            tops = entry.top_tokens or [token_text(None, i) for i in entry.top_ids]
            ranks = {i: r for r, i in enumerate(entry.top_ids, 1)}
            at = {
                str(token_id): {
                    "logprob": floored(entry.logprob),
                    "rank": ranks.get(token_id),
                    "decoded_token": name,
                }
            }
            for top_id, value, text in zip(entry.top_ids, entry.top_logprobs, tops):
                at.setdefault(
                    str(top_id), {"logprob": floored(value), "rank": ranks[top_id], "decoded_token": text}
                )
            out.append(at)
        return out

    def _names(self) -> list[str]:
        """Each prompt token's text alone: the server's, else its first entry's, else its id's name."""
        prompt = self.tokens
        assert prompt is not None
        if prompt.tokens is not None:
            return prompt.tokens
        entries = prompt.logprobs or [None] * len(prompt.token_ids)
        return [
            token_text(entry.token if entry is not None else None, token_id)
            for token_id, entry in zip(prompt.token_ids, entries)
        ]


def echo_refusal(error: APIError) -> APIError:
    """The server's refusal of the prompt_logprobs the gateway asked for an echo with logprobs
    (a server that scores no prompts), told of the field the request sent: `echo`."""
    if error.param != VLLM_KEY:
        return error
    return APIError(
        error.status, f"echo: with logprobs, {error.message}", type=error.type, param="echo", code=error.code
    )


def add_prompt_logprobs(body: dict[str, Any], echo: PromptEcho | None, chat: bool) -> None:
    """vLLM's prompt_logprobs in a whole answer: at the top of a chat answer, in each choice of a
    completion (each echoes its own request's prompt)."""
    values = echo.vllm_prompt_logprobs() if echo is not None else []
    if chat:
        body[VLLM_KEY] = values
        return
    for choice in body["choices"]:
        choice[VLLM_KEY] = values
