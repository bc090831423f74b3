"""The request's sampling fields, declared once: how its tokens are chosen and when it stops.

`SamplingParams` is the declaration.  Each of its fields carries a `SamplingField` (its kind,
default, valid range, help, the names an OpenAI request gives it, its default there where the
OpenAI API's differs, and its scalar in the ring's `RlSampling`), and everything else is derived
from it:

- `SamplingParams(...)` judges every value against its range (SamplingError, a ValueError that
  names the field), so a value no server could run is refused in the caller's process;
- `sampling_from_wire` decodes a generate message's fields (the protocol decoder), and
  `sampling_from_openai` an OpenAI request body's (the HTTP gateway), each with the error words
  of `SamplingField.check`; `SamplingParams.check_for_model` adds what depends on the model and
  the server (top_k and token ids against the vocabulary, max_tokens against the server's cap);
- `RING_FIELDS` is the `RlSampling` struct the SQ entry, the slot and the step's per-sample array
  hold (ipc/layout.py), so the scheduler copies the struct whole and never names a field, and the
  step layout views one tensor per field (device/step/step_layout.py);
- `ringleader generate`'s options, the native clients' keywords and docs/protocol.md's table.

Adding a sampling field: declare it here, read it in the sampler (device/sampling/sampler.py),
test it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# top_k's upper bound: the device sampler draws top-k and top-p from this many candidates
# (device/sampling/sampler.py), so its cost does not grow with the vocabulary
MAX_TOP_K = 1024
# stop_token_ids carried in one SQ entry (ipc/layout.py sizes RlSqEntry.stop_ids with it)
MAX_STOP_TOKEN_IDS = 8
# the most alternatives a token's logprobs carry (vLLM's default max_logprobs); the ring's
# RlLogprobs record holds this many (ipc/layout.py)
MAX_LOGPROBS = 20
# the most choices one request asks for (OpenAI's bound on n)
MAX_N = 128
# The largest finite float32 (numpy.finfo(numpy.float32).max): the ring holds the float fields as
# float32 (RlSampling), where anything larger becomes +inf.
FLOAT32_MAX = 3.4028234663852886e38
UINT32_MAX = (1 << 32) - 1
INT32_MAX = (1 << 31) - 1
UINT64_MAX = (1 << 64) - 1
# the two OpenAI endpoints whose defaults may differ (SamplingField.api_defaults)
APIS = ("chat", "completions")


def clipped_repr(value: Any, limit: int = 60) -> str:
    """repr() clipped so hostile values cannot blow up an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SamplingError(ValueError):
    """A sampling field's value refused: `field` (as the request named it) and why; str() is
    "<field>: <reason>", the protocol's and the gateway's error words alike."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


@dataclass(frozen=True, slots=True)
class FloatRange:
    low: float
    high: float
    low_open: bool = False  # (low, high] instead of [low, high]

    def __contains__(self, number: float) -> bool:
        above_low = self.low < number if self.low_open else self.low <= number
        return above_low and number <= self.high

    def __str__(self) -> str:
        return ("(" if self.low_open else "[") + f"{self.low:.8g}, {self.high:.8g}]"


@dataclass(frozen=True, slots=True)
class IntRange:
    low: int
    high: int

    def __contains__(self, number: int) -> bool:
        return self.low <= number <= self.high

    def __str__(self) -> str:
        return f"[{self.low}, {self.high}]"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingField:
    """One sampling field's declaration (the metadata of a SamplingParams field)."""

    kind: str  # "float", "int", "optional_int" (None allowed), "bool" or "token_ids"
    default: Any
    allowed: FloatRange | IntRange | None  # token_ids: each id's range
    help: str
    # names an OpenAI request body gives it, the first present wins (None: its own name)
    openai: tuple[str, ...] | None = None
    # its default in an OpenAI request where that API's differs from the native default
    api_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # its scalar in RlSampling (ipc/layout.py), the per-sample struct the sampler reads; None:
    # a field the scheduler itself acts on, with its own place in the SQ entry
    ring: str | None = None
    # a value other than the default asks the scheduler to keep the slot's token counts
    penalty: bool = False
    # what the ring holds for nil (an optional_int's None)
    ring_null: int = 0
    name: str = ""  # the SamplingParams field's name, filled in below

    @property
    def openai_names(self) -> tuple[str, ...]:
        return self.openai or (self.name,)

    @property
    def ring_default(self) -> Any:
        """The default as the ring holds it (nil as ring_null)."""
        return self.ring_null if self.default is None else self.default

    def default_for(self, api: str | None) -> Any:
        """The default of a native request (api None) or an OpenAI one ("chat", "completions")."""
        return self.api_defaults.get(api, self.default) if api else self.default

    def check(self, value: Any) -> Any:
        """`value` in its canonical form (a float for "float", a tuple for "token_ids") if it is
        valid, else SamplingError naming the field."""
        name = self.name
        allowed = self.allowed
        if self.kind == "float":
            assert isinstance(allowed, FloatRange)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise SamplingError(name, f"must be a number in {allowed}, got {clipped_repr(value)}")
            try:
                number = float(value)
            except OverflowError:  # an int beyond any float
                number = math.inf
            if number not in allowed:  # NaN and the infinities are in no range
                raise SamplingError(name, f"must be a finite number in {allowed}, got {clipped_repr(value)}")
            return number
        if self.kind in ("int", "optional_int"):
            assert isinstance(allowed, IntRange)
            if value is None and self.kind == "optional_int":
                return None
            if not _is_int(value) or value not in allowed:
                null = "null or " if self.kind == "optional_int" else ""
                raise SamplingError(name, f"must be {null}an int in {allowed}, got {clipped_repr(value)}")
            return int(value)
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise SamplingError(name, f"must be true or false, got {clipped_repr(value)}")
            return value
        assert self.kind == "token_ids" and isinstance(allowed, IntRange)
        if not isinstance(value, (list, tuple)):
            raise SamplingError(name, f"must be an array of token ids, got {clipped_repr(value)}")
        if len(value) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(name, f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(value)}")
        for index, token in enumerate(value):
            if not _is_int(token) or token not in allowed:
                raise SamplingError(
                    name, f"element {index} must be a token id in {allowed}, got {clipped_repr(token)}"
                )
        return tuple(int(t) for t in value)

    def describe_allowed(self) -> str:
        if self.kind == "token_ids":
            return f"at most {MAX_STOP_TOKEN_IDS} ids, each in `[0, vocab_size)`"
        if self.kind == "bool":
            return "`true` or `false`"
        text = f"`{self.allowed}`"
        return text + " or nil" if self.kind == "optional_int" else text


