"""Wire protocol v1: one msgpack map per ZeroMQ frame (client DEALER, server ROUTER).

Decoding is written for hostile input: every failure becomes FrameError (no usable
request, answer with an `error` op) or BadRequest (a request with a usable id but a
bad field, answer a generate with a `done` carrying code `bad_request`).
See docs/protocol.md for the user-facing specification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from ringleader.ipc.batch_frames import OP_BATCH
from ringleader.ipc.chat_turns import CHAT_ROLES, ChatTurnsError  # noqa: F401 (CHAT_ROLES: P.CHAT_ROLES)
from ringleader.ipc.prompt_input import InputError, prompt_input
from ringleader.ipc.prompt_message import prompt_logprob_entries, prompt_msg  # noqa: F401 (1.10)
from ringleader.ipc.request_extensions import WIRE_FIELDS as EXTENSION_FIELDS
from ringleader.ipc.request_extensions import ExtensionError, check_extensions, check_int_field, wire_fields
from ringleader.ipc.sampling_params import (
    WIRE_FIELDS,
    SamplingError,
    SamplingParams,
    clipped_repr,
    in_server_range,
    sampling_from_wire,
)
from ringleader.ipc.structured import StructuredSpec, structured_from_wire
from ringleader.ipc.tokenize_ops import (
    TOKENIZE_OPS,
    TOKENIZE_REPLY_OPS,
    TokenizeOp,
    decode_tokenize_op,
)  # 1.10

PROTOCOL_VERSION = 1
# what each revision added: docs/protocol.md's opening paragraphs (1.9: vLLM's request extensions)
PROTOCOL_REVISION = 10

# ops, client -> server
OP_GENERATE = "generate"
OP_ABORT = "abort"
OP_STATS = "stats"
OP_PING = "ping"
OP_HELLO = "hello"  # 1.7; used in both directions (the server's answer)
# ops, server -> client (OP_STATS is used in both directions)
OP_TOKEN = "token"
OP_DONE = "done"
OP_ERROR = "error"
OP_PONG = "pong"
REQUEST_OPS = frozenset({OP_GENERATE, OP_ABORT, OP_STATS, OP_PING, OP_HELLO, *TOKENIZE_OPS})
REPLY_OPS = frozenset(
    {OP_TOKEN, OP_DONE, OP_ERROR, OP_STATS, OP_PONG, OP_HELLO, OP_BATCH, *TOKENIZE_REPLY_OPS}
)

# finish reasons carried by `done`
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"
FINISH_REASONS = frozenset({FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR})
# what an abort may ask its request to end with (1.3): "stop" for a client that found its own
# stop (a stop string, say), so the server counts it as a stop and not as an abort
ABORT_FINISH_REASONS = frozenset({FINISH_ABORT, FINISH_STOP})

# error codes carried by `done.error.code` and by the `error` op
ERR_BAD_REQUEST = "bad_request"
ERR_OVERLOADED = "overloaded"
ERR_ENGINE_DEAD = "engine_dead"
ERR_SHUTDOWN = "shutdown"
ERR_DUPLICATE_ID = "duplicate_id"
ERR_TIMEOUT = "timeout"  # protocol 1.1: the request's timeout_ms or the server's queue limit passed
ERROR_CODES = frozenset(
    {ERR_BAD_REQUEST, ERR_OVERLOADED, ERR_ENGINE_DEAD, ERR_SHUTDOWN, ERR_DUPLICATE_ID, ERR_TIMEOUT}
)

DEFAULT_MAX_FRAME_BYTES = 1 << 20
# abort.index: any int32 a choice could have (an index the request does not have stops nothing)
MAX_CHOICE_INDEX = (1 << 31) - 1
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# Containers (maps + arrays) allowed in one frame: bounds the Python objects a 1 MiB frame can expand to.
MAX_CONTAINERS_PER_FRAME = 10_000

RequestId = str | int


@dataclass(slots=True)
class Limits:
    """Bounds the server enforces on requests; the server fills in model-specific values."""

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    vocab_size: int = (1 << 31) - 1  # token ids must be in [0, vocab_size); server sets the model's value
    max_context: int = 8192  # prompt length + max_tokens must not exceed this
    max_tokens_cap: int = 4096
    # a generate without max_tokens runs to the end of the context, at most this many tokens (None: no cap)
    default_max_tokens: int | None = None
    max_id_len: int = 256  # characters, for str ids
    max_prompt_chars: int = 512 * 1024  # also bounds the characters of all chat messages together
    max_messages: int = 1024
    min_priority: int = -1000
    max_priority: int = 1000
    max_timeout_ms: int = 24 * 3600 * 1000
    # the server scores prompts (its rings' score_rows > 0): requests may ask for prompt_logprobs
    prompt_logprobs: bool = True


# the decoder's default ranges, which generate_msg holds priority and timeout_ms to
_RANGES = Limits()


@dataclass(slots=True)
class GenerateRequest:
    id: RequestId
    prompt: str | None
    prompt_ids: list[int] | None
    sampling: SamplingParams
    priority: int = 0
    timeout_ms: int | None = None  # from arrival at the server; None: only the server's limits
    messages: list[dict[str, str]] | None = None  # chat turns, rendered by the model's template (1.2)
    detokenize: bool = True  # 1.7: False asks for token ids only (no text, no token strings)
    structured: StructuredSpec | None = None  # 1.8: the output's constraint (ipc/structured.py)
    # 1.9, vLLM's (ipc/request_extensions.py): how `messages` are rendered, how the output is decoded
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


@dataclass(slots=True)
class AbortRequest:
    id: RequestId
    finish_reason: str = FINISH_ABORT  # one of ABORT_FINISH_REASONS: what the request's `done` says (1.3)
    index: int | None = None  # one choice of a request with n > 1 (1.5); None: all of them


@dataclass(slots=True)
class StatsRequest:
    timeline_after_seq: int = 0  # 1.6: the device timeline summarises the steps after this one


@dataclass(slots=True)
class PingRequest:
    pass


@dataclass(slots=True)
class HelloRequest:
    batch: bool = False  # 1.7: this connection's streams come as `batch` frames from now on


Request = GenerateRequest | AbortRequest | StatsRequest | PingRequest | HelloRequest | TokenizeOp


class ProtocolError(Exception):
    """Base of the two decode failures."""


class FrameError(ProtocolError):
    """The frame is not a request at all; answer with error_msg(ERR_BAD_REQUEST, str(exc))."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(ProtocolError):
    """A request with a usable id has an invalid field; `message` starts with "<field>: "."""

    def __init__(self, id: RequestId | None, field: str, message: str):
        if not message.startswith(field + ":"):
            message = f"{field}: {message}"
        super().__init__(message)
        self.id, self.field, self.message = id, field, message


