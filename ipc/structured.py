"""A generate's output constraint (protocol 1.8, the `structured` field), declared once.

The wire value is a map with exactly one of vLLM's structured-output keys:

- `json`: a JSON schema, as a map or as its JSON text;
- `regex`: a regular expression the whole output must match;
- `choice`: a list of strings, the output being exactly one of them;
- `json_object`: true, any JSON object (nesting bounded: docs/protocol.md).

`grammar` and `structural_tag` are vLLM's too, and refused by name: a constraint this server
cannot enforce must never pass unnoticed.  The server compiles a spec into a token automaton once
(hostctl/serving/constraints.py) and the device enforces it (ipc/automaton.py); `key` is what
the compiled automata are cached by, with the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ringleader.ipc.sampling_params import SamplingError, clipped_repr

WIRE_FIELD = "structured"
KINDS = ("json", "regex", "choice", "json_object")
# vLLM's names for constraints this server does not enforce
REFUSED_KINDS = ("grammar", "structural_tag")
MAX_CHOICES = 1024
# characters of a schema's JSON text, a regex, or all choices together
MAX_CONSTRAINT_CHARS = 64 * 1024


class StructuredError(SamplingError):
    """A constraint refused: `field` (as the request named it, e.g. "structured.regex") and why; a
    SamplingError, as a constraint is one more rule on how tokens are chosen."""


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """kind: one of KINDS; value: the schema's JSON text, compact and in the order it came (the
    order of its properties is the order of the output's) (json), the pattern (regex), the
    strings (choice, a tuple), None (json_object)."""

    kind: str
    value: str | tuple[str, ...] | None = None

    @property
    def key(self) -> tuple:
        return (self.kind, self.value)

    def wire(self) -> dict[str, Any]:
        """The wire map (the decoder reads it back to an equal spec)."""
        if self.kind == "json":
            return {"json": self.value}
        if self.kind == "choice":
            return {"choice": list(self.value or ())}
        if self.kind == "json_object":
            return {"json_object": True}
        return {self.kind: self.value}

    def describe(self) -> str:
        """A short name for logs and errors: "json schema", "regex", "choice of 3", "json_object"."""
        if self.kind == "choice":
            return f"choice of {len(self.value or ())}"
        return "json schema" if self.kind == "json" else self.kind


def _field(key: str) -> str:
    return f"{WIRE_FIELD}.{key}"


def _schema_text(value: Any) -> str:
    """A schema's compact JSON text, its keys in the order given: the output lists properties in
    that order, so two orders are two constraints (each cached on its own)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise StructuredError(_field("json"), f"not valid JSON text: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise StructuredError(
            _field("json"), f"must be a JSON schema (an object, or its JSON text), got {type(value).__name__}"
        )
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StructuredError(_field("json"), f"cannot be written as JSON: {exc}") from None
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise StructuredError(
            _field("json"), f"is {len(text)} characters of JSON, limit {MAX_CONSTRAINT_CHARS}"
        )
    return text


def structured_from_wire(value: Any) -> StructuredSpec | None:
    """The `structured` field's spec (None for nil); StructuredError naming the key at fault."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise StructuredError(
            WIRE_FIELD, f"must be a map with one of {', '.join(KINDS)}, got {type(value).__name__}"
        )
    given = {k: v for k, v in value.items() if v is not None and not (k == "json_object" and v is False)}
    for key in given:
        if key in REFUSED_KINDS:
            raise StructuredError(
                _field(str(key)),
                f"this server does not enforce {key} constraints; it enforces {', '.join(KINDS)}",
            )
        if key not in KINDS:
            raise StructuredError(
                _field(clipped_repr(key) if not isinstance(key, str) or len(key) > 64 else key),
                f"unknown constraint; give one of {', '.join(KINDS)}",
            )
    if len(given) != 1:
        named = " and ".join(sorted(map(str, given))) if given else "none"
        raise StructuredError(WIRE_FIELD, f"give exactly one of {', '.join(KINDS)}, got {named}")
    kind, raw = next(iter(given.items()))
    if kind == "json":
        return StructuredSpec("json", _schema_text(raw))
    if kind == "json_object":
        if raw is not True:
            raise StructuredError(_field(kind), f"must be true, got {clipped_repr(raw)}")
        return StructuredSpec("json_object")
    if kind == "regex":
        if not isinstance(raw, str) or not raw:
            raise StructuredError(_field(kind), f"must be a non-empty str, got {clipped_repr(raw)}")
        if len(raw) > MAX_CONSTRAINT_CHARS:
            raise StructuredError(_field(kind), f"is {len(raw)} characters, limit {MAX_CONSTRAINT_CHARS}")
        return StructuredSpec("regex", raw)
    if not isinstance(raw, (list, tuple)) or not raw or not all(isinstance(c, str) and c for c in raw):
        raise StructuredError(
            _field(kind), f"must be a non-empty list of non-empty strs, got {clipped_repr(raw)}"
        )
    if len(raw) > MAX_CHOICES:
        raise StructuredError(_field(kind), f"has {len(raw)} choices, limit {MAX_CHOICES}")
    if sum(map(len, raw)) > MAX_CONSTRAINT_CHARS:
        raise StructuredError(_field(kind), f"its choices exceed {MAX_CONSTRAINT_CHARS} characters together")
    return StructuredSpec("choice", tuple(dict.fromkeys(raw)))
