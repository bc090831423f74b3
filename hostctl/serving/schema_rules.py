"""What a JSON schema asks that outlines-core's schema-to-regex would drop: numeric bounds made
exact, and the keywords no regex of ours enforces refused by name.

outlines-core writes `(-)?(0|[1-9][0-9]*)` for every integer, whatever its `minimum` and
`maximum`, and leaves out `multipleOf`, `uniqueItems` and the like without a word, so an answer
could break the very schema it was constrained by.  Here, before the regex is built:

- a bounded integer or number becomes a placeholder constant, and its exact regex replaces the
  placeholder's literal in outlines' output (`bounded_number_regex`: integers with any of the four
  bounds; numbers with integral `minimum`/`maximum`, written without an exponent);
- a keyword that would be ignored is a StructuredError naming it and where it is (a stricter
  output is fine, a looser one is not: `additionalProperties: true` only ever adds nothing);
- everything else goes to outlines-core as it came.
"""

from __future__ import annotations

import math
from typing import Any

from ringleader.ipc.structured import StructuredError

FIELD = "structured.json"
# outlines-core drops these silently; an answer could then break them
NOT_ENFORCED = (
    "multipleOf", "uniqueItems", "minProperties", "maxProperties", "not", "if", "then", "else",
    "dependentRequired", "dependentSchemas", "dependencies", "contains", "minContains", "maxContains",
    "patternProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SCHEMA = ("items", "additionalProperties", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
PLACEHOLDER = "rlbound{}"  # a JSON string constant outlines-core writes as the literal "rlboundN"
FRACTION = r"(\.[0-9]+)?"


def enforceable_schema(schema: Any) -> tuple[Any, dict[str, str]]:
    """(the schema with each bounded number replaced by a placeholder const, {the placeholder's
    regex literal in outlines' output: the number's exact regex}); StructuredError naming a
    keyword the server would not enforce."""
    exact: dict[str, str] = {}

    def walk(node: Any, where: str) -> Any:
        if not isinstance(node, dict):
            return node
        for key in NOT_ENFORCED:
            if key in node:
                raise StructuredError(
                    FIELD, f"{where}: `{key}` is not enforced by this server's constraints; leave it out"
                )
        if any(bound in node for bound in BOUNDS):
            name = PLACEHOLDER.format(len(exact))
            exact[f'"{name}"'] = _bounded(node, where)
            return {"const": name}
        out = dict(node)
        for key in _SCHEMA:
            if isinstance(node.get(key), dict):
                out[key] = walk(node[key], f"{where}.{key}")
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                out[key] = [walk(sub, f"{where}.{key}[{i}]") for i, sub in enumerate(node[key])]
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                out[key] = {name: walk(sub, f"{where}.{key}.{name}") for name, sub in node[key].items()}
        return out

    return walk(schema, "schema"), exact


def substitute(regex: str, exact: dict[str, str]) -> str:
    """outlines' regex with each placeholder's literal replaced by its number's regex."""
    for literal, number in exact.items():
        regex = regex.replace(literal, f"({number})")
    return regex


def _number(node: dict, key: str, where: str) -> float | None:
    value = node.get(key)
    if value is None or (isinstance(value, bool) and key.startswith("exclusive")):
        return None  # draft 4's boolean exclusiveMinimum is read beside minimum below
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise StructuredError(FIELD, f"{where}: `{key}` must be a number, got {value!r}")
    return value


def _bounded(node: dict, where: str) -> str:
    kind = node.get("type")
    lo, hi = _number(node, "minimum", where), _number(node, "maximum", where)
    xlo, xhi = _number(node, "exclusiveMinimum", where), _number(node, "exclusiveMaximum", where)
    if node.get("exclusiveMinimum") is True:  # draft 4
        lo, xlo = None, lo
    if node.get("exclusiveMaximum") is True:
        hi, xhi = None, hi
    if kind == "integer":
        low = max(
            [math.ceil(v) for v in (lo,) if v is not None]
            + [math.floor(v) + 1 for v in (xlo,) if v is not None],
            default=None,
        )
        high = min(
            [math.floor(v) for v in (hi,) if v is not None]
            + [math.ceil(v) - 1 for v in (xhi,) if v is not None],
            default=None,
        )
        if low is not None and high is not None and low > high:
            raise StructuredError(FIELD, f"{where}: no integer lies within its bounds")
        return integer_range_regex(low, high)
    if kind == "number":
        if xlo is not None or xhi is not None:
            raise StructuredError(
                FIELD,
                f"{where}: `exclusiveMinimum`/`exclusiveMaximum` on a number is not enforced; use an integer or inclusive bounds",
            )
        for bound in (lo, hi):
            if bound is not None and bound != int(bound):
                raise StructuredError(
                    FIELD, f"{where}: a number's bounds must be whole numbers here, got {bound!r}"
                )
        low, high = (None if v is None else int(v) for v in (lo, hi))
        if low is not None and high is not None and low > high:
            raise StructuredError(FIELD, f"{where}: minimum {low} is above maximum {high}")
        return number_range_regex(low, high)
    raise StructuredError(
        FIELD, f"{where}: bounds go with `type: integer` or `type: number`, got type {kind!r}"
    )


def integer_range_regex(low: int | None, high: int | None) -> str:
    """JSON integers n with low <= n <= high (None: unbounded), no leading zeros, no "-0"."""
    parts = []
    if high is None or high >= 0:
        parts.append(natural_range_regex(max(low, 0) if low is not None else 0, high))
    if low is None or low < 0:
        # -m for m in [max(1, -high), -low]
        parts.append(
            "-("
            + natural_range_regex(max(1, -high) if high is not None else 1, None if low is None else -low)
            + ")"
        )
    return "|".join(parts)


def number_range_regex(low: int | None, high: int | None) -> str:
    """JSON numbers x, written without an exponent, with low <= x <= high (whole bounds)."""
    parts = []
    if high is None or high >= 0:
        parts.append(_magnitude(max(low, 0) if low is not None else 0, high))
    if low is None or low < 0:
        parts.append(
            "-(" + _magnitude(max(0, -high) if high is not None else 0, None if low is None else -low) + ")"
        )
    return "|".join(parts)


def _magnitude(a: int, b: int | None) -> str:
    """Unsigned decimals m with a <= m <= b: an integer part in [a, b) with any fraction, or b with
    nothing but zeros after the point."""
    if b is None:
        return f"({natural_range_regex(a, None)}){FRACTION}"
    whole = rf"{b}(\.0+)?"
    if a == b:
        return whole
    return f"({natural_range_regex(a, b - 1)}){FRACTION}|{whole}"


def natural_range_regex(a: int, b: int | None) -> str:
    """Decimal naturals in [a, b] (b None: no end), without leading zeros."""
    if b is None:
        digits = len(str(a))
        head = natural_range_regex(a, 10**digits - 1)
        return f"{head}|[1-9][0-9]{{{digits},}}"
    parts = []
    for digits in range(len(str(a)), len(str(b)) + 1):
        first = max(a, 10 ** (digits - 1) if digits > 1 else 0)
        last = min(b, 10**digits - 1)
        if first <= last:
            parts.append(_same_length(str(first), str(last)))
    return "|".join(parts)


def _same_length(x: str, y: str) -> str:
    """Strings of len(x) digits from x to y (x <= y, equal lengths)."""
    if x == y:
        return x
    common = next(i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b)
    prefix, x, y = x[:common], x[common:], y[common:]
    rest = len(x) - 1
    if rest == 0:
        return f"{prefix}[{x}-{y}]"
    if x[1:] == "0" * rest and y[1:] == "9" * rest:
        return f"{prefix}[{x[0]}-{y[0]}][0-9]{{{rest}}}"
    alternatives = [x[0] + "(" + _same_length(x[1:], "9" * rest) + ")"]
    if int(x[0]) + 1 <= int(y[0]) - 1:
        alternatives.append(f"[{int(x[0]) + 1}-{int(y[0]) - 1}][0-9]{{{rest}}}")
    alternatives.append(y[0] + "(" + _same_length("0" * rest, y[1:]) + ")")
    return prefix + "(" + "|".join(alternatives) + ")"