# ---------------------------------------------------------------- decoding


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _unpack(frame: bytes) -> Any:
    """msgpack.unpackb with every size bounded by the frame; all failures become FrameError."""
    n = len(frame)
    containers = 0

    def count(container):
        nonlocal containers
        containers += 1
        if containers > MAX_CONTAINERS_PER_FRAME:
            raise ValueError(f"more than {MAX_CONTAINERS_PER_FRAME} maps/arrays in one frame")
        return container

    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=n,
            list_hook=count,
            object_hook=count,
        )
    # ExtraData, FormatError, StackError (ValueError subclasses), UnicodeDecodeError,
    # OverflowError, TypeError, RecursionError from the pure-Python fallback, ...
    except Exception as exc:
        raise FrameError(
            f"frame is not valid msgpack: {type(exc).__name__}: {clipped_repr(str(exc), 120)}"
        ) from None


def _check_id(obj: dict, op: str, limits: Limits) -> RequestId:
    """A missing/invalid id leaves nothing to answer to, so it is a FrameError."""
    if "id" not in obj:
        raise FrameError(f"{op}: missing 'id'")
    rid = obj["id"]
    if isinstance(rid, str):
        if not 1 <= len(rid) <= limits.max_id_len:
            raise FrameError(f"{op}: 'id' must be a str of 1..{limits.max_id_len} characters, got {len(rid)}")
        return rid
    if _is_int(rid):
        if not INT64_MIN <= rid <= INT64_MAX:
            raise FrameError(f"{op}: 'id' int must fit in int64, got {clipped_repr(rid)}")
        return rid
    raise FrameError(f"{op}: 'id' must be a str or an int, got {type(rid).__name__}")


