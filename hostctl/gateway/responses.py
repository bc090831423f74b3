"""The OpenAI HTTP API's answers, without I/O: the bytes of every response and SSE chunk of a
request that openai_api.parse_request checked, and each choice's text, tokens and logprobs as
they arrive (ChoiceAnswer).

Logprobs are answered in each endpoint's shape: chat's `{"content": [{token, logprob, bytes,
top_logprobs}], "refusal": null}`, completions' legacy `{tokens, token_logprobs, top_logprobs,
text_offset}`; a token without text (a model without a tokenizer) is "token_id:<id>", as vLLM
writes it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ringleader.hostctl.gateway.openai_api import APIError, GenerationRequest
from ringleader.hostctl.gateway.stop_strings import StopMatcher
from ringleader.ipc.client.core import ChoiceEnd, TokenChunk, TokenLogprob

SSE_DONE = b"data: [DONE]\n\n"
# JSON has no -Infinity: a logprob is floored here, as vLLM does
LOGPROB_FLOOR = -9999.0


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# ---------------------------------------------------------------- logprobs


def token_text(text: str | None, token_id: int) -> str:
    """A token as the logprobs name it: its text, or "token_id:<id>" without a tokenizer (vLLM's)."""
    return text if text is not None else f"token_id:{token_id}"


def floored(logprob: float) -> float:
    # `>` is False for NaN too, which JSON cannot carry either
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _top_texts(entry: TokenLogprob) -> list[str]:
    if entry.top_tokens is not None:
        return entry.top_tokens
    return [token_text(None, token_id) for token_id in entry.top_ids]


def chat_logprobs_content(token_ids: list[int], logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` of some tokens: per token its text, logprob, UTF-8 bytes and the
    asked number of most likely alternatives in the same shape."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        token = token_text(entry.token, token_id)
        content.append(
            {
                "token": token,
                "logprob": floored(entry.logprob),
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": text, "logprob": floored(value), "bytes": list(text.encode())}
                    for text, value in zip(_top_texts(entry), entry.top_logprobs)
                ],
            }
        )
    return content


def completion_logprobs(
    token_ids: list[int], logprobs: list[TokenLogprob], text_offset: int, names: list[str] | None = None
) -> dict[str, list[Any]]:
    """Completions' legacy `logprobs` of some tokens, the first at `text_offset` in the choice's
    text: each token's `top_logprobs` maps the alternatives' texts and the chosen token's own to
    their logprobs (up to logprobs + 1 entries, as OpenAI's legacy API and vLLM answer).
    names: the tokens' texts where the entries do not carry them (a prompt's, from the server)."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for at, (token_id, entry) in enumerate(zip(token_ids, logprobs)):
        token = names[at] if names is not None else token_text(entry.token, token_id)
        chosen = floored(entry.logprob)
        top: dict[str, float] = {}
        for text, value in zip(_top_texts(entry), entry.top_logprobs):
            top.setdefault(text, floored(value))  # two tokens of one text: the likelier's
        top.setdefault(token, chosen)
        tokens.append(token)
        token_logprobs.append(chosen)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


# ---------------------------------------------------------------- choices


class ChoiceAnswer:
    """One choice of a request as the gateway answers it: its text through its own stop matcher,
    the tokens it received, their logprobs in the endpoint's shape, and how it ended.

    `keep`: the text, ids and logprobs are kept for a whole (not streamed) answer; a stream only
    counts its tokens.  An echoed prompt (`echo_text`, and with logprobs `echo_logprobs`, its
    tokens' legacy logprobs) comes first in its text and logprobs, and its offsets after it."""

    def __init__(
        self,
        index: int,
        req: GenerationRequest,
        *,
        keep: bool,
        echo_text: str = "",
        echo_logprobs: dict[str, list[Any]] | None = None,
    ):
        self.index = index
        self.finish_reason: str | None = None  # set once the choice ended, for the gateway
        self.stopped = False  # a stop string ended it
        self.received = 0  # its tokens so far (through the chunk a stop string matched in)
        self.texts: list[str] = [echo_text] if echo_text else []
        self.token_ids: list[int] = []
        self._chat = req.chat
        self._keep = keep
        self._matcher = (
            StopMatcher(req.stop, include=req.include_stop_str_in_output, min_tokens=req.sampling.min_tokens)
            if req.stop
            else None
        )
        self._logprobs = req.sampling.logprobs is not None
        self._content: list[dict[str, Any]] = []  # chat's logprobs entries, kept
        names = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        self._legacy: dict[str, list[Any]] = {
            name: list((echo_logprobs or {}).get(name, [])) for name in names
        }
        self._echoed = len(self._legacy["tokens"])  # the prompt's tokens, listed first
        self._generated_chars = len(echo_text)  # the choice's text before the stop matcher
        self._text_offset = len(echo_text)  # where the next token's text starts

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None

    def take(self, chunk: TokenChunk) -> tuple[str, dict[str, Any] | None]:
        """A chunk of this choice -> the text to emit now and its logprobs (None unless asked).
        After a stop string matched, `stopped` holds and the choice has ended."""
        self.received += len(chunk.token_ids)
        text = chunk.text or ""
        logprobs = self._chunk_logprobs(chunk) if self._logprobs else None
        if self._matcher is not None:
            text = self._matcher.push(text, self.received)
            if self._matcher.matched:
                self.stopped = True
                self.finish_reason = "stop"
        if self._keep:
            self.texts.append(text)
            self.token_ids.extend(chunk.token_ids)
        return text, logprobs

    def end(self, finish_reason: str) -> str:
        """The choice ended upstream: the text its stop matcher held back, which is now due."""
        self.finish_reason = finish_reason
        tail = self._matcher.flush() if self._matcher is not None else ""
        if self._keep:
            self.texts.append(tail)
        return tail

    def completion_tokens(self, end: ChoiceEnd | None) -> int:
        """Its share of the usage: the server's count, or what it received through its stop
        string (the tokens in flight when the abort came are not the answer's)."""
        if self.stopped or end is None:
            return self.received
        return end.completion_tokens

    def logprobs(self, count: int) -> dict[str, Any] | None:
        """The whole answer's logprobs, of its first `count` tokens (those it answers with)."""
        if not self._logprobs:
            return None
        if self._chat:
            return {"content": self._content[:count], "refusal": None}
        return {name: values[: self._echoed + count] for name, values in self._legacy.items()}

    def _chunk_logprobs(self, chunk: TokenChunk) -> dict[str, Any] | None:
        """The chunk's tokens' logprobs; None for a chunk without tokens (a choice's last one
        may carry only the text its detokenizer held)."""
        entries = chunk.logprobs or []
        if self._chat:
            if not chunk.token_ids:
                return None
            content = chat_logprobs_content(chunk.token_ids, entries)
            if self._keep:
                self._content.extend(content)
            return {"content": content, "refusal": None}
        # a token's offset is its place in the text generated so far (the stop matcher only
        # ever keeps a prefix of it); without text, the token names' lengths add up
        if chunk.text is not None:
            self._text_offset = self._generated_chars
            self._generated_chars += len(chunk.text)
        if not chunk.token_ids:
            return None
        legacy = completion_logprobs(chunk.token_ids, entries, self._text_offset)
        if legacy["text_offset"]:
            self._text_offset = legacy["text_offset"][-1] + len(legacy["tokens"][-1])
        if self._keep:
            for name, values in legacy.items():
                self._legacy[name].extend(values)
        return legacy


# ---------------------------------------------------------------- the writer


def new_response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


class ResponseWriter:
    """The bytes of one request's answers.  The per-token chunk of the common request (one
    choice, no logprobs) is a prefix and a suffix made once per request around the chunk's
    text, so a token costs one json.dumps of its text; other chunks are built whole."""

    def __init__(
        self, req: GenerationRequest, model: str, *, response_id: str | None = None, index_base: int = 0
    ):
        """response_id, index_base: one prompt's share of a batch's answer (batched.py): the
        batch's id, and its choices' indexes from index_base on."""
        self.req = req
        self.model = model
        self.id = response_id or new_response_id(req.chat)
        self.index_base = index_base
        self.created = int(time.time())
        head = {"id": self.id, "object": self._object(), "created": self.created, "model": model}
        # '{"id":...,"model":"M"' without the closing brace, to open every chunk with
        self._head = json.dumps(head, separators=(",", ":"))[:-1]
        if req.chat:
            self._token_prefix = (
                "data: " + self._head + f',"choices":[{{"index":{index_base},"delta":{{"content":'
            ).encode()
            self._token_suffix = '},"logprobs":null,"finish_reason":null'
        else:
            self._token_prefix = (
                "data: " + self._head + f',"choices":[{{"index":{index_base},"text":'
            ).encode()
            self._token_suffix = ',"logprobs":null,"finish_reason":null'

    def _object(self) -> str:
        return "chat.completion.chunk" if self.req.chat else "text_completion"

    def _chunk(self, choices: list[dict], **extra: Any) -> bytes:
        obj = {"id": self.id, "object": self._object(), "created": self.created, "model": self.model}
        obj["choices"] = choices
        obj.update(extra)
        return _sse(obj)

    def role_chunk(self, index: int = 0) -> bytes:
        """Chat streams open with the assistant's role, once per choice."""
        return self._chunk(
            [
                {
                    "index": self.index_base + index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def token_chunk(self, text: str, token_ids: list[int]) -> bytes:
        """A chunk of the only choice of a request without logprobs (the fast path)."""
        tail = self._token_suffix
        if self.req.return_token_ids:
            tail += ',"token_ids":' + json.dumps(token_ids, separators=(",", ":"))
        return self._token_prefix + (json.dumps(text) + tail + "}]}\n\n").encode()

    def choice_chunk(
        self, index: int, text: str, token_ids: list[int], logprobs: dict[str, Any] | None
    ) -> bytes:
        """A chunk of choice `index`, with its tokens' logprobs (None: not asked)."""
        choice: dict[str, Any] = {"index": self.index_base + index}
        if self.req.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = None
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
        return self._chunk([choice])

    def finish_chunk(self, finish_reason: str, index: int = 0) -> bytes:
        index += self.index_base
        if self.req.chat:
            return self._chunk(
                [{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}]
            )
        return self._chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._chunk([], usage=usage(prompt_tokens, completion_tokens))

    @staticmethod
    def error_event(err: APIError) -> bytes:
        return _sse(err.body())

    def choice(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One choice of a whole answer."""
        index += self.index_base
        choice: dict[str, Any]
        if self.req.chat:
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def response(
        self, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        """The whole answer of a request that did not stream: its choices by index."""
        return {
            "id": self.id,
            "object": "chat.completion" if self.req.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }
