"""The sampling fields are declared once (ringleader.ipc.sampling_params) and every path derives
from the declaration: docs/protocol.md's table is its `markdown_rows()`, the decoder, the gateway,
the CLI and the clients name no field's range or default, a bad value is refused with the field's
name on every path (SamplingParams, the protocol, the OpenAI gateway, `ringleader generate`), an
unknown field is refused rather than dropped, and an old server reads what a new client sends by
default as before."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from ringleader.hostctl import cli
from ringleader.hostctl.commands.generate import sampling_from_args
from ringleader.hostctl.gateway.openai_api import APIError, parse_request
from ringleader.ipc import protocol as P
from ringleader.ipc import sampling_params as declaration
from ringleader.ipc.sampling_params import FIELDS, SamplingError, SamplingParams, markdown_rows

ROOT = Path(__file__).resolve().parent.parent
LIMITS = P.Limits(vocab_size=32000, max_context=4096, max_tokens_cap=1024)
# the modules that take sampling fields from a caller: each must derive them from the declaration
DERIVED = [
    "ipc/protocol.py",
    "hostctl/gateway/openai_api.py",
    "hostctl/gateway/responses.py",
    "hostctl/gateway/answer.py",
    "hostctl/gateway/request_answer.py",
    "hostctl/gateway/batched.py",
    "hostctl/gateway/tokenize_api.py",
    "hostctl/commands/generate.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "ipc" / "client").glob("*.py")),
]
# a reply's key that shares a field's name: the token message's and OpenAI's per-token
# `logprobs` carry log-probabilities, not the setting
REPLY_KEYS = {"logprobs", "prompt_logprobs"}  # a token message's keys too (protocol 1.5, 1.10)
# the generate fields of revision 1.3, all a 1.3 server knows
FIELDS_OF_1_3 = {
    *("op", "id", "prompt", "prompt_ids", "messages", "priority", "timeout_ms"),
    *("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos"),
}


# ---------------------------------------------------------------- written once


def test_the_protocol_page_holds_the_declarations_rows():
    page = (ROOT / "docs" / "protocol.md").read_text()
    assert markdown_rows() in page


def _code_strings(tree: ast.AST) -> set[str]:
    """The module's string literals, docstrings and f-string text left out."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings | in_fstrings
    }


@pytest.mark.parametrize("path", DERIVED)
def test_no_module_but_the_declaration_names_a_sampling_field(path):
    """A module that never writes a field's name as a string cannot give it a range, a default or
    a check of its own; and it imports none of the declaration's bounds to build one with."""
    tree = ast.parse((ROOT / path).read_text())
    names = {name for spec in FIELDS for name in (spec.name, *spec.openai_names)}
    assert not names & _code_strings(tree) - REPLY_KEYS
    bounds = {
        name
        for name, value in vars(declaration).items()
        if (name.isupper() and isinstance(value, (int, float))) or name in ("FloatRange", "IntRange")
    }
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "ringleader.ipc.sampling_params"
        for alias in node.names
    }
    assert not imported & bounds


def test_the_cli_options_are_the_declarations():
    options = {a.dest: a for a in _generate_parser()._actions}
    for spec in FIELDS:
        action = options[spec.name]
        assert action.option_strings == ["--" + spec.name.replace("_", "-")]
        assert action.default == spec.default and action.help == spec.help


def test_the_cli_builds_the_settings_it_was_given():
    args = cli.build_parser().parse_args(
        ["generate", "hi", "--min-p", "0.1", "--top-k", "-1", "--presence-penalty", "-0.5"]
        + ["--repetition-penalty", "1.3", "--stop-token-ids", "4,5", "--ignore-eos"]
    )
    assert sampling_from_args(args) == SamplingParams(
        min_p=0.1,
        top_k=-1,
        presence_penalty=-0.5,
        repetition_penalty=1.3,
        stop_token_ids=(4, 5),
        ignore_eos=True,
    )
    assert sampling_from_args(cli.build_parser().parse_args(["generate", "hi"])) == SamplingParams()


# ---------------------------------------------------------------- bad values on every path

# a value below the range, for each float field (the penalties take negatives down to -2)
BELOW = {
    "temperature": -1.0,
    "top_p": -0.5,
    "min_p": -0.1,
    "presence_penalty": -2.5,
    "frequency_penalty": -2.5,
    "repetition_penalty": -1.0,
}
BAD_VALUES = [math.nan, math.inf, -math.inf, 1e308, "below", "high", True, [0.5, 0.5]]
CASES = [(name, value) for name in BELOW for value in BAD_VALUES]
CASE_IDS = [f"{name}={value!r}" for name, value in CASES]


def _bad(name: str, value):
    return BELOW[name] if value == "below" else value


def _cli_text(value) -> str:
    """The value as an option's text (a list: its comma-separated items)."""
    if isinstance(value, bool):
        return "true"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _generate_parser():
    parser = cli.build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices["generate"]


@pytest.mark.parametrize("name, value", CASES, ids=CASE_IDS)
def test_sampling_params_refuse_a_bad_value_naming_the_field(name, value):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{name: _bad(name, value)})
    assert info.value.field == name and str(info.value).startswith(name + ": ")


@pytest.mark.parametrize("name, value", CASES, ids=CASE_IDS)
def test_the_protocol_refuses_a_bad_value_naming_the_field(name, value):
    msg = {"op": "generate", "id": 7, "prompt_ids": [1, 2], name: _bad(name, value)}
    with pytest.raises(P.BadRequest) as info:
        P.decode_request(P.encode(msg), LIMITS)
    assert info.value.field == name and info.value.id == 7
    done = P.reject_msg(info.value)
    assert done["error"]["code"] == P.ERR_BAD_REQUEST and done["error"]["message"].startswith(name + ": ")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("name, value", CASES, ids=CASE_IDS)
def test_the_gateway_refuses_a_bad_value_with_a_400_naming_the_field(name, value, chat):
    body = {"model": "m", name: _bad(name, value)}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    # through JSON as the gateway reads it: Python's parser takes NaN and Infinity
    body = json.loads(json.dumps(body))
    with pytest.raises(APIError) as info:
        parse_request(body, chat=chat)
    err = info.value
    assert err.status == 400 and err.param == name and err.message.startswith(name + ": ")


@pytest.mark.parametrize("name, value", CASES, ids=CASE_IDS)
def test_the_cli_refuses_a_bad_value_naming_the_option(name, value, capsys):
    option = "--" + name.replace("_", "-")
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["generate", "hi", f"{option}={_cli_text(_bad(name, value))}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and "Traceback" not in err


def test_the_server_judges_what_depends_on_the_model():
    small = P.Limits(vocab_size=100, max_context=512, max_tokens_cap=64)
    for fields, name in (({"top_k": 101}, "top_k"), ({"stop_token_ids": [100]}, "stop_token_ids")):
        with pytest.raises(P.BadRequest) as info:
            P.decode_request(P.encode({"op": "generate", "id": 1, "prompt_ids": [1], **fields}), small)
        assert info.value.field == name and "100" in info.value.message
    assert P.decode_request(P.encode({"op": "generate", "id": 1, "prompt_ids": [1], "top_k": -1}), small)


# ---------------------------------------------------------------- unknown fields


def test_the_protocol_refuses_an_unknown_generate_field():
    msg = {"op": "generate", "id": "a", "prompt_ids": [1], "min_q": 0.5}
    with pytest.raises(P.BadRequest) as info:
        P.decode_request(P.encode(msg), LIMITS)
    done = P.reject_msg(info.value)
    assert done["id"] == "a" and done["error"]["code"] == P.ERR_BAD_REQUEST
    assert done["error"]["message"].startswith("min_q: unknown field; this server (protocol 1.10) knows: ")
    assert P.decode_request(P.encode({**msg, "min_q": None}), LIMITS).id == "a"  # nil: absent


def test_the_gateway_refuses_an_unknown_field_and_accepts_a_no_op():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(APIError) as info:
        parse_request({**body, "mirostat": 2}, chat=True)
    assert info.value.status == 400 and info.value.param == "mirostat"
    assert parse_request({**body, "user": "x"}, chat=True).sampling == parse_request(body, chat=True).sampling


# ---------------------------------------------------------------- old servers, round trips


def test_a_default_request_carries_only_what_an_old_server_knows():
    req = P.GenerateRequest("r", None, [1, 2], SamplingParams())
    assert P.generate_msg(req) == {"op": "generate", "id": "r", "prompt_ids": [1, 2], "priority": 0}
    old_settings = SamplingParams(
        max_tokens=5, temperature=0.5, top_p=0.9, top_k=3, seed=1, stop_token_ids=(2,)
    )
    assert set(P.generate_msg(P.GenerateRequest("r", None, [1], old_settings))) <= FIELDS_OF_1_3


def test_every_field_round_trips():
    sampling = SamplingParams(
        max_tokens=7,
        min_tokens=2,
        temperature=0.7,
        top_p=0.9,
        top_k=-1,
        min_p=0.05,
        presence_penalty=-0.5,
        frequency_penalty=1.5,
        repetition_penalty=1.3,
        seed=2**64 - 1,
        ignore_eos=True,
        logprobs=3,
        prompt_logprobs=0,
        n=2,
    )
    # stop_token_ids on a copy: not with min_tokens (refused until the step masks them)
    with_stops = SamplingParams(max_tokens=7, stop_token_ids=(3, 4))
    # every field away from its default in one of the two, so a field added to the declaration
    # must be added here
    assert all(
        getattr(sampling, spec.name) != spec.default or getattr(with_stops, spec.name) != spec.default
        for spec in FIELDS
    )
    for params in (sampling, with_stops):
        req = P.GenerateRequest(9, None, [1, 2, 3], params, priority=3, timeout_ms=100)
        assert P.decode_request(P.encode_request(req), LIMITS) == req