def _int_field(value: Any, rid: RequestId, name: str, lo: int, hi: int) -> int:
    if not _is_int(value) or not lo <= value <= hi:
        raise BadRequest(rid, name, f"must be an int in [{lo}, {hi}], got {clipped_repr(value)}")
    return value


def check_context(
    prompt_len: int,
    max_tokens: int,
    limits: Limits,
    *,
    request_id: RequestId | None = None,
    field: str = "prompt",
) -> None:
    """Raise BadRequest unless prompt_len + max_tokens fits max_context (servers call it after tokenizing)."""
    if prompt_len + max_tokens > limits.max_context:
        raise BadRequest(
            request_id,
            field,
            f"prompt length {prompt_len} + max_tokens {max_tokens} exceeds max_context {limits.max_context}",
        )


def resolve_max_tokens(
    prompt_len: int,
    max_tokens: int | None,
    limits: Limits,
    *,
    request_id: RequestId | None = None,
    field: str = "prompt",
) -> int:
    """The max_tokens a request runs with, once its prompt is tokenized: its own (checked by
    check_context), or for None (1.3) the rest of the context, at most limits.default_max_tokens
    and limits.max_tokens_cap.  BadRequest naming the prompt's `field` when it does not fit."""
    if max_tokens is not None:
        check_context(prompt_len, max_tokens, limits, request_id=request_id, field=field)
        return max_tokens
    room = limits.max_context - prompt_len
    if room < 1:
        raise BadRequest(
            request_id,
            field,
            f"prompt length {prompt_len} leaves no room to generate within max_context "
            f"{limits.max_context} (max_tokens was not given: the rest of the context)",
        )
    return min(room, limits.max_tokens_cap, limits.default_max_tokens or room)


# every field of generate: its own, then the sampling fields (their declaration's)
GENERATE_FIELDS = (
    "op", "id", "prompt", "prompt_ids", "messages", "priority", "timeout_ms", "detokenize", "structured",
) + EXTENSION_FIELDS + WIRE_FIELDS  # fmt: skip
_KNOWN_GENERATE_FIELDS = frozenset(GENERATE_FIELDS)


def _refuse_unknown_fields(obj: dict, rid: RequestId) -> None:
    """1.4: a generate field this server does not know is refused, never dropped (a sampling
    setting it cannot honour must not pass unnoticed); nil counts as absent."""
    for key, value in obj.items():
        if key not in _KNOWN_GENERATE_FIELDS and value is not None:
            name = key if isinstance(key, str) and len(key) <= 64 else clipped_repr(key)
            raise BadRequest(
                rid,
                name,
                f"unknown field; this server (protocol {PROTOCOL_VERSION}.{PROTOCOL_REVISION}) knows: "
                + ", ".join(GENERATE_FIELDS),
            )


def _sampling(obj: dict, rid: RequestId, limits: Limits) -> tuple[SamplingParams, StructuredSpec | None]:
    """The sampling fields, judged by their declaration (ringleader.ipc.sampling_params) and
    against the model and the server's cap, and the output's constraint (1.8)."""
    try:
        sampling = sampling_from_wire(obj)
        sampling.check_for_model(limits.vocab_size, limits.max_tokens_cap, limits.prompt_logprobs)
        structured = structured_from_wire(obj.get("structured"))
    except SamplingError as err:  # a StructuredError is one
        said = in_server_range(err, limits.max_tokens_cap)
        raise BadRequest(rid, said.field, said.reason) from None
    return sampling, structured


