"""The OpenAI HTTP API's requests, without I/O: a JSON body in, a typed request out (or an
APIError naming the field); the bytes of their answers are responses.py's.

What is accepted is what ringleader can honour: `best_of`, `logit_bias`, `suffix`, tools and
non-text content are refused with a 400 naming the field rather than silently ignored, and so
is any body field the gateway does not know (vllm serve ignores those, so a sampling knob it
lacks would pass unnoticed).  The sampling fields, their OpenAI names and defaults come from
their declaration (ringleader.ipc.sampling_params), `n` and `logprobs` (chat's `logprobs` +
`top_logprobs`) among them; vLLM's extensions among them: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`.  vLLM's other request extensions
(`include_stop_str_in_output`, `skip_special_tokens`, `chat_template_kwargs`...) are
generate_options.py's.  The gateway's own: `return_token_ids` (each choice carries the ids of its
tokens), `priority`.  A completion's prompts (a batch among them), `echo` and vLLM's
`prompt_logprobs` are prompts.py's.  check_request adds what depends on the served model: its
name, and the ranges the server judges against it (SamplingParams.check_for_model: max_tokens
within the server's cap, which every message about max_tokens then states).

The output's constraint (protocol 1.8's `structured`, enforced on the device) comes from one of
OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` or vLLM's
older `guided_json` / `guided_regex` / `guided_choice`, on both endpoints (vLLM takes
`response_format` on completions too); grammars are refused by name, and so are two constraints at once.
"""

from __future__ import annotations

import hmac
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from ringleader.hostctl.gateway.errors import PARAM_OF_FIELD as PARAM_OF_FIELD
from ringleader.hostctl.gateway.errors import STATUS_OF_CODE as STATUS_OF_CODE
from ringleader.hostctl.gateway.errors import APIError, bad, structured_param_of
from ringleader.hostctl.gateway.generate_options import CHAT_OPTIONS, COMPLETIONS_OPTIONS, generate_options
from ringleader.hostctl.gateway.prompts import Prompt, completion_prompts, scoring_options
from ringleader.ipc import protocol as P
from ringleader.ipc.request_extensions import CHAT_FIELDS as CHAT_TEMPLATE_OPTIONS
from ringleader.ipc.sampling_params import (
    FIELDS,
    OPENAI_FIELDS,
    SamplingError,
    SamplingParams,
    clipped_repr,
    in_server_range,
    sampling_from_openai,
)
from ringleader.ipc.structured import StructuredError, StructuredSpec, structured_from_wire

# the body fields each endpoint takes besides the sampling fields (OPENAI_FIELDS): those the
# gateway honours, or refuses unless their value asks for nothing, and OpenAI's no-ops (_no_op_fields)
_HANDLED = (
    "model",
    "stream",
    "stream_options",
    "stop",
    "logit_bias",
    "return_token_ids",
    "priority",
)
_NO_OPS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
# the fields that constrain the output (_structured), in the order a conflict between them is told
CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# vLLM's older knobs of its constraints: a backend's name (ignored: there is one compiler) and a
# JSON whitespace pattern (refused unless null)
_GUIDED_OPTIONS = ("guided_decoding_backend", "guided_whitespace_pattern")
CHAT_FIELDS = OPENAI_FIELDS.union(
    _HANDLED,
    _NO_OPS,
    CONSTRAINT_FIELDS,
    _GUIDED_OPTIONS,
    CHAT_OPTIONS,
    ("messages", "top_logprobs", "tools", "tool_choice"),
)
COMPLETIONS_FIELDS = OPENAI_FIELDS.union(
    _HANDLED,
    _NO_OPS,
    CONSTRAINT_FIELDS,
    _GUIDED_OPTIONS,
    COMPLETIONS_OPTIONS,
    ("prompt", "best_of", "echo", "suffix"),
)
# the chat-only options /v1/completions refuses by name (generate_options), not as unknown
_CHAT_ONLY_OPTIONS = frozenset(CHAT_TEMPLATE_OPTIONS)
MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256


