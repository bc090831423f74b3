"""vLLM's tokenizer routes, without I/O: `POST /tokenize`, `POST /detokenize` and
`GET /tokenizer_info`, in vLLM's shapes, answered by the server's tokenizer ops (protocol 1.10:
AsyncClient.tokenize, detokenize, tokenizer_info), so a count is the prompt_tokens a generation
of the same input reports.

- /tokenize {model?, prompt | messages, add_special_tokens, return_token_strs, and with messages
  add_generation_prompt, continue_final_message, chat_template_kwargs} ->
  {count, max_model_len, tokens, token_strs}.  add_special_tokens defaults as vLLM's: true for a
  prompt (the tokenizer's BOS where the model adds one), false for messages (the template writes
  them; true is a 400 there).  token_strs are the tokens' texts, each decoded alone (where vLLM
  gives the vocabulary's pieces, such as "Ġthe"); null unless asked.
- /detokenize {model?, tokens} -> {prompt}: special tokens spelled out, as vLLM's.
- /tokenizer_info -> the tokenizer's special tokens (`bos_token`, `eos_token`, `pad_token` and
  their ids), `chat_template` (its source), `model_max_length`, `vocab_size`: what lm-eval's
  remote tokenizer reads (it needs `eos_token`; `chat_template` for apply_chat_template).

A field of the wrong type, or one the server refuses, is a 400 naming it; an unknown field too."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from ringleader.hostctl.gateway.errors import STATUS_OF_CODE, APIError, bad
from ringleader.hostctl.gateway.openai_api import ServedModel, chat_messages, model_not_found
from ringleader.ipc.client import Tokenized, TokenizeError
from ringleader.ipc.sampling_params import clipped_repr
from ringleader.ipc.tokenize_ops import NOT_SUPPORTED

T = TypeVar("T")
ANSWER_WAIT_S = 30.0  # an op's reply is awaited this long (the server answers at once)
_TOKENIZE_FIELDS = (
    *("model", "prompt", "messages", "add_special_tokens", "return_token_strs", "add_generation_prompt"),
    *("continue_final_message", "chat_template_kwargs", "chat_template", "tools", "mm_processor_kwargs"),
)
_DETOKENIZE_FIELDS = ("model", "tokens")
_FLAGS = ("add_special_tokens", "return_token_strs", "add_generation_prompt", "continue_final_message")
# the server's names of the body's fields where they differ
_BODY_NAME = {"token_ids": "tokens"}


def _body(raw_body: bytes, known: tuple[str, ...], model: ServedModel) -> dict[str, Any]:
    try:
        body = json.loads(raw_body)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if value is not None and name not in known:
            raise bad(
                name if len(name) <= 64 else clipped_repr(name),
                f"unknown field; this route takes: {', '.join(known)}",
            )
    asked = body.get("model")
    if asked is not None and not isinstance(asked, str):
        raise bad("model", f"must be a string, got {clipped_repr(asked)}")
    if asked is not None and asked != model.name:
        raise model_not_found(asked, model.name)
    return body


def tokenize_call(raw_body: bytes, model: ServedModel) -> dict[str, Any]:
    """AsyncClient.tokenize's keywords for a /tokenize body; a 400 naming the field."""
    body = _body(raw_body, _TOKENIZE_FIELDS, model)
    for name in ("chat_template", "mm_processor_kwargs"):
        if body.get(name) is not None:
            raise bad(name, "is not supported: the server renders messages with the model's own template")
    if body.get("tools"):
        raise bad("tools", "tools are not supported")
    call: dict[str, Any] = {}
    for name in _FLAGS:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise bad(name, f"must be true or false, got {clipped_repr(value)}")
        if value is not None:
            call[name] = value
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", f"must be an object, got {clipped_repr(kwargs)}")
    if kwargs:
        call["chat_template_kwargs"] = kwargs
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise bad("prompt", "give one of prompt and messages, not both")
        call["messages"] = chat_messages(body)
        return call
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad("prompt", f"must be a string (or send messages), got {clipped_repr(prompt)}")
    call["prompt"] = prompt
    return call


def tokenize_answer(tokenized: Tokenized) -> dict[str, Any]:
    return {
        "count": len(tokenized.token_ids),
        "max_model_len": tokenized.max_context,
        "tokens": tokenized.token_ids,
        "token_strs": tokenized.token_strs,
    }


def detokenize_call(raw_body: bytes, model: ServedModel) -> list[int]:
    """/detokenize's token ids; the server judges them against its vocabulary."""
    tokens = _body(raw_body, _DETOKENIZE_FIELDS, model).get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise bad("tokens", f"must be an array of token ids, got {clipped_repr(tokens)}")
    return tokens


def tokenizer_info_answer(info: dict[str, Any]) -> dict[str, Any]:
    """/tokenizer_info's answer from the server's tokenizer_info reply."""
    eos_ids = info.get("eos_token_ids") or []
    return {
        "tokenizer_class": "ringleader",
        "bos_token": info.get("bos_token"),
        "bos_token_id": info.get("bos_token_id"),
        "eos_token": info.get("eos_token"),
        "eos_token_id": eos_ids[0] if eos_ids else None,
        "eos_token_ids": eos_ids,
        "pad_token": info.get("pad_token"),
        "pad_token_id": info.get("pad_token_id"),
        "chat_template": info.get("chat_template"),
        "model_max_length": info.get("max_context"),
        "vocab_size": info.get("vocab_size"),
    }


async def asked(reply: Awaitable[T]) -> T:
    """A tokenizer op's answer, or its failure as the gateway answers it: the server's refusal
    a 400 naming the body's field, a server without the op 501, no reply 504, no server 503."""
    try:
        return await reply
    except TokenizeError as exc:
        if exc.code == NOT_SUPPORTED:
            raise APIError(501, exc.message, type="not_implemented", code=NOT_SUPPORTED) from None
        field = _BODY_NAME.get(exc.field or "", exc.field)
        message = exc.message if field == exc.field else f"{field}{exc.message[len(exc.field or '') :]}"
        status, kind = STATUS_OF_CODE.get(exc.code, (502, "server_error"))
        raise APIError(status, message, type=kind, param=field, code=exc.code) from None
    except TimeoutError as exc:
        raise APIError(504, str(exc), type="timeout", code="timeout") from None
    except ConnectionError as exc:
        raise APIError(503, str(exc), type="service_unavailable", code="disconnected") from None