def _decode_generate(obj: dict, limits: Limits) -> GenerateRequest:
    rid = _check_id(obj, OP_GENERATE, limits)
    _refuse_unknown_fields(obj, rid)
    sampling, structured = _sampling(obj, rid, limits)

    try:
        prompt, prompt_ids, messages = prompt_input(obj, limits)
    except (InputError, ChatTurnsError) as err:
        raise BadRequest(rid, err.field, err.reason) from None
    if prompt_ids is not None and sampling.max_tokens is not None:
        check_context(len(prompt_ids), sampling.max_tokens, limits, request_id=rid, field="prompt_ids")

    priority = _int_field(obj.get("priority", 0), rid, "priority", limits.min_priority, limits.max_priority)
    timeout_ms = obj.get("timeout_ms")
    if timeout_ms is not None:
        timeout_ms = _int_field(timeout_ms, rid, "timeout_ms", 1, limits.max_timeout_ms)
    detokenize = obj.get("detokenize")
    if detokenize is not None and not isinstance(detokenize, bool):
        raise BadRequest(rid, "detokenize", f"must be true or false, got {clipped_repr(detokenize)}")
    try:
        extensions = check_extensions(obj, messages)
    except ExtensionError as err:
        raise BadRequest(rid, err.field, err.reason) from None
    return GenerateRequest(
        rid, prompt, prompt_ids, sampling, priority, timeout_ms, messages, detokenize is not False, structured,
        **extensions,
    )  # fmt: skip


def _decode_abort(obj: dict, limits: Limits) -> AbortRequest:
    """An abort gets no `done` of its own (its request's `done` is the answer), so a bad field is
    a FrameError: the `error` op answers it, and the request it names goes on untouched."""
    rid = _check_id(obj, OP_ABORT, limits)
    reason = obj.get("finish_reason")
    index = obj.get("index")
    if index is not None and (not _is_int(index) or not 0 <= index <= MAX_CHOICE_INDEX):
        raise FrameError(
            f"abort: index: must be a choice index in [0, {MAX_CHOICE_INDEX}], got {clipped_repr(index)} "
            f"(the abort of id {clipped_repr(rid)} was not applied)"
        )
    if reason is None:
        return AbortRequest(rid, FINISH_ABORT, index)
    if not isinstance(reason, str) or reason not in ABORT_FINISH_REASONS:
        raise FrameError(
            f'abort: finish_reason: must be "abort" or "stop", got {clipped_repr(reason)} '
            f"(the abort of id {clipped_repr(rid)} was not applied)"
        )
    return AbortRequest(rid, reason, index)


def _timeline_after_seq(value: Any) -> int:
    """stats.timeline_after_seq (1.6), nil counting as absent (0).  A stats has no id to answer,
    so a bad value is a FrameError: the `error` op names the field, and nothing else changes."""
    if value is not None and (not _is_int(value) or not 0 <= value <= INT64_MAX):
        raise FrameError(f"stats: timeline_after_seq: must be an int in [0, 2^63), got {clipped_repr(value)}")
    return value or 0


def decode_request(frame: bytes, limits: Limits | None = None) -> Request:
    """Decode one client frame; raises only FrameError or BadRequest."""
    if limits is None:
        limits = Limits()
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise FrameError(f"frame must be bytes, got {type(frame).__name__}")
    size = len(frame) if not isinstance(frame, memoryview) else frame.nbytes
    if size > limits.max_frame_bytes:  # checked before msgpack sees a single byte
        raise FrameError(f"frame is {size} bytes, limit is {limits.max_frame_bytes}")
    if size == 0:
        raise FrameError("frame is empty")
    obj = _unpack(bytes(frame))
    if not isinstance(obj, dict):
        raise FrameError(f"frame must be a msgpack map, got {type(obj).__name__}")
    op = obj.get("op")
    if not isinstance(op, str):
        raise FrameError(f"missing or invalid 'op' (must be a str), got {clipped_repr(op)}")
    if op == OP_GENERATE:
        return _decode_generate(obj, limits)
    if op == OP_ABORT:
        return _decode_abort(obj, limits)
    if op == OP_STATS:
        return StatsRequest(_timeline_after_seq(obj.get("timeline_after_seq")))
    if op == OP_PING:
        return PingRequest()
    if op == OP_HELLO:
        batch = obj.get("batch")
        if batch is not None and not isinstance(batch, bool):
            raise FrameError(f"hello: batch: must be true or false, got {clipped_repr(batch)}")
        return HelloRequest(batch is True)
    if op in TOKENIZE_OPS:  # 1.10: a bad field is answered on the op's own reply (tokenize_ops.py)
        return decode_tokenize_op(op, obj, _check_id(obj, op, limits), limits)
    raise FrameError(f"unknown op {clipped_repr(op)}")