@dataclass(slots=True)
class GenerationRequest:
    """One OpenAI request, checked and translated to what AsyncClient.generate takes."""

    chat: bool
    model: str | None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    priority: int = 0
    structured: StructuredSpec | None = None  # the output's constraint (protocol 1.8)
    structured_param: str | None = None  # the field it came from, which the server's refusals are told in
    # AsyncClient.generate's keywords for vLLM's extensions, those not at their defaults
    generate_options: dict[str, Any] = field(default_factory=dict)
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text (vLLM's)
    batch: list[Prompt] | None = None  # a completion's prompts when it sent more than one
    echo: bool = False  # the choice's text (and logprobs) start with the prompt's
    prompt_logprobs_asked: bool = False  # vLLM's prompt_logprobs are answered beside the choices


# ---------------------------------------------------------------- parsing


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, default: Any, lo: int, hi: int) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise bad(name, f"must be an integer in [{lo}, {hi}], got {clipped_repr(v)}")
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {clipped_repr(v)}")
    return v


def _refuse_unless_default(body: dict, name: str, allowed: tuple[Any, ...], why: str) -> None:
    value = body.get(name)
    # a bool matches only a bool: `best_of: true` is not best_of = 1
    if not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
        raise bad(name, f"{why}; got {clipped_repr(value)}")


def _refuse_unknown_fields(body: dict, chat: bool) -> None:
    """A body field the gateway does not know is refused, not ignored as vllm serve does: a
    sampling knob it lacks (mirostat, typical_p...) would pass unnoticed."""
    known = CHAT_FIELDS if chat else COMPLETIONS_FIELDS
    for name, value in body.items():
        if value is not None and name not in known and (chat or name not in _CHAT_ONLY_OPTIONS):
            shown = name if len(name) <= 64 else clipped_repr(name)
            raise bad(
                shown,
                "unknown field (vllm serve ignores it; ringleader refuses what it cannot honour). "
                f"This endpoint takes: {', '.join(sorted(known))}",
            )


def _no_op_fields(body: dict) -> None:
    """OpenAI's fields that change nothing here, accepted while their value asks for nothing
    more (user, metadata: labels; store: no completion is stored; no tools are called)."""
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"must be a string, got {clipped_repr(user)}")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("metadata", f"must be an object, got {clipped_repr(metadata)}")
    _refuse_unless_default(body, "store", (None, False), "completions are not stored")
    _refuse_unless_default(body, "service_tier", (None, "auto", "default"), "only the default tier is served")
    _bool(body, "parallel_tool_calls")


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
        raise bad(f"{where}.content", "is required: a string or an array of text parts")
    raise bad(f"{where}.content", f"must be a string or an array of text parts, got {clipped_repr(value)}")


def chat_messages(body: dict) -> list[dict[str, str]]:
    """Chat's `messages` (and /tokenize's), checked: roles, text content (parts joined)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty array of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"must be an object, got {clipped_repr(m)}")
        role = m.get("role")
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system turn
        if role not in ("system", "user", "assistant"):
            raise bad(
                f"{where}.role", f"must be system, developer, user or assistant, got {clipped_repr(role)}"
            )
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
        raise bad("stop", f"must be a string or an array of strings, got {clipped_repr(s)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for x in stops:
        if not 1 <= len(x) <= MAX_STOP_STRING_CHARS:
            raise bad("stop", f"each string must have 1..{MAX_STOP_STRING_CHARS} characters")
    return tuple(dict.fromkeys(stops))


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad("stream_options", "is only allowed with stream: true")
    if not isinstance(opts, dict):
        raise bad("stream_options", f"must be an object, got {clipped_repr(opts)}")
    return _bool(opts, "include_usage")


def parse_request(body: Any, *, chat: bool) -> GenerationRequest:
    """The checked request of /v1/completions (chat False) or /v1/chat/completions (chat True)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _refuse_unknown_fields(body, chat)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"must be a string, got {clipped_repr(model)}")
    _refuse_unless_default(body, "logit_bias", (None, {}), "logit_bias is not supported")
    if chat:
        _refuse_unless_default(body, "tools", (None, []), "tools are not supported")
        _refuse_unless_default(body, "tool_choice", (None, "none"), "tools are not supported")
    else:
        _refuse_unless_default(
            body, "best_of", (None, 1), "best_of is not supported; send n and pick the best yourself"
        )
        _refuse_unless_default(body, "suffix", (None, ""), "suffix is not supported")
    _no_op_fields(body)
    stream = _bool(body, "stream")
    req = GenerationRequest(chat=chat, model=model, stream=stream)
    if chat:
        req.messages = chat_messages(body)
    else:
        prompts = completion_prompts(body)
        req.prompt, req.prompt_ids = prompts[0]
        req.batch = prompts if len(prompts) > 1 else None
    try:
        sampling = sampling_from_openai(body, "chat" if chat else "completions")
    except SamplingError as err:
        raise APIError(400, str(err), param=err.field) from None
    req.sampling, req.echo, req.prompt_logprobs_asked = scoring_options(
        body, sampling, chat=chat, stream=stream
    )
    req.stop = _stop(body)
    req.include_usage = _stream_options(body, stream)
    req.return_token_ids = _bool(body, "return_token_ids")
    req.priority = _int(body, "priority", 0, -1000, 1000)
    req.structured, req.structured_param = _structured(body)
    req.generate_options, req.include_stop_str_in_output = generate_options(body, chat=chat)
    return req


