"""Structured output (protocol 1.8's `structured`) through every front door: the HTTP gateway's
response_format / structured_outputs / guided_* fields, the Python clients' `structured=`,
`ringleader generate --json-schema/--regex/--choice/--json-object` (the C client's
`req.structured`: test_c_client_structured.py).  Each is checked to put the right StructuredSpec on the wire (the frame read
back by the server's decoder, protocol.decode_request) and to refuse a bad one naming the field
the caller wrote.  The upstream is a recording ROUTER on 127.0.0.1 (real sockets, no server)."""

from __future__ import annotations

import asyncio
import io
import json
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import msgpack
import openai
import pytest
import zmq

from ringleader.hostctl import cli
from ringleader.hostctl.commands.generate import structured_from_args
from ringleader.hostctl.gateway.answer import answer_request
from ringleader.hostctl.gateway.app import BackgroundGateway
from ringleader.hostctl.gateway.metrics import GatewayMetrics
from ringleader.hostctl.gateway.openai_api import (
    APIError,
    ServedModel,
    check_request,
    parse_request,
)
from ringleader.ipc import protocol as P
from ringleader.ipc.client import AsyncClient, Client, StructuredError, StructuredSpec
from ringleader.ipc.client.core import ClientCore
from ringleader.ipc.sampling_params import SamplingParams
from ringleader.ipc.structured import MAX_CHOICES, MAX_CONSTRAINT_CHARS

REPO = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))  # the compact text, in its order
JSON_SPEC = StructuredSpec("json", SCHEMA_TEXT)
MESSAGES = [{"role": "user", "content": "Where?"}]


def chat(**body):
    return parse_request({"messages": MESSAGES, **body}, chat=True)


def completion(**body):
    return parse_request({"prompt": "Where?", **body}, chat=False)


# ---------------------------------------------------------------- a recording upstream


class Upstream:
    """A ROUTER on 127.0.0.1 that keeps every generate it gets (decoded by the server's decoder)
    and answers it with `answer(request)`'s frames: by default one token and a `stop` done."""

    def __init__(self, answer: Callable[[P.GenerateRequest], list[dict]] | None = None):
        self.answer = answer or (
            lambda req: [
                {"op": "token", "id": req.id, "token_ids": [7], "text": '{"city":"Oslo"}'},
                {"op": "done", "id": req.id, "finish_reason": "stop", "usage": usage(1)},
            ]
        )
        self.generates: list[P.GenerateRequest] = []
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, frame = self.sock.recv_multipart()
            op = msgpack.unpackb(frame).get("op")
            if op == "hello":
                self.sock.send_multipart([ident, P.encode(P.hello_reply_msg(False))])
            elif op == "ping":
                self.sock.send_multipart([ident, P.encode(P.pong_msg())])
            elif op == "generate":
                req = P.decode_request(frame)
                assert isinstance(req, P.GenerateRequest)
                self.generates.append(req)
                for reply in self.answer(req):
                    self.sock.send_multipart([ident, P.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        self.ctx.term()

    def __enter__(self) -> Upstream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def usage(completion_tokens: int) -> dict:
    return {"prompt_tokens": 3, "completion_tokens": completion_tokens}


# ---------------------------------------------------------------- the gateway's fields


@pytest.mark.parametrize("parse", [chat, completion], ids=["chat", "completions"])
@pytest.mark.parametrize(
    "body, spec, param",
    [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, StructuredSpec("json_object"), "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}},
            JSON_SPEC,
            "response_format.json_schema.schema",
        ),
        (  # what the openai SDK's parse() sends: strict, and a description
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "description": "d", "schema": SCHEMA, "strict": True},
                }
            },
            JSON_SPEC,
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"json": SCHEMA}}, JSON_SPEC, "structured_outputs"),
        ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}}, JSON_SPEC, "structured_outputs"),
        (
            {"structured_outputs": {"regex": "[0-9]+"}},
            StructuredSpec("regex", "[0-9]+"),
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"choice": ["a", "b", "a"], "regex": None, "disable_fallback": True}},
            StructuredSpec("choice", ("a", "b")),
            "structured_outputs",
        ),
        ({"structured_outputs": {"json_object": True}}, StructuredSpec("json_object"), "structured_outputs"),
        ({"guided_json": SCHEMA}, JSON_SPEC, "guided_json"),
        ({"guided_json": SCHEMA_TEXT, "guided_decoding_backend": "xgrammar"}, JSON_SPEC, "guided_json"),
        ({"guided_regex": "yes|no"}, StructuredSpec("regex", "yes|no"), "guided_regex"),
        ({"guided_choice": ["x", "y"]}, StructuredSpec("choice", ("x", "y")), "guided_choice"),
        (  # text asks for nothing, so it does not conflict
            {"response_format": {"type": "text"}, "guided_regex": "a"},
            StructuredSpec("regex", "a"),
            "guided_regex",
        ),
        ({}, None, None),
    ],
)
def test_each_form_becomes_its_spec(parse, body, spec, param):
    req = parse(**body)
    assert (req.structured, req.structured_param) == (spec, param)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"response_format": "json"}, "response_format", "must be an object with a type"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "text, json_object or json_schema"),
        (
            {"response_format": {"type": "json_object", "schema": {}}},
            "response_format.schema",
            "unknown field",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "is required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
            "must be a JSON schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
            "response_format.json_schema.strict",
            "true or false",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "name": 5}}},
            "response_format.json_schema.name",
            "a string",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "format": "x"}}},
            "response_format.json_schema.format",
            "unknown field",
        ),
        ({"structured_outputs": "regex"}, "structured_outputs", "must be an object"),
        ({"structured_outputs": {}}, "structured_outputs", "give exactly one of json, regex, choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "choice and regex"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar", "does not enforce"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "does not"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "unknown constraint"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty str"),
        ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object", "must be true"),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
            "only null or false",
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
            "only null",
        ),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON text"),
        ({"guided_regex": 5}, "guided_regex", "non-empty str"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a"] * (MAX_CHOICES + 1)}, "guided_choice", f"limit {MAX_CHOICES}"),
        ({"guided_regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "guided_regex", f"limit {MAX_CONSTRAINT_CHARS}"),
        ({"guided_grammar": "root ::= x"}, "guided_grammar", "does not enforce grammar constraints"),
        (
            {"guided_regex": "a", "guided_whitespace_pattern": " "},
            "guided_whitespace_pattern",
            "not supported",
        ),
        ({"guided_regex": "a", "guided_decoding_backend": 3}, "guided_decoding_backend", "must be a string"),
    ],
)
def test_refusals_name_the_requests_field(body, param, words):
    for parse in (chat, completion):
        with pytest.raises(APIError) as info:
            parse(**body)
        err = info.value
        assert err.status == 400 and err.param == param and err.message.startswith(param + ": "), err.message
        assert words in err.message
        assert err.body()["error"] == {
            "message": err.message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }


@pytest.mark.parametrize(
    "body, first, second",
    [
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format",
            "guided_regex",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
            "structured_outputs",
            "guided_choice",
        ),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_json", "guided_regex"),
        (
            {
                "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
                "structured_outputs": {"json_object": True},
            },
            "response_format",
            "structured_outputs",
        ),
    ],
)
def test_two_constraints_at_once_are_refused_naming_both(body, first, second):
    with pytest.raises(APIError) as info:
        chat(**body)
    err = info.value
    assert err.status == 400 and err.param == second
    assert err.message == f"{second}: conflicts with {first}: give one constraint on the output"