# ---------------------------------------------------------------- encoding


def pack_default(obj: Any) -> Any:
    """Let numpy-style scalars through: anything with __index__ packs as int, __float__ as float."""
    if hasattr(obj, "__index__"):
        return obj.__index__()
    if hasattr(obj, "__float__"):
        return float(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} in a protocol message")


def encode(msg: dict) -> bytes:
    """One message -> one frame."""
    return msgpack.packb(msg, use_bin_type=True, default=pack_default)


def generate_msg(req: GenerateRequest) -> dict:
    """Wire map for a GenerateRequest (prompt, prompt_ids or messages, whichever is set): the one encoder of
    the generate message, which both clients use.  Values are judged by the server's decoder, but
    priority and timeout_ms here too, against its ranges (ValueError naming the field: a huge int
    would not even pack); the 1.9 extensions go out only where they differ from their defaults."""
    check_int_field("priority", req.priority, _RANGES.min_priority, _RANGES.max_priority)
    if req.timeout_ms is not None:
        check_int_field("timeout_ms", req.timeout_ms, 1, _RANGES.max_timeout_ms)
    msg: dict[str, Any] = {"op": OP_GENERATE, "id": req.id}
    if req.messages is not None:
        msg["messages"] = req.messages
    if req.prompt is not None:
        msg["prompt"] = req.prompt
    if req.prompt_ids is not None:
        ids = req.prompt_ids
        msg["prompt_ids"] = ids if isinstance(ids, list) else list(ids)
    msg.update(req.sampling.wire_fields(), priority=req.priority)
    if req.timeout_ms is not None:
        msg["timeout_ms"] = req.timeout_ms
    if not req.detokenize:  # sent only when asked, so an older server reads every other frame
        msg["detokenize"] = False
    if req.structured is not None:
        msg["structured"] = req.structured.wire()
    extensions = wire_fields({name: getattr(req, name) for name in EXTENSION_FIELDS})
    check_extensions(extensions, req.messages)  # as the decoder (ExtensionError, a ValueError naming it)
    msg.update(extensions)
    return msg


def abort_msg(id: RequestId, finish_reason: str = FINISH_ABORT, index: int | None = None) -> dict:
    """finish_reason: what the request's `done` is to say, "abort" or "stop" (1.3); a plain abort
    leaves the field out, as every revision reads it.  index: only that choice (1.5)."""
    msg: dict[str, Any] = {"op": OP_ABORT, "id": id}
    if finish_reason != FINISH_ABORT:
        msg["finish_reason"] = finish_reason
    if index is not None:
        msg["index"] = index
    return msg


def stats_request_msg(timeline_after_seq: int | None = None) -> dict:
    """timeline_after_seq (1.6): the device timeline's figures cover only the steps whose seq
    (step + 1) is above it; None or 0 leaves the field out (the frame of every revision)."""
    if not timeline_after_seq:
        return {"op": OP_STATS}
    return {"op": OP_STATS, "timeline_after_seq": timeline_after_seq}


def ping_msg() -> dict:
    return {"op": OP_PING}


def hello_msg(batch: bool = True) -> dict:
    """A client's hello (1.7): batch asks for `batch` frames on this connection."""
    return {"op": OP_HELLO, "batch": batch}