# ---------------------------------------------------------------- the output's constraint

# vLLM's older top-level fields, each one key of the wire's `structured` map
_GUIDED_KINDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# structured_outputs' options beside its constraint (vLLM's StructuredOutputsParams) and the values
# this server honours: it has one compiler that never falls back, and no knobs for JSON's shape
_STRUCTURED_OPTIONS: dict[str, tuple[Any, ...]] = {
    "disable_fallback": (None, False, True),
    "disable_any_whitespace": (None, False),
    "disable_additional_properties": (None, False),
    "whitespace_pattern": (None,),
}
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def _judged(wire: dict[str, Any], source: str) -> StructuredSpec | None:
    """The wire's `structured` map judged as the server's decoder judges it (ipc/structured.py),
    a refusal naming the request's field."""
    try:
        return structured_from_wire(wire)
    except StructuredError as err:
        raise bad(structured_param_of(err.field, source), err.reason) from None


def _response_format(rf: Any) -> tuple[StructuredSpec | None, str]:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema with its schema."""
    types = "text, json_object or json_schema"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad("response_format", f"must be an object with a type ({types}), got {clipped_repr(rf)}")
    kind = rf["type"]
    allowed = ("type", "json_schema") if kind == "json_schema" else ("type",)
    for key in rf:
        if key not in allowed:
            raise bad(f"response_format.{key}", f"unknown field for type {kind}")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return StructuredSpec("json_object"), "response_format"
    if kind != "json_schema":
        raise bad("response_format.type", f"must be {types}, got {clipped_repr(kind)}")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", f"must be an object with a schema, got {clipped_repr(spec)}")
    for key in spec:
        if key not in _JSON_SCHEMA_KEYS:
            raise bad(
                f"response_format.json_schema.{key}",
                f"unknown field; it takes {', '.join(_JSON_SCHEMA_KEYS)}",
            )
    # name and description label the schema; strict changes nothing: the device enforces every schema
    for key, kind, kind_name in (
        ("name", str, "a string"),
        ("description", str, "a string"),
        ("strict", bool, "true or false"),
    ):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise bad(
                f"response_format.json_schema.{key}", f"must be {kind_name}, got {clipped_repr(spec[key])}"
            )
    where = "response_format.json_schema.schema"
    if spec.get("schema") is None:
        raise bad(where, "is required: the JSON schema the output must follow")
    return _judged({"json": spec["schema"]}, where), where


def _structured_outputs(value: Any) -> StructuredSpec | None:
    """vLLM's structured_outputs: one constraint key, and the options this server honours."""
    if not isinstance(value, dict):
        raise bad(
            "structured_outputs", f"must be an object such as {{'json': schema}}, got {clipped_repr(value)}"
        )
    for name, allowed in _STRUCTURED_OPTIONS.items():
        got = value.get(name)
        if not any(got is a for a in allowed):  # `is`: 0 is not false here
            shown = " or ".join("null" if a is None else str(a).lower() for a in allowed)
            raise bad(
                f"structured_outputs.{name}", f"this server takes only {shown}; got {clipped_repr(got)}"
            )
    return _judged({k: v for k, v in value.items() if k not in _STRUCTURED_OPTIONS}, "structured_outputs")


def _structured(body: dict) -> tuple[StructuredSpec | None, str | None]:
    """The output's constraint and the field that gave it, from at most one of CONSTRAINT_FIELDS
    (two at once is a 400 naming both); (None, None): unconstrained."""
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise bad("guided_decoding_backend", f"must be a string, got {clipped_repr(backend)}")
    if body.get("guided_whitespace_pattern") is not None:
        raise bad(
            "guided_whitespace_pattern", "is not supported: JSON constraints allow their default whitespace"
        )
    found: list[tuple[str, StructuredSpec, str]] = []
    for name in CONSTRAINT_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if name == "response_format":
            spec, where = _response_format(value)
        elif name == "structured_outputs":
            spec, where = _structured_outputs(value), name
        else:
            spec, where = _judged({_GUIDED_KINDS[name]: value}, name), name
        if spec is not None:
            found.append((name, spec, where))
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise bad(second, f"conflicts with {first}: give one constraint on the output")
    return (found[0][1], found[0][2]) if found else (None, None)