def test_check_request_carries_the_spec_for_every_front_end():
    """check_request is the one parse of the aiohttp gateway and the Ray Serve ingress; the
    request it returns crosses to a Ray replica pickled, spec and all."""
    body = {"model": "m", "prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}}
    req = check_request(json.dumps(body).encode(), chat=False, model=ServedModel("m"))
    assert pickle.loads(pickle.dumps(req)) == req
    assert req.structured == StructuredSpec("choice", ("yes", "no"))


def test_a_model_without_a_tokenizer_takes_no_constraint():
    body = {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    with pytest.raises(APIError) as info:
        check_request(json.dumps(body).encode(), chat=False, model=ServedModel("m", has_tokenizer=False))
    assert info.value.param == "response_format" and "needs a model with a tokenizer" in info.value.message


@pytest.mark.parametrize(
    "source, wire_field, param",
    [
        ("response_format.json_schema.schema", "structured.json", "response_format.json_schema.schema"),
        ("response_format", "structured.json_object", "response_format"),
        ("structured_outputs", "structured.regex", "structured_outputs.regex"),
        ("structured_outputs", "structured", "structured_outputs"),
        ("guided_choice", "structured.choice", "guided_choice"),
    ],
)
def test_the_servers_refusal_is_told_in_the_requests_words(source, wire_field, param):
    err = APIError.from_upstream(P.ERR_BAD_REQUEST, f"{wire_field}: cannot compile it", source)
    assert (err.status, err.param, err.message) == (400, param, f"{param}: cannot compile it")
    # without a constraint of the request's, the server's words stand
    plain = APIError.from_upstream(P.ERR_BAD_REQUEST, "max_tokens: too many")
    assert (plain.param, plain.message) == ("max_tokens", "max_tokens: too many")


def test_the_gateway_sends_the_spec_upstream_and_answers_stop():
    with Upstream() as upstream:

        async def go():
            client = AsyncClient(upstream.address, timeout=10)
            try:
                req = chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
                return await answer_request(client, GatewayMetrics(), req, "m", 0.0)
            finally:
                await client.aclose()

        body = asyncio.run(go())
    (sent,) = upstream.generates
    assert sent.structured == JSON_SPEC
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == '{"city":"Oslo"}'


def test_http_end_to_end_with_the_openai_sdk():
    """response_format on chat, structured_outputs on completions (extra_body), and a refusal
    of the server's told as the request's field, through HTTP."""

    def answer(req: P.GenerateRequest) -> list[dict]:
        if req.structured is not None and req.structured.kind == "regex":
            message = "structured.regex: cannot compile it: unbalanced parenthesis"
            error = {"code": P.ERR_BAD_REQUEST, "message": message}
            return [{"op": "done", "id": req.id, "finish_reason": "error", "usage": usage(0), "error": error}]
        return [
            {"op": "token", "id": req.id, "token_ids": [7], "text": "yes"},
            {"op": "done", "id": req.id, "finish_reason": "stop", "usage": usage(1)},
        ]

    options = dict(served_model_name="fake", max_model_len=64, has_tokenizer=True)
    with Upstream(answer) as upstream, BackgroundGateway(upstream.address, **options) as gw:
        api = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        reply = api.chat.completions.create(
            model="fake",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}},
        )
        assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == "yes"
        done = api.completions.create(
            model="fake", prompt="ok?", extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
        )
        assert done.choices[0].text == "yes"
        with pytest.raises(openai.BadRequestError) as info:
            api.completions.create(model="fake", prompt="x", extra_body={"guided_regex": "(a"})
        assert info.value.body["param"] == "guided_regex"  # type: ignore[index]
        assert info.value.body["message"].startswith("guided_regex: cannot compile it")  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as info:
            api.chat.completions.create(
                model="fake",
                messages=MESSAGES,  # type: ignore[arg-type]
                response_format={"type": "json_object"},
                extra_body={"guided_choice": ["a"]},
            )
        assert info.value.body["param"] == "guided_choice"  # type: ignore[index]
    specs = [g.structured for g in upstream.generates]
    assert specs == [JSON_SPEC, StructuredSpec("choice", ("yes", "no")), StructuredSpec("regex", "(a")]


# ---------------------------------------------------------------- the Python clients


@pytest.mark.parametrize(
    "given, spec",
    [
        ({"json": SCHEMA}, JSON_SPEC),
        ({"json": json.dumps(SCHEMA, indent=1)}, JSON_SPEC),
        (StructuredSpec("json", json.dumps(SCHEMA)), JSON_SPEC),  # made canonical
        ({"regex": "[a-z]+"}, StructuredSpec("regex", "[a-z]+")),
        ({"choice": ["b", "a", "b"]}, StructuredSpec("choice", ("b", "a"))),
        ({"json_object": True}, StructuredSpec("json_object")),
        (None, None),
    ],
)
def test_the_sync_clients_frame_carries_the_spec(given, spec):
    with Upstream() as upstream, Client(upstream.address, timeout=10) as client:
        stream = client.complete("Where?", max_tokens=8, structured=given)
        assert stream.done is not None and stream.done.finish_reason == "stop"
    (sent,) = upstream.generates
    assert sent.structured == spec
    # the frame is the one encoder's: equal to generate_msg of the same request
    frame = ClientCore("tcp://x", connect_timeout=None, reply_timeout=None, max_frame_bytes=None, now=0)
    _, again = frame.prepare_generate(
        None, "Where?", None, SamplingParams(max_tokens=8), 0, None, None, True, spec
    )
    decoded = P.decode_request(again)
    assert isinstance(decoded, P.GenerateRequest) and decoded.structured == spec
    if spec is None:
        assert "structured" not in msgpack.unpackb(again)  # a 1.7 server reads it


def test_the_async_clients_frame_carries_the_spec():
    with Upstream() as upstream:

        async def go():
            async with AsyncClient(upstream.address, timeout=10) as client:
                stream = await client.complete(prompt_ids=[1, 2], structured={"choice": ["x", "y"]})
                return stream.done

        done = asyncio.run(go())
    assert done.finish_reason == "stop"
    assert upstream.generates[0].structured == StructuredSpec("choice", ("x", "y"))


