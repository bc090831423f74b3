"""Protocol 1.10's tokenizer ops: `tokenize` (a prompt or chat turns to the token ids a generate
of them would run on), `detokenize` (token ids to text) and `tokenizer_info` (the tokenizer's
special tokens and chat template), each answered with its own reply op carrying the request's
`id`: `tokens`, `text` and `tokenizer_info`.

A request the server cannot take is answered, never dropped: its reply op then carries
`error: {"code": "bad_request", "message": "<field>: ..."}` and nothing else, and the server goes
on.  Only a frame without a usable id gets an `error` op (there is nothing to answer to), as a
generate does.

decode_tokenize_op is the decoder's half, which protocol.decode_request calls once it has read
the id; it raises nothing.  The message builders serve the clients and the server (whose half is
hostctl/serving/tokenize_service.py).  This module imports nothing of ipc.protocol, which imports
it; a Limits is read by its attributes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ringleader.ipc.chat_turns import ChatTurnsError, chat_turns
from ringleader.ipc.request_extensions import CHAT_FIELDS, ExtensionError, check_extensions
from ringleader.ipc.sampling_params import clipped_repr

OP_TOKENIZE = "tokenize"
OP_DETOKENIZE = "detokenize"
OP_TOKENIZER_INFO = "tokenizer_info"  # the request's and its reply's op, as stats and hello
OP_TOKENS = "tokens"
OP_TEXT = "text"
# each request op and the op of its reply
REPLY_OP = {OP_TOKENIZE: OP_TOKENS, OP_DETOKENIZE: OP_TEXT, OP_TOKENIZER_INFO: OP_TOKENIZER_INFO}
TOKENIZE_OPS = frozenset(REPLY_OP)
TOKENIZE_REPLY_OPS = frozenset(REPLY_OP.values())
BAD_REQUEST = "bad_request"  # protocol.ERR_BAD_REQUEST, which this module cannot import
NOT_SUPPORTED = "not_supported"  # the clients' own code: a server older than 1.10 lacks the op

# every field each op takes
FIELDS = {
    OP_TOKENIZE: ("op", "id", "prompt", "messages", "add_special_tokens", "return_token_strs", *CHAT_FIELDS),
    OP_DETOKENIZE: ("op", "id", "token_ids", "skip_special_tokens"),
    OP_TOKENIZER_INFO: ("op", "id"),
}


@dataclass(slots=True)
class TokenizeRequest:
    id: str | int
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    # None: as generate does: the tokenizer's special tokens for a prompt, the template's for messages
    add_special_tokens: bool | None = None
    return_token_strs: bool = False  # the reply also names each token's text
    chat_template_kwargs: dict[str, Any] | None = None  # these three: with messages, as generate's
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass(slots=True)
class DetokenizeRequest:
    id: str | int
    token_ids: list[int]
    skip_special_tokens: bool = False  # vLLM's /detokenize spells special tokens out


@dataclass(slots=True)
class TokenizerInfoRequest:
    id: str | int


@dataclass(slots=True)
class RefusedOp:
    """A tokenizer op with a field the decoder refused: answered with its reply op's error."""

    op: str
    id: str | int
    field: str
    message: str  # starts with "<field>: "


TokenizeOp = TokenizeRequest | DetokenizeRequest | TokenizerInfoRequest | RefusedOp


class _Refused(Exception):
    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field


# ---------------------------------------------------------------- decoding


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(obj: dict, name: str) -> bool | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, bool):
        raise _Refused(name, f"must be true or false, got {clipped_repr(value)}")
    return value


def _refuse_unknown(op: str, obj: dict) -> None:
    for key, value in obj.items():
        if key not in FIELDS[op] and value is not None:
            name = key if isinstance(key, str) and len(key) <= 64 else clipped_repr(key)
            raise _Refused(name, f"unknown field; {op} takes: {', '.join(FIELDS[op])}")