@dataclass(frozen=True)
class ServedModel:
    """What a front end serves, as the upstream reported it: the name requests must name (or
    omit), the context limit /v1/models shows and whether stop strings can be matched."""

    name: str
    max_model_len: int | None = None
    has_tokenizer: bool = True
    vocab_size: int | None = None  # unknown: token ids are left to the server to judge
    max_tokens_cap: int | None = None  # the most max_tokens the server takes (None: max_model_len)

    @property
    def tokens_cap(self) -> int | None:
        return self.max_tokens_cap or self.max_model_len

    @classmethod
    def from_stats(cls, stats: dict[str, Any], served_name: str | None = None) -> ServedModel:
        """From a server's `stats` reply; `served_name` replaces the server's own name."""
        info = stats.get("model_info") or {}
        return cls(
            name=served_name or str(stats.get("model", "ringleader")),
            max_model_len=info.get("max_context") or (stats.get("backend") or {}).get("max_ctx"),
            has_tokenizer=bool(info.get("tokenizer", True)),
            vocab_size=info.get("vocab_size"),
            max_tokens_cap=info.get("max_tokens_cap"),
        )


def check_request(raw_body: bytes, *, chat: bool, model: ServedModel) -> GenerationRequest:
    """A generation request's body, parsed and checked against the served model: what every
    front end (the aiohttp gateway, the Ray Serve ingress) answers alike."""
    try:
        body = json.loads(raw_body)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    try:
        req = parse_request(body, chat=chat)
    except APIError as err:
        raise _in_served_range(err, model) from None
    if req.model is not None and req.model != model.name:
        raise model_not_found(req.model, model.name)
    if req.echo and not model.has_tokenizer:
        raise bad("echo", "needs a model with a tokenizer: the prompt is echoed as text")
    if req.stop and not model.has_tokenizer:
        raise bad("stop", "stop strings need a model with a tokenizer; send stop_token_ids")
    if req.structured is not None and not model.has_tokenizer:  # its automaton is built from token texts
        field = (req.structured_param or "structured_outputs").split(".", 1)[0]
        raise bad(field, "structured output needs a model with a tokenizer")
    _check_for_model(req, body, model)
    return req


def _in_served_range(err: APIError, model: ServedModel) -> APIError:
    """A refusal of max_tokens' value (under any of its names), told with the range the server
    takes (sampling_params.in_server_range: its cap, not the declaration's bound of any server)."""
    cap, prefix = model.tokens_cap, f"{err.param}: "
    if cap is None or err.param is None or not err.message.startswith(prefix):
        return err
    said = in_server_range(SamplingError(err.param, err.message[len(prefix) :]), cap)
    return err if said.reason == err.message[len(prefix) :] else bad(said.field, said.reason)


def _check_for_model(req: GenerationRequest, body: dict, model: ServedModel) -> None:
    """What the server judges against its model (check_for_model: the cap, top_k and token ids
    within the vocabulary), judged here in its words and code, naming the field as the body did."""
    cap = model.tokens_cap
    if cap is None:
        return
    try:
        req.sampling.check_for_model(model.vocab_size or sys.maxsize, cap)
    except SamplingError as err:
        spec = next((s for s in FIELDS if s.name == err.field), None)
        names = spec.openai_names if spec is not None else ()
        param = next((n for n in names if body.get(n) is not None), err.field)
        raise APIError(400, f"{param}: {err.reason}", param=param, code=P.ERR_BAD_REQUEST) from None


def authorize(authorization: str, api_key: str | None) -> None:
    """Raises 401 unless `authorization` (the header's value) is "Bearer <api_key>"; no key: open."""
    if api_key is None:
        return
    if not hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode()):
        raise APIError(401, "invalid API key", type="invalid_request_error", code="invalid_api_key")


def model_object(name: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    """The served model as GET /v1/models lists it and GET /v1/models/{id} answers it."""
    entry: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "ringleader"}
    if max_model_len:
        entry["max_model_len"] = max_model_len
    return entry


def models_list(name: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(name, created, max_model_len)]}


def model_not_found(asked: str, served: str) -> APIError:
    """The 404 of a request (or a GET /v1/models/{id}) naming another model than the served one."""
    return APIError(
        404,
        f"the model {asked!r} does not exist; this gateway serves {served!r}",
        param="model",
        code="model_not_found",
    )
