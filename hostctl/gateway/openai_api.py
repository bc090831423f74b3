"""The OpenAI HTTP API's side of the gateway, without I/O: a JSON body in, a typed request out
(or an APIError naming the field), and the bytes of every response and SSE chunk.

What is accepted is what ringleader can honour: `n`, `best_of`, `echo`, `logprobs`, penalties,
`logit_bias`, `suffix`, tools and non-text content are refused with a 400 naming the field
rather than silently ignored.  Extensions, as vLLM names them: `top_k`, `ignore_eos`,
`stop_token_ids`, `return_token_ids` (each choice carries the ids of its tokens), `priority`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ringleader.ipc import protocol as P
from ringleader.ipc.sampling_params import MAX_TOP_K, SamplingParams, check_float_field

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256
SSE_DONE = b"data: [DONE]\n\n"

# protocol error code -> (HTTP status, OpenAI error type)
STATUS_OF_CODE: dict[str, tuple[int, str]] = {
    P.ERR_BAD_REQUEST: (400, "invalid_request_error"),
    P.ERR_OVERLOADED: (429, "rate_limit_error"),
    P.ERR_ENGINE_DEAD: (503, "service_unavailable"),
    P.ERR_SHUTDOWN: (503, "service_unavailable"),
    "disconnected": (503, "service_unavailable"),  # the gateway lost its upstream server
    P.ERR_TIMEOUT: (504, "timeout"),
}
# the server's field names where the OpenAI request used another
PARAM_OF_FIELD = {"prompt_ids": "prompt", "stop_token_ids": "stop_token_ids"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_upstream(cls, code: str | None, message: str | None) -> APIError:
        """The error of a ringleader `done`: its code picks the status; a bad_request names its
        field first ("field: ..."), which becomes `param`."""
        status, kind = STATUS_OF_CODE.get(code or "", (500, "server_error"))
        text = message or code or "unknown error"
        param = None
        if code == P.ERR_BAD_REQUEST and ":" in text:
            head = text.split(":", 1)[0]
            if head.isidentifier():
                param = PARAM_OF_FIELD.get(head, head)
        return cls(status, text, type=kind, param=param, code=code)


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


@dataclass(slots=True)
class GenerationRequest:
    """One OpenAI request, checked and translated to what AsyncClient.generate takes."""

    chat: bool
    model: str | None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=16))
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    priority: int = 0


# ---------------------------------------------------------------- parsing


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _sampling_float(body: dict, name: str, default: float) -> float:
    """temperature, top_p: judged by the protocol's one range of each (FLOAT_RANGES)."""
    v = body.get(name)
    if v is None:
        return default
    try:
        return check_float_field(name, v)
    except ValueError as exc:  # its message names the field already
        raise APIError(400, str(exc), param=name) from None


def _int(body: dict, name: str, default: Any, lo: int, hi: int) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise bad(name, f"must be an integer in [{lo}, {hi}], got {P._show(v)}")
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {P._show(v)}")
    return v


def _refuse_unless_default(body: dict, name: str, allowed: tuple[Any, ...], why: str) -> None:
    if name in body and body[name] not in allowed:
        raise bad(name, f"{why}; got {P._show(body[name])}")