def _tokenize(obj: dict, rid: str | int, limits: Any) -> TokenizeRequest:
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if prompt is not None and messages is not None:
        raise _Refused("prompt", "give one of prompt and messages, not both")
    if prompt is None and messages is None:
        raise _Refused("prompt", "one of prompt (str) or messages (array of maps) is required")
    special = _flag(obj, "add_special_tokens")
    if messages is not None:
        try:
            turns = chat_turns(messages, limits.max_messages, limits.max_prompt_chars)
            chat = check_extensions({name: obj.get(name) for name in CHAT_FIELDS}, turns)
        except (ChatTurnsError, ExtensionError) as err:
            raise _Refused(err.field, err.reason) from None
        if special:
            raise _Refused(
                "add_special_tokens",
                "with messages the chat template writes the special tokens, as a generate renders "
                "them; only false (or nil) is taken",
            )
        options = {name: chat[name] for name in CHAT_FIELDS}
        return TokenizeRequest(rid, None, turns, special, bool(_flag(obj, "return_token_strs")), **options)
    if not isinstance(prompt, str) or len(prompt) > limits.max_prompt_chars:
        raise _Refused(
            "prompt", f"must be a str of 0..{limits.max_prompt_chars} characters, got {clipped_repr(prompt)}"
        )
    for name in CHAT_FIELDS:
        if obj.get(name) is not None:
            raise _Refused(name, "only goes with messages (it says how they are rendered)")
    return TokenizeRequest(rid, prompt, None, special, bool(_flag(obj, "return_token_strs")))


def _detokenize(obj: dict, rid: str | int, limits: Any) -> DetokenizeRequest:
    ids = obj.get("token_ids")
    if not isinstance(ids, list):
        raise _Refused("token_ids", f"must be an array of token ids, got {clipped_repr(ids)}")
    vocab = limits.vocab_size
    for index, token in enumerate(ids):
        if not _is_int(token) or not 0 <= token < vocab:
            raise _Refused(
                "token_ids", f"element {index} must be an int in [0, {vocab}), got {clipped_repr(token)}"
            )
    return DetokenizeRequest(rid, ids, bool(_flag(obj, "skip_special_tokens")))


def decode_tokenize_op(op: str, obj: dict, rid: str | int, limits: Any) -> TokenizeOp:
    """The request of a tokenizer op (`op` one of TOKENIZE_OPS, `rid` its id, read already), or a
    RefusedOp naming the field at fault; `limits`: the server's protocol.Limits."""
    try:
        _refuse_unknown(op, obj)
        if op == OP_TOKENIZE:
            return _tokenize(obj, rid, limits)
        if op == OP_DETOKENIZE:
            return _detokenize(obj, rid, limits)
        return TokenizerInfoRequest(rid)
    except _Refused as err:
        return RefusedOp(op, rid, err.field, str(err))


# ---------------------------------------------------------------- messages


def tokenize_msg(req: TokenizeRequest) -> dict:
    """A tokenize's wire map: its fields that differ from their defaults."""
    msg: dict[str, Any] = {"op": OP_TOKENIZE, "id": req.id}
    if req.messages is not None:
        msg["messages"] = req.messages
    else:
        msg["prompt"] = req.prompt
    if req.add_special_tokens is not None:
        msg["add_special_tokens"] = req.add_special_tokens
    if req.return_token_strs:
        msg["return_token_strs"] = True
    if req.chat_template_kwargs:
        msg["chat_template_kwargs"] = req.chat_template_kwargs
    if not req.add_generation_prompt:
        msg["add_generation_prompt"] = False
    if req.continue_final_message:
        msg["continue_final_message"] = True
    return msg