def hello_reply_msg(batch: bool) -> dict:
    """The server's answer to a hello: its revision, and whether it sends `batch` frames now."""
    return {"op": OP_HELLO, "protocol": f"{PROTOCOL_VERSION}.{PROTOCOL_REVISION}", "batch": batch}


def encode_request(req: Request) -> bytes:
    """Typed request -> frame; the inverse of decode_request for valid requests."""
    if isinstance(req, GenerateRequest):
        return encode(generate_msg(req))
    if isinstance(req, AbortRequest):
        return encode(abort_msg(req.id, req.finish_reason, req.index))
    if isinstance(req, StatsRequest):
        return encode(stats_request_msg(req.timeline_after_seq))
    if isinstance(req, PingRequest):
        return encode(ping_msg())
    if isinstance(req, HelloRequest):
        return encode(hello_msg(req.batch))
    raise TypeError(f"not a request: {type(req).__name__}")


def token_msg(
    id: RequestId,
    token_ids: list[int],
    text: str | None = None,
    *,
    index: int | None = None,
    logprobs: list[dict] | None = None,
    finish_reason: str | None = None,
) -> dict:
    """index: the choice, for a request with n > 1 (1.5); logprobs: one entry per token id
    (docs/protocol.md), for a request that asked; finish_reason: this frame ends its choice (n > 1)."""
    msg: dict[str, Any] = {"op": OP_TOKEN, "id": id, "token_ids": list(token_ids)}
    if text is not None:
        msg["text"] = text
    if index is not None:
        msg["index"] = index
    if logprobs is not None:
        msg["logprobs"] = logprobs
    if finish_reason is not None:
        msg["finish_reason"] = finish_reason
    return msg


def done_msg(
    id: RequestId | None,  # None only for a bad request whose id could not be read
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    error_code: str | None = None,
    error_message: str | None = None,
    choices: list[dict] | None = None,
) -> dict:
    """`error` is present exactly when finish_reason is "error" (then error_code is required).
    choices: a request with n > 1: [{index, finish_reason, completion_tokens}] (1.5)."""
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"unknown finish_reason {finish_reason!r}")
    msg: dict[str, Any] = {
        "op": OP_DONE,
        "id": id,
        "finish_reason": finish_reason,
        "usage": {"prompt_tokens": int(prompt_tokens), "completion_tokens": int(completion_tokens)},
    }
    if finish_reason == FINISH_ERROR:
        if error_code is None:
            raise ValueError('finish_reason "error" needs an error_code')
        msg["error"] = {"code": error_code, "message": error_message or ""}
    elif error_code is not None or error_message is not None:
        raise ValueError(f"error details only go with finish_reason 'error', not {finish_reason!r}")
    if choices is not None:
        msg["choices"] = choices
    return msg


def error_msg(code: str, message: str) -> dict:
    """Reply to a frame that is not a request at all (there is no id to answer to)."""
    return {"op": OP_ERROR, "id": None, "code": code, "message": message}


def pong_msg() -> dict:
    return {"op": OP_PONG}


def _string_keys(value: Any) -> Any:
    """Every map key on the wire is a string (clients decode with strict map keys): a backend's
    figures keyed by number (step graphs per bucket) go out as JSON would write them."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _string_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_string_keys(v) for v in value]
    return value


def stats_msg(stats: dict) -> dict:
    msg = _string_keys(stats)
    msg["op"] = OP_STATS
    return msg


def reject_msg(exc: ProtocolError) -> dict:
    """The reply a server sends for a decode failure: a `done` for BadRequest, an `error` op for FrameError."""
    if isinstance(exc, BadRequest):
        return done_msg(exc.id, FINISH_ERROR, 0, 0, ERR_BAD_REQUEST, exc.message)
    return error_msg(ERR_BAD_REQUEST, str(exc))


def decode_reply(frame: bytes) -> dict:
    """Client side: a server frame -> its map; raises FrameError for anything that is not a reply map."""
    obj = _unpack(bytes(frame))
    if not isinstance(obj, dict) or obj.get("op") not in REPLY_OPS:
        raise FrameError("server frame is not a reply map")
    return obj