def _declare(default: Any, kind: str, allowed: FloatRange | IntRange | None, help: str, **more: Any) -> Any:
    return dataclasses.field(
        default=default, metadata={"spec": SamplingField(kind, default, allowed, help, **more)}
    )


# fmt: off
@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's sampling settings.  The fields, in this order, are the declaration."""

    max_tokens: int | None = _declare(
        None, "optional_int", IntRange(0, UINT32_MAX),
        "most tokens to generate (0: none, the prompt is only scored: with prompt_logprobs); nil: "
        "the rest of the model's context, at most the server's --default-max-tokens (every server "
        "caps it at its context)",
        openai=("max_completion_tokens", "max_tokens"), api_defaults={"completions": 16})
    min_tokens: int = _declare(
        0, "int", IntRange(0, INT32_MAX),
        "until this many tokens are generated, the model's end tokens cannot be drawn (vLLM's); at "
        "most max_tokens when that is given; not yet with stop_token_ids; 0 is off", ring="i32")
    temperature: float = _declare(
        0.0, "float", FloatRange(0.0, FLOAT32_MAX),
        "0 picks the most likely token (greedy); higher samples more freely. vLLM's range: no "
        "upper bound but float32's", api_defaults={"chat": 1.0, "completions": 1.0}, ring="f32")
    top_p: float = _declare(
        1.0, "float", FloatRange(0.0, 1.0, low_open=True),
        "sample from the smallest set of most likely tokens whose probability reaches this; 1 is off",
        ring="f32")
    top_k: int = _declare(
        0, "int", IntRange(-1, MAX_TOP_K),
        f"sample from this many of the most likely tokens; 0 or -1 is off (at most {MAX_TOP_K} "
        "and the vocabulary)", ring="i32")
    min_p: float = _declare(
        0.0, "float", FloatRange(0.0, 1.0),
        "keep only tokens at least this fraction as likely as the most likely one (after "
        "temperature); 0 is off", ring="f32")
    presence_penalty: float = _declare(
        0.0, "float", FloatRange(-2.0, 2.0),
        "subtracted from the logit of every token already generated (OpenAI's); 0 is off",
        ring="f32", penalty=True)
    frequency_penalty: float = _declare(
        0.0, "float", FloatRange(-2.0, 2.0),
        "subtracted from a token's logit once per time it was generated (OpenAI's); 0 is off",
        ring="f32", penalty=True)
    repetition_penalty: float = _declare(
        1.0, "float", FloatRange(0.0, FLOAT32_MAX, low_open=True),
        "divides a positive logit, multiplies a negative one, of every token in the prompt or "
        "the output (vLLM's); above 1 repeats less; 1 is off", ring="f32", penalty=True)
    seed: int | None = _declare(
        None, "optional_int", IntRange(0, UINT64_MAX),
        "the same seed and settings give the same tokens under any load; nil: the server draws one",
        ring="u64")
    stop_token_ids: tuple[int, ...] = _declare(
        (), "token_ids", IntRange(0, (1 << 31) - 1),
        "token ids that end the answer (finish_reason stop), besides the model's end tokens")
    ignore_eos: bool = _declare(
        False, "bool", None, "go on past the model's end tokens, up to max_tokens")
    logprobs: int | None = _declare(
        None, "optional_int", IntRange(0, MAX_LOGPROBS),
        "with each generated token, its log-probability and this many most likely alternatives "
        "with theirs (0: the token's alone), from the model's raw logits (before penalties and "
        "temperature, as vLLM's default); nil: none", ring="i32", ring_null=-1)
    prompt_logprobs: int | None = _declare(
        None, "optional_int", IntRange(0, MAX_LOGPROBS),
        "(1.10) with the request's first message, every prompt token's log-probability given the "
        "tokens before it and this many most likely alternatives (the first token's: nil), from "
        "the raw logits of its prefill (vLLM's prompt_logprobs); nil: none",
        ring="i32", ring_null=-1)
    n: int = _declare(
        1, "int", IntRange(1, MAX_N),
        "how many answers (choices) to generate for the prompt, each with its own seed stream "
        "(seed, seed + 1, ... when a seed is given); the prompt is prefilled once where the "
        "prefix cache is on")
    # fmt: on

    def __post_init__(self) -> None:
        for spec in FIELDS:
            object.__setattr__(self, spec.name, spec.check(getattr(self, spec.name)))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingError(
                "min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.min_tokens and self.stop_token_ids:  # the step masks the model's end ids only
            raise SamplingError(
                "min_tokens", "is not supported together with stop_token_ids yet; send one of them"
            )

    def with_seed(self, seed: int) -> SamplingParams:
        return self._with("seed", seed)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        return self._with("max_tokens", max_tokens)

    def without_prompt_logprobs(self) -> SamplingParams:
        return self if self.prompt_logprobs is None else self._with("prompt_logprobs", None)

    def _with(self, name: str, value: Any) -> SamplingParams:
        """A copy with one field judged anew, the others taken as they are (they were judged
        when this one was made): a request's seed and max_tokens are resolved per request, and
        judging every field again cost more than the rest of its admission."""
        value = FIELD[name].check(value)
        other = object.__new__(SamplingParams)
        for spec in FIELDS:
            object.__setattr__(other, spec.name, value if spec.name == name else getattr(self, spec.name))
        return other

    @property
    def penalized(self) -> bool:
        """Some penalty is on: the scheduler keeps this request's token counts."""
        return any(getattr(self, spec.name) != spec.default for spec in FIELDS if spec.penalty)

    def wire_fields(self) -> dict[str, Any]:
        """These settings as fields of the generate message (docs/protocol.md): those that differ
        from the default (the server fills in the rest, so an older server reads a frame that
        asks nothing new of it)."""
        out: dict[str, Any] = {}
        for spec in FIELDS:
            value = getattr(self, spec.name)
            if value != spec.default:
                out[spec.name] = list(value) if spec.kind == "token_ids" else value
        return out

    def ring_values(self) -> dict[str, Any]:
        """The RlSampling fields (RING_FIELDS) as the SQ entry stores them (an unseeded request's
        seed is resolved by the server before it gets here; None as the field's ring_null)."""
        values = {name: getattr(self, name) for name, _ in RING_FIELDS}
        return {name: FIELD[name].ring_null if value is None else value for name, value in values.items()}

    def check_for_model(self, vocab_size: int, max_tokens_cap: int, scores_prompts: bool = True) -> None:
        """SamplingError unless the model and the server can run these settings: top_k and the
        stop token ids within the vocabulary, max_tokens within the server's cap, prompt_logprobs
        only from a server that scores prompts."""
        if self.prompt_logprobs is not None and not scores_prompts:
            raise SamplingError(
                "prompt_logprobs",
                "this server scores no prompts (started with --prompt-logprobs-rows 0, or the null "
                "model on cuda); send nil",
            )
        if self.top_k > vocab_size:
            raise SamplingError("top_k", f"must be at most the vocabulary's {vocab_size}, got {self.top_k}")
        for index, token in enumerate(self.stop_token_ids):
            if token >= vocab_size:
                raise SamplingError(
                    "stop_token_ids", f"element {index} must be a token id in [0, {vocab_size}), got {token}"
                )
        if self.max_tokens is not None and self.max_tokens > max_tokens_cap:
            raise SamplingError("max_tokens", f"must be an int in [0, {max_tokens_cap}], got {self.max_tokens}")


def in_server_range(err: SamplingError, max_tokens_cap: int) -> SamplingError:
    """err, with max_tokens' range said as the server's [0, max_tokens_cap] (check_for_model's
    words), whatever the value's fault: one range in every message about max_tokens, under any
    of its names (the native one, OpenAI's)."""
    capped = FIELD["max_tokens"]
    if (err.field != capped.name and err.field not in capped.openai_names) or ", got " not in err.reason:
        return err
    got = err.reason[err.reason.index(", got ") :]
    return SamplingError(err.field, f"must be an int in [0, {max_tokens_cap}]{got}")


def _fields() -> tuple[SamplingField, ...]:
    out = []
    for f in dataclasses.fields(SamplingParams):
        spec = f.metadata["spec"]
        object.__setattr__(spec, "name", f.name)
        out.append(spec)
    return tuple(out)


FIELDS: tuple[SamplingField, ...] = _fields()
FIELD: dict[str, SamplingField] = {spec.name: spec for spec in FIELDS}
WIRE_FIELDS = tuple(FIELD)
# (name, scalar kind) of RlSampling, in declaration order
RING_FIELDS: tuple[tuple[str, str], ...] = tuple((s.name, s.ring) for s in FIELDS if s.ring)
# every body name an OpenAI request may use for a sampling field
OPENAI_FIELDS = frozenset(name for spec in FIELDS for name in spec.openai_names)


def sampling_from_wire(fields: Mapping[str, Any]) -> SamplingParams:
    """The sampling fields of a generate message (absent or nil: the default); SamplingError
    names the first bad one."""
    given = {spec.name: fields.get(spec.name) for spec in FIELDS}
    return SamplingParams(**{name: value for name, value in given.items() if value is not None})


def sampling_from_openai(body: Mapping[str, Any], api: str) -> SamplingParams:
    """The sampling fields of an OpenAI request body for `api` ("chat" or "completions"): each
    under its OpenAI names (absent or null: the API's default); SamplingError names the body's
    field.  top_k -1 means off, as vLLM writes it."""
    if api not in APIS:
        raise ValueError(f"api must be one of {APIS}, got {api!r}")
    values, shown = {}, {}
    for spec in FIELDS:
        given = [name for name in spec.openai_names if body.get(name) is not None]
        values[spec.name] = body[given[0]] if given else spec.default_for(api)
        shown[spec.name] = given[0] if given else spec.name
    try:
        if api == "chat":
            values["logprobs"], shown["logprobs"] = _chat_logprobs(body)
        return SamplingParams(**values)
    except SamplingError as err:  # judged once, by SamplingParams; named as the body named it
        raise SamplingError(shown.get(err.field, err.field), err.reason) from None


def _chat_logprobs(body: Mapping[str, Any]) -> tuple[Any, str]:
    """Chat asks for logprobs as `logprobs: true` and `top_logprobs: k` (completions, like the
    native field, as `logprobs: k`): the native value, and the body field to blame for it."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise SamplingError("logprobs", f"must be true or false, got {clipped_repr(asked)}")
    if not asked:
        if top is not None:
            raise SamplingError("top_logprobs", "needs logprobs: true")
        return None, "logprobs"
    return (0 if top is None else top), "top_logprobs"


def _shown_default(value: Any) -> str:
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return "`[]`" if value == () else f"`{value}`"


def markdown_rows() -> str:
    """docs/protocol.md's rows of the generate table for the sampling fields (a test keeps the
    page equal to this)."""
    type_of = {
        "float": "float",
        "int": "int",
        "optional_int": "int or nil",
        "bool": "bool",
        "token_ids": "array of int",
    }
    rows = []
    for spec in FIELDS:
        rows.append(
            f"| `{spec.name}` | {type_of[spec.kind]} | {_shown_default(spec.default)} | "
            f"{spec.describe_allowed()}; {spec.help} |"
        )
    return "\n".join(rows)
