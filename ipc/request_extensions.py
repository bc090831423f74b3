"""A generate's vLLM request extensions (protocol 1.9), judged once for the decoder and the clients.

How `messages` are rendered, as vLLM's chat API takes it (each only with `messages`):

- `chat_template_kwargs`: a map of extra variables for the chat template (`enable_thinking`,
  say), JSON values within bounds; never one the server sets itself (RESERVED_TEMPLATE_KWARGS);
- `add_generation_prompt` (default true): open the assistant's turn after the conversation;
- `continue_final_message` (default false): leave the final message, the assistant's, open, so
  the model continues it (transformers' apply_chat_template(continue_final_message=True)); it
  cannot go with add_generation_prompt true, as vLLM refuses both.

How the output is detokenized, as vLLM's SamplingParams takes it:

- `skip_special_tokens` (default true): special tokens leave no text;
- `spaces_between_special_tokens` (default true): accepted and passed to the detokenizer, where
  it changes nothing: the server decodes with the `tokenizers` library, as transformers' fast
  tokenizers and vLLM's fast detokenizer do, which ignore it (only transformers' slow, Python
  tokenizers join special tokens with spaces).

A refusal is an ExtensionError naming the field (a ValueError), which the decoder turns into its
`bad_request` and a client raises before anything is sent.  A client sends a field only when it
differs from its default, so an older server keeps reading every other frame.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ringleader.ipc.sampling_params import clipped_repr

if TYPE_CHECKING:  # a type only: ringleader.ipc.backend may name these protocols in turn
    from ringleader.ipc.backend import Detokenizer

# the generate fields, in the order a frame carries them, and their defaults
DEFAULTS: dict[str, Any] = {
    "chat_template_kwargs": None,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}
WIRE_FIELDS = tuple(DEFAULTS)
# the fields that only go with `messages`
CHAT_FIELDS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")
# the template variables the server sets (transformers' apply_chat_template arguments and the
# sandbox's globals): a request's kwargs may not replace them
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "raise_exception",
        "strftime_now",
        "namespace",
    }
)
MAX_TEMPLATE_KWARGS = 64  # keys of chat_template_kwargs
MAX_TEMPLATE_KWARG_NAME = 64  # characters of one key
MAX_TEMPLATE_KWARGS_CHARS = 64 * 1024  # characters of their JSON text
MAX_TEMPLATE_KWARGS_DEPTH = 8  # nested lists and maps within one value


class ExtensionError(ValueError):
    """An extension refused: `field` as the request names it, and why; str() is "<field>: <reason>"."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


class ChatEncoder(Protocol):
    """A model's chat turns -> prompt ids (ModelInfo.encode_chat), with the rendering options."""

    def __call__(
        self,
        messages: list[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]: ...


class DetokenizerFactory(Protocol):
    """A model's detokenizer for one request (ModelInfo.new_detokenizer), decoding as it asked."""

    def __call__(
        self, *, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> Detokenizer: ...


def _check_json(value: Any, where: str, depth: int) -> None:
    """ExtensionError unless `value` is a JSON value (nil, bool, int, finite float, str, list, map
    with str keys) nested at most MAX_TEMPLATE_KWARGS_DEPTH deep."""
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if not -(1 << 63) <= value < 1 << 64:  # what msgpack carries
            raise ExtensionError(where, f"int out of msgpack's range, got {clipped_repr(value)}")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ExtensionError(where, f"must be finite, got {value!r}")
        return
    if not isinstance(value, (list, tuple, dict)):
        raise ExtensionError(where, f"must be a JSON value, got {type(value).__name__}")
    if depth >= MAX_TEMPLATE_KWARGS_DEPTH:
        raise ExtensionError(where, f"nests deeper than {MAX_TEMPLATE_KWARGS_DEPTH} lists and maps")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ExtensionError(where, f"map keys must be str, got {clipped_repr(key)}")
            _check_json(item, where, depth + 1)
    else:
        for item in value:
            _check_json(item, where, depth + 1)


def check_template_kwargs(value: Any) -> dict[str, Any] | None:
    """chat_template_kwargs as the template gets them (None for nil), else ExtensionError naming
    `chat_template_kwargs` or the key at fault (`chat_template_kwargs.enable_thinking`)."""
    name = "chat_template_kwargs"
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ExtensionError(name, f"must be a map of template variables, got {clipped_repr(value)}")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ExtensionError(name, f"at most {MAX_TEMPLATE_KWARGS} variables, got {len(value)}")
    for key, item in value.items():
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_TEMPLATE_KWARG_NAME:
            raise ExtensionError(
                name, f"keys must be str of 1..{MAX_TEMPLATE_KWARG_NAME} characters, got {clipped_repr(key)}"
            )
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ExtensionError(
                f"{name}.{key}", f"{key} is set by the server and cannot be replaced by a template variable"
            )
        _check_json(item, f"{name}.{key}", 0)
    chars = len(json.dumps(value, ensure_ascii=False))
    if chars > MAX_TEMPLATE_KWARGS_CHARS:
        raise ExtensionError(name, f"is {chars} characters of JSON, limit {MAX_TEMPLATE_KWARGS_CHARS}")
    return dict(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ExtensionError(name, f"must be true or false, got {clipped_repr(value)}")
    return value


def check_extensions(
    values: Mapping[str, Any], messages: Sequence[Mapping[str, Any]] | None
) -> dict[str, Any]:
    """Every extension field of `values` (absent or nil: its default) judged against the request's
    chat turns (`messages`, None for a prompt): their canonical values by field, or ExtensionError
    naming the first one at fault."""
    out = dict(DEFAULTS)
    for name in WIRE_FIELDS:
        value = values.get(name)
        if value is None:
            continue
        if messages is None and name in CHAT_FIELDS:
            raise ExtensionError(name, "only goes with messages (it says how they are rendered)")
        out[name] = check_template_kwargs(value) if name == "chat_template_kwargs" else _flag(name, value)
    if out["continue_final_message"]:
        if out["add_generation_prompt"]:
            raise ExtensionError(
                "continue_final_message",
                "cannot be true with add_generation_prompt true (as vLLM); "
                "send add_generation_prompt false to continue the final message",
            )
        assert messages is not None  # refused above without them
        role = messages[-1].get("role") if messages else None
        if role != "assistant":
            raise ExtensionError(
                "continue_final_message",
                f"the final message must be the assistant's to be continued, got role {clipped_repr(role)}",
            )
    return out


def wire_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """The extension fields of `values` that differ from their defaults (what a frame carries)."""
    return {name: values[name] for name in WIRE_FIELDS if values.get(name, DEFAULTS[name]) != DEFAULTS[name]}


def check_int_field(name: str, value: Any, low: int, high: int) -> None:
    """ValueError naming `name` and its range unless `value` is an int in [low, high] (what the
    server's decoder takes; a huge int would not even pack)."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or not low <= number <= high:
        raise ValueError(f"{name}: must be an int in [{low}, {high}], got {clipped_repr(value)}")