def _token_ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return value
    return None


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    """`prompt` as a string or as token ids; a batch of one is unwrapped, a larger batch refused."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "is required")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    if isinstance(p, str):
        if not p:
            raise bad("prompt", "must not be empty")
        return p, None
    ids = _token_ids(p)
    if ids is not None:
        return None, ids
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("prompt", f"batches are not supported: send one prompt per request (got {len(p)})")
    raise bad("prompt", f"must be a string or a non-empty array of token ids, got {P._show(p)}")


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or an array of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad(
                    f"{where}.content[{i}]", "only text parts ({'type': 'text', 'text': ...}) are supported"
                )
            texts.append(part["text"])
        return "".join(texts)
    if value is None:
        return ""
    raise bad(f"{where}.content", f"must be a string or an array of text parts, got {P._show(value)}")


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty array of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"must be an object, got {P._show(m)}")
        role = m.get("role")
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system turn
        if role not in ("system", "user", "assistant"):
            raise bad(f"{where}.role", f"must be system, developer, user or assistant, got {P._show(role)}")
        if m.get("tool_calls"):
            raise bad(f"{where}.tool_calls", "tools are not supported")
        out.append({"role": role, "content": _content(m.get("content"), where)})
    return out


def _stop(body: dict) -> tuple[str, ...]:
    s = body.get("stop")
    if s is None:
        return ()
    stops = [s] if isinstance(s, str) else s
    if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
        raise bad("stop", f"must be a string or an array of strings, got {P._show(s)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for x in stops:
        if not 1 <= len(x) <= MAX_STOP_STRING_CHARS:
            raise bad("stop", f"each string must have 1..{MAX_STOP_STRING_CHARS} characters")
    return tuple(dict.fromkeys(stops))


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None or v == []:
        return ()
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise bad("stop_token_ids", f"must be an array of token ids, got {P._show(v)}")
    return tuple(v)


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad("stream_options", "is only allowed with stream: true")
    if not isinstance(opts, dict):
        raise bad("stream_options", f"must be an object, got {P._show(opts)}")
    return _bool(opts, "include_usage")


def parse_request(body: Any, *, chat: bool) -> GenerationRequest:
    """The checked request of /v1/completions (chat False) or /v1/chat/completions (chat True)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"must be a string, got {P._show(model)}")
    _refuse_unless_default(body, "n", (None, 1), "only n = 1 is supported")
    _refuse_unless_default(body, "frequency_penalty", (None, 0, 0.0), "penalties are not supported")
    _refuse_unless_default(body, "presence_penalty", (None, 0, 0.0), "penalties are not supported")
    _refuse_unless_default(body, "logit_bias", (None, {}), "logit_bias is not supported")
    if chat:
        _refuse_unless_default(body, "logprobs", (None, False), "logprobs are not supported")
        _refuse_unless_default(body, "top_logprobs", (None, 0), "logprobs are not supported")
        _refuse_unless_default(body, "tools", (None, []), "tools are not supported")
        _refuse_unless_default(body, "tool_choice", (None, "none"), "tools are not supported")
        rf = body.get("response_format")
        if rf is not None and rf != {"type": "text"}:
            raise bad("response_format", f"only {{'type': 'text'}} is supported, got {P._show(rf)}")
    else:
        _refuse_unless_default(body, "best_of", (None, 1), "only best_of = 1 is supported")
        _refuse_unless_default(body, "echo", (None, False), "echo is not supported")
        _refuse_unless_default(body, "logprobs", (None,), "logprobs are not supported")
        _refuse_unless_default(body, "suffix", (None, ""), "suffix is not supported")
    stream = _bool(body, "stream")
    req = GenerationRequest(chat=chat, model=model, stream=stream)
    if chat:
        req.messages = _messages(body)
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    else:
        req.prompt, req.prompt_ids = _prompt(body)
        name = "max_tokens"
    # chat without max_tokens: None, the rest of the context (only the server knows the prompt's
    # length), as vllm serve does; the server's --default-max-tokens caps it
    max_tokens = _int(body, name, None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS, 1, P.INT64_MAX)
    top_k = _int(body, "top_k", 0, -1, MAX_TOP_K)
    req.sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=_sampling_float(body, "temperature", 1.0),
        top_p=_sampling_float(body, "top_p", 1.0),
        top_k=max(top_k, 0),  # -1: off, as vLLM writes it
        seed=_int(body, "seed", None, 0, P.UINT64_MAX),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=_bool(body, "ignore_eos"),
    )
    req.stop = _stop(body)
    req.include_usage = _stream_options(body, stream)
    req.return_token_ids = _bool(body, "return_token_ids")
    req.priority = _int(body, "priority", 0, -1000, 1000)
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise bad("user", "must be a string")
    return req


# ---------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class ResponseWriter:
    """The bytes of one request's answers.  The per-token chunk is a prefix and a suffix made
    once per request around the chunk's text, so a token costs one json.dumps of its text."""

    def __init__(self, req: GenerationRequest, model: str):
        self.req = req
        self.model = model
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        head = {"id": self.id, "object": self._object(), "created": self.created, "model": model}
        # '{"id":...,"model":"M"' without the closing brace, to open every chunk with
        self._head = json.dumps(head, separators=(",", ":"))[:-1]
        if req.chat:
            self._token_prefix = (
                "data: " + self._head + ',"choices":[{"index":0,"delta":{"content":'
            ).encode()
            self._token_suffix = '},"logprobs":null,"finish_reason":null'
        else:
            self._token_prefix = ("data: " + self._head + ',"choices":[{"index":0,"text":').encode()
            self._token_suffix = ',"logprobs":null,"finish_reason":null'

    def _object(self) -> str:
        return "chat.completion.chunk" if self.req.chat else "text_completion"

    def _chunk(self, choices: list[dict], **extra: Any) -> bytes:
        obj = {"id": self.id, "object": self._object(), "created": self.created, "model": self.model}
        obj["choices"] = choices
        obj.update(extra)
        return _sse(obj)

    def role_chunk(self) -> bytes:
        """Chat streams open with the assistant's role."""
        return self._chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        )

    def token_chunk(self, text: str, token_ids: list[int]) -> bytes:
        tail = self._token_suffix
        if self.req.return_token_ids:
            tail += ',"token_ids":' + json.dumps(token_ids, separators=(",", ":"))
        return self._token_prefix + (json.dumps(text) + tail + "}]}\n\n").encode()

    def finish_chunk(self, finish_reason: str) -> bytes:
        if self.req.chat:
            return self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])
        return self._chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._chunk([], usage=usage(prompt_tokens, completion_tokens))

    @staticmethod
    def error_event(err: APIError) -> bytes:
        return _sse(err.body())

    def response(
        self, text: str, token_ids: list[int], finish_reason: str, prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        """The whole answer of a request that did not stream."""
        choice: dict[str, Any]
        if self.req.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
        return {
            "id": self.id,
            "object": "chat.completion" if self.req.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens),
        }


def models_list(name: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "ringleader"}
    if max_model_len:
        entry["max_model_len"] = max_model_len
    return {"object": "list", "data": [entry]}
