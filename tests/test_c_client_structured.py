"""The C client's structured output (protocol 1.8, `req.structured`): its frames carry the
constraint exactly as the Python client's do (read back by the server's decoder,
protocol.decode_request), and a bad one is refused locally in the Python client's words.  The
harness (the sanitized build, the check driver, the fake ROUTER server) is test_c_client.py's and
test_c_client_fake_servers.py's; the other front doors: test_structured_front_doors.py."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest
from test_c_client import build_c_client, check, run_c
from test_c_client_fake_servers import FakeServer, done_frame

from ringleader.ipc import protocol as P
from ringleader.ipc.sampling_params import SamplingParams
from ringleader.ipc.structured import (
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    StructuredError,
    StructuredSpec,
    structured_from_wire,
)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))  # the compact text, in its order
JSON_SPEC = StructuredSpec("json", SCHEMA_TEXT)


@pytest.fixture(scope="module")
def cbin(tmp_path_factory) -> Path:
    return build_c_client(tmp_path_factory)


C_REQUESTS = [
    (f"json_schema={SCHEMA_TEXT}", JSON_SPEC),
    ("regex=[0-9]{3}", StructuredSpec("regex", "[0-9]{3}")),
    ("choice=yes choice=no", StructuredSpec("choice", ("yes", "no"))),
    ("json_object=1", StructuredSpec("json_object")),
    ("", None),
]


def test_the_c_clients_frames_carry_the_spec(cbin):
    fake = FakeServer(lambda msg: [done_frame(msg["id"], finish_reason="stop")])
    lines = [f"ids=1,2 max_tokens=8 timeout_ms=900 {setting}".strip() for setting, _ in C_REQUESTS]
    try:
        events = check(cbin, fake.address, lines)
    finally:
        fake.close()
    dones = [e for e in events if e["event"] == "done"]
    assert [d["finish_reason"] for d in dones] == ["stop"] * len(C_REQUESTS)
    sent = [f for f in fake.frames if msgpack.unpackb(f)["op"] == "generate"]
    for i, (frame, (_, spec)) in enumerate(zip(sent, C_REQUESTS, strict=True)):
        decoded = P.decode_request(frame)
        assert isinstance(decoded, P.GenerateRequest) and decoded.structured == spec
        # byte for byte the Python client's frame (the schema sent as its canonical text)
        want = P.GenerateRequest(i + 1, None, [1, 2], SamplingParams(max_tokens=8), 0, 900, structured=spec)
        assert frame == P.encode(P.generate_msg(want)), msgpack.unpackb(frame)


def test_the_c_client_sends_a_schema_the_server_then_judges(cbin):
    """The C client does not parse JSON: a schema's text that is not JSON reaches the server,
    whose decoder refuses it naming structured.json."""
    fake = FakeServer(lambda msg: [done_frame(msg["id"])])
    try:
        check(cbin, fake.address, ["ids=1 json_schema={not-json"])
    finally:
        fake.close()
    (frame,) = [f for f in fake.frames if msgpack.unpackb(f)["op"] == "generate"]
    assert msgpack.unpackb(frame)["structured"] == {"json": "{not-json"}
    with pytest.raises(P.BadRequest, match="structured.json: not valid JSON text"):
        P.decode_request(frame)


@pytest.mark.parametrize(
    "setting, message, wire",
    [
        ("regex=", "structured.regex: must be a non-empty str, got ''", {"regex": ""}),
        (
            "regex=" + "a" * (MAX_CONSTRAINT_CHARS + 1),
            f"structured.regex: is {MAX_CONSTRAINT_CHARS + 1} characters, limit {MAX_CONSTRAINT_CHARS}",
            {"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)},
        ),
        (
            f"many_choices={MAX_CHOICES + 1}",
            f"structured.choice: has {MAX_CHOICES + 1} choices, limit {MAX_CHOICES}",
            {"choice": ["x"] * (MAX_CHOICES + 1)},
        ),
        ("many_choices=0", "structured.choice: must be a non-empty list of non-empty strs", None),
        ("choice=a choice=", "structured.choice: must be a non-empty str, got ''", None),
        ("structured_kind=1", "structured.json: must be a non-empty str, got NULL", None),
        ("structured_kind=2", "structured.regex: must be a non-empty str, got NULL", None),
        ("structured_kind=9", "structured: unknown kind 9", None),
    ],
)
def test_the_c_client_refuses_a_bad_constraint_locally(cbin, setting, message, wire):
    fake = FakeServer(lambda msg: [done_frame(msg["id"])])
    try:
        refused, ping, _ = run_c(
            cbin, "ringleader-c-check", "invalid", "--address", fake.address, *setting.split()
        )
    finally:
        fake.close()
    assert refused["code"] == "invalid_argument" and refused["in_flight"] == 0
    assert refused["message"] == message and ping["code"] == "ok"
    if wire is not None:  # in the Python client's words
        with pytest.raises(StructuredError) as err:
            structured_from_wire(wire)
        assert str(err.value) == message
    assert set(fake.ops()) == {"hello", "ping"}
