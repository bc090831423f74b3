"""A JSON schema's numeric bounds made exact, and the keywords no constraint enforces refused
(hostctl/serving/schema_rules.py): the regexes against Python's own comparisons."""

from __future__ import annotations

import random
import re

import pytest

from ringleader.hostctl.serving.schema_rules import (
    enforceable_schema,
    integer_range_regex,
    number_range_regex,
    substitute,
)
from ringleader.ipc.structured import StructuredError

BOUNDS = [None, -1000, -301, -100, -1, 0, 1, 9, 10, 99, 100, 150, 299, 1000]


@pytest.mark.parametrize("low", BOUNDS)
@pytest.mark.parametrize("high", BOUNDS)
def test_an_integer_range_matches_exactly_its_integers(low, high):
    if low is not None and high is not None and low > high:
        return
    rx = re.compile(integer_range_regex(low, high))
    for n in range(-1500, 1500):
        inside = (low is None or n >= low) and (high is None or n <= high)
        assert bool(rx.fullmatch(str(n))) == inside, (low, high, n)
    for written in ("-0", "00", "01", "+1", "1.0", "1e2", ""):
        assert not rx.fullmatch(written), written


@pytest.mark.parametrize("low", BOUNDS)
@pytest.mark.parametrize("high", BOUNDS)
def test_a_number_range_matches_exactly_its_decimals(low, high):
    if low is not None and high is not None and low > high:
        return
    rx = re.compile(number_range_regex(low, high))
    rng = random.Random(f"{low},{high}")
    for _ in range(400):
        whole = rng.randint(-1400, 1400)
        written = rng.choice(
            [str(whole), f"{whole}.0", f"{whole}.000", f"{whole}.5", f"{rng.uniform(-1400, 1400):.3f}"]
        )
        if written.startswith("-0"):
            continue  # -0.x: its sign and magnitude are checked by the ranges around 0 below
        value = float(written)
        inside = (low is None or value >= low) and (high is None or value <= high)
        assert bool(rx.fullmatch(written)) == inside, (low, high, written)
    assert not rx.fullmatch("1e3") and not rx.fullmatch("01.5")


def test_bounds_become_placeholders_whose_regex_replaces_them():
    schema = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "not": {"type": "string"},  # a property named like a keyword is a name, not a keyword
            "price": {"anyOf": [{"type": "number", "minimum": 0}, {"type": "null"}]},
            "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
        },
    }
    rewritten, exact = enforceable_schema(schema)
    assert rewritten["properties"]["age"] == {"const": "rlbound0"}
    assert rewritten["properties"]["not"] == {"type": "string"}
    assert rewritten["properties"]["price"]["anyOf"][0] == {"const": "rlbound1"}
    assert set(exact) == {'"rlbound0"', '"rlbound1"', '"rlbound2"'}
    level = re.compile(exact['"rlbound2"'])
    assert [n for n in range(-3, 9) if level.fullmatch(str(n))] == [1, 2, 3, 4]
    assert substitute('\\{"age":"rlbound0"\\}', exact) == '\\{"age":(' + exact['"rlbound0"'] + ")\\}"
    assert schema["properties"]["age"]["maximum"] == 150  # the caller's schema is left alone


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "integer", "multipleOf": 5}, "schema: `multipleOf`"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "schema: `uniqueItems`"),
        ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "schema.properties.a: `not`"),
        ({"type": "string", "minimum": 3}, "bounds go with `type: integer`"),
        ({"type": "number", "exclusiveMinimum": 0}, "exclusiveMinimum"),
        ({"type": "number", "maximum": 2.5}, "whole numbers"),
        ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer lies within"),
        ({"type": "integer", "minimum": "3"}, "`minimum` must be a number"),
    ],
)
def test_what_would_be_ignored_is_refused_by_name(schema, words):
    with pytest.raises(StructuredError) as info:
        enforceable_schema(schema)
    assert info.value.field == "structured.json" and words in info.value.reason, info.value.reason