@pytest.mark.parametrize(
    "given, field",
    [
        ({"regex": ""}, "structured.regex"),
        ({"grammar": "root ::= x"}, "structured.grammar"),
        ({"json": "{bad"}, "structured.json"),
        ({"choice": ["a"], "regex": "a"}, "structured"),
        ({}, "structured"),
        (StructuredSpec("choice", ()), "structured.choice"),
        (StructuredSpec("grammar", "x"), "structured.grammar"),
    ],
)
def test_a_bad_constraint_is_refused_before_anything_is_sent(given, field):
    with Upstream() as upstream:
        with Client(upstream.address, timeout=10) as client:
            with pytest.raises(ValueError) as info:
                client.generate("x", structured=given)
            assert isinstance(info.value, StructuredError) and info.value.field == field
            assert str(info.value).startswith(field + ": ")
            assert client.in_flight == 0
            client.ping()  # the client goes on; a generate would have come before the pong

        async def go():
            async with AsyncClient(upstream.address, timeout=10) as client:
                with pytest.raises(StructuredError, match=f"^{field}: "):
                    await client.generate("x", structured=given)

        asyncio.run(go())
    assert upstream.generates == []


def test_structured_must_be_a_spec_or_a_map():
    with Client("tcp://127.0.0.1:9", timeout=1) as client:
        with pytest.raises(TypeError, match="structured must be a StructuredSpec or a map"):
            client.generate("x", structured="json")  # type: ignore[arg-type]


# ---------------------------------------------------------------- ringleader generate


def cli_args(*argv: str):
    return cli.build_parser().parse_args(["generate", "hi", *argv])


def test_the_cli_options_give_their_spec(tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA, indent=2))
    assert structured_from_args(cli_args("--json-schema", str(schema_file))) == JSON_SPEC
    stdin = io.StringIO(json.dumps(SCHEMA))
    assert structured_from_args(cli_args("--json-schema", "-"), stdin) == JSON_SPEC
    assert structured_from_args(cli_args("--regex", "[0-9]{3}")) == StructuredSpec("regex", "[0-9]{3}")
    choices = cli_args("--choice", "yes", "--choice", "no")
    assert structured_from_args(choices) == StructuredSpec("choice", ("yes", "no"))
    assert structured_from_args(cli_args("--json-object")) == StructuredSpec("json_object")
    assert structured_from_args(cli_args()) is None


@pytest.mark.parametrize(
    "argv",
    [
        ("--regex", "a", "--choice", "b"),
        ("--json-object", "--json-schema", "f"),
        ("--regex", "a", "--json-object"),
    ],
)
def test_the_cli_options_are_mutually_exclusive(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli_args(*argv)
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def run_generate(*argv: str, stdin: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ringleader.hostctl.cli", "generate", *argv]
    return subprocess.run(cmd, cwd=REPO, input=stdin, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "content, argv, message",
    [
        ("{not json", ("--json-schema", "{file}"), "--json-schema {file}: not valid JSON text: "),
        ("[1, 2]", ("--json-schema", "{file}"), "--json-schema {file}: must be a JSON schema"),
        (None, ("--json-schema", "{file}"), "--json-schema {file}: cannot read it: "),
        (None, ("--regex", ""), "--regex: must be a non-empty str, got ''"),
        (None, ("--choice", "a", "--choice", ""), "--choice: must be a non-empty list of non-empty strs"),
        (None, ("--chat", "--json-schema", "-"), "--json-schema -: stdin holds the conversation"),
    ],
)
def test_a_bad_constraint_is_a_one_line_usage_error(tmp_path, content, argv, message):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    argv = tuple(a.replace("{file}", str(path)) for a in argv)
    prompt = () if "--chat" in argv else ("hi",)
    proc = run_generate(*prompt, *argv, "--connect", "tcp://127.0.0.1:9", "--connect-timeout", "1")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(message.replace("{file}", str(path))), proc.stderr


def test_the_cli_sends_the_constraint(tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    with Upstream() as upstream:
        for argv in (("--json-schema", str(schema_file)), ("--choice", "yes", "--choice", "no")):
            proc = run_generate("Where?", *argv, "--max-tokens", "8", "--connect", upstream.address)
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.startswith('{"city":"Oslo"}') and proc.stderr.startswith("[stop: ")
        proc = run_generate("--json-schema", "-", "Where?", "--connect", upstream.address, stdin=SCHEMA_TEXT)
        assert proc.returncode == 0, proc.stderr
    assert [g.structured for g in upstream.generates] == [
        JSON_SPEC,
        StructuredSpec("choice", ("yes", "no")),
        JSON_SPEC,
    ]