def tokenize_call(prompt: str | None, messages: Sequence[Mapping[str, Any]] | None, **options: Any) -> dict:
    """tokenize's map from a client's call (its id set by the client): `options` are
    TokenizeRequest's fields by name."""
    turns = None if messages is None else [dict(m) for m in messages]
    kwargs = options.pop("chat_template_kwargs", None)
    return tokenize_msg(
        TokenizeRequest(0, prompt, turns, chat_template_kwargs=kwargs and dict(kwargs), **options)
    )


def detokenize_msg(req: DetokenizeRequest) -> dict:
    msg: dict[str, Any] = {"op": OP_DETOKENIZE, "id": req.id, "token_ids": list(req.token_ids)}
    if req.skip_special_tokens:
        msg["skip_special_tokens"] = True
    return msg


def tokenizer_info_msg(rid: str | int) -> dict:
    return {"op": OP_TOKENIZER_INFO, "id": rid}


def tokens_reply(
    rid: str | int, token_ids: list[int], max_context: int, token_strs: list[str] | None
) -> dict:
    msg: dict[str, Any] = {"op": OP_TOKENS, "id": rid, "token_ids": token_ids, "max_context": max_context}
    if token_strs is not None:
        msg["token_strs"] = token_strs
    return msg


def text_reply(rid: str | int, text: str) -> dict:
    return {"op": OP_TEXT, "id": rid, "text": text}


def info_reply(rid: str | int, info: dict[str, Any]) -> dict:
    return {**info, "op": OP_TOKENIZER_INFO, "id": rid}


def refusal_reply(op: str, rid: str | int, code: str, message: str) -> dict:
    """The reply to a request op `op` that the server refused: its reply op with the error alone."""
    return {"op": REPLY_OP[op], "id": rid, "error": {"code": code, "message": message}}


# ---------------------------------------------------------------- the clients' side


@dataclass(slots=True)
class Tokenized:
    """A tokenize's answer: the ids, the server's context (prompt + output fit in it) and, when
    asked, each token's text (the id decoded alone, as logprobs name tokens)."""

    token_ids: list[int]
    max_context: int
    token_strs: list[str] | None = None


class TokenizeError(ValueError):
    """A tokenizer op refused: by the server (its code, usually bad_request), or by the client
    before sending (judged as the server's decoder judges it); str() starts with the field."""

    def __init__(self, field: str | None, message: str, code: str = BAD_REQUEST):
        super().__init__(message)
        self.field, self.message, self.code = field, message, code


def check_op(msg: dict, limits: Any) -> None:
    """TokenizeError unless the server's decoder would take `msg` (a tokenizer op's map) within
    `limits`: a bad request is the caller's mistake, told at once."""
    refused = decode_tokenize_op(msg["op"], msg, msg["id"], limits)
    if isinstance(refused, RefusedOp):
        raise TokenizeError(refused.field, refused.message)


def result_of(reply: dict) -> Tokenized | str | dict:
    """A reply op's answer: Tokenized (tokens), the text (text), the info map (tokenizer_info);
    TokenizeError for a refusal or a reply that is not one (code bad_reply)."""
    error = reply.get("error")
    if error is not None:
        if not isinstance(error, dict):
            error = {"message": str(error)}
        message = str(error.get("message", ""))
        field = message.split(":", 1)[0] if ":" in message else None
        raise TokenizeError(field, message, str(error.get("code", BAD_REQUEST)))
    op = reply.get("op")
    try:
        if op == OP_TOKENS:
            ids, strs = reply["token_ids"], reply.get("token_strs")
            if not isinstance(ids, list) or (
                strs is not None and (not isinstance(strs, list) or len(strs) != len(ids))
            ):
                raise TypeError
            return Tokenized(ids, int(reply["max_context"]), strs)
        if op == OP_TEXT:
            if not isinstance(reply["text"], str):
                raise TypeError
            return reply["text"]
        return {k: v for k, v in reply.items() if k not in ("op", "id")}
    except (KeyError, TypeError, ValueError):
        raise TokenizeError(None, f"malformed {op} reply from the server", "bad_reply") from None
