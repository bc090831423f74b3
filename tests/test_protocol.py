"""Wire protocol v1 decoding/encoding, fed with hostile input through real msgpack."""

import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringleader.ipc import protocol as P
from ringleader.ipc.sampling_params import (
    FIELDS,
    FLOAT32_MAX,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    SamplingParams,
)

LIMITS = P.Limits(vocab_size=32000, max_context=4096, max_tokens_cap=1024)


def frame(msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def gen(**fields) -> dict:
    msg = {"op": "generate", "id": "r1", "prompt_ids": [1, 2, 3], "max_tokens": 8}
    msg.update(fields)
    return {k: v for k, v in msg.items() if v is not _DROP}


_DROP = object()


def decode(msg, limits=LIMITS):
    return P.decode_request(frame(msg), limits)


# ------------------------------------------------------------ fuzzing: only the two errors escape


def decode_or_protocol_error(data: bytes, limits=LIMITS):
    try:
        return P.decode_request(data, limits)
    except (P.FrameError, P.BadRequest):
        return None


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_arbitrary_bytes_only_raise_protocol_errors(data):
    decode_or_protocol_error(data)


# Prefixes that make random bytes look like a map with an "op" so fuzzing reaches the field checks.
@settings(max_examples=300)
@given(
    st.sampled_from([b"\x81\xa2op", b"\x82\xa2op\xa8generate", b"\x83\xa2op\xa8generate\xa2id"]),
    st.binary(max_size=256),
)
def test_map_shaped_garbage_only_raises_protocol_errors(prefix, tail):
    decode_or_protocol_error(prefix + tail)


msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=6)
    ),
    max_leaves=30,
)
field_names = st.sampled_from(
    [
        "op",
        "id",
        "prompt",
        "prompt_ids",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop_token_ids",
        "ignore_eos",
        "priority",
        "finish_reason",
        "extra",
    ]
)
op_values = st.sampled_from(["generate", "abort", "stats", "ping", "token", "", "GENERATE"]) | msgpack_values


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(field_names, msgpack_values, max_size=12), op_values, st.booleans())
def test_arbitrary_maps_only_raise_protocol_errors(fields, op, with_op):
    if with_op:
        fields["op"] = op
    result = decode_or_protocol_error(frame(fields))
    assert result is None or isinstance(
        result, (P.GenerateRequest, P.AbortRequest, P.StatsRequest, P.PingRequest)
    )
    if isinstance(result, P.AbortRequest):
        assert result.finish_reason in P.ABORT_FINISH_REASONS


@settings(max_examples=300)
@given(
    st.sampled_from(
        [
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "stop_token_ids",
            "ignore_eos",
            "priority",
            "prompt",
        ]
    ),
    msgpack_values,
)
def test_generate_with_one_random_field(name, value):
    msg = gen(**{name: value})
    try:
        req = decode(msg)
    except P.BadRequest as exc:
        assert exc.id == "r1"
        assert exc.message.startswith(exc.field + ":")
        assert exc.field in (name, "prompt", "prompt_ids")
    else:
        assert isinstance(req, P.GenerateRequest)


# ------------------------------------------------------------ valid requests round-trip

token = st.integers(min_value=0, max_value=LIMITS.vocab_size - 1)
request_ids = st.text(min_size=1, max_size=LIMITS.max_id_len) | st.integers(
    min_value=P.INT64_MIN, max_value=P.INT64_MAX
)


chat_turns = st.builds(
    lambda role, content: {"role": role, "content": content},
    st.sampled_from(sorted(P.CHAT_ROLES)),
    st.text(max_size=50),
)


@st.composite
def valid_generates(draw):
    max_tokens = draw(st.none() | st.integers(1, LIMITS.max_tokens_cap))
    given = draw(st.sampled_from(["prompt_ids", "prompt", "messages"]))
    prompt_ids = (
        draw(st.lists(token, min_size=1, max_size=min(200, LIMITS.max_context - (max_tokens or 1))))
        if given == "prompt_ids"
        else None
    )
    prompt = draw(st.text(min_size=1, max_size=200)) if given == "prompt" else None
    messages = draw(st.lists(chat_turns, min_size=1, max_size=5)) if given == "messages" else None
    return P.GenerateRequest(
        id=draw(request_ids),
        prompt=prompt,
        prompt_ids=prompt_ids,
        sampling=SamplingParams(
            max_tokens=max_tokens,
            temperature=draw(st.floats(min_value=0.0, max_value=FLOAT32_MAX)),
            top_p=draw(st.floats(min_value=0.0, max_value=1.0, exclude_min=True)),
            top_k=draw(st.integers(-1, MAX_TOP_K)),
            min_p=draw(st.floats(min_value=0.0, max_value=1.0)),
            presence_penalty=draw(st.floats(min_value=-2.0, max_value=2.0)),
            frequency_penalty=draw(st.floats(min_value=-2.0, max_value=2.0)),
            repetition_penalty=draw(st.floats(min_value=0.0, max_value=FLOAT32_MAX, exclude_min=True)),
            seed=draw(st.none() | st.integers(0, 2**64 - 1)),
            stop_token_ids=tuple(draw(st.lists(token, max_size=MAX_STOP_TOKEN_IDS))),
            ignore_eos=draw(st.booleans()),
        ),
        priority=draw(st.integers(LIMITS.min_priority, LIMITS.max_priority)),
        timeout_ms=draw(st.none() | st.integers(1, LIMITS.max_timeout_ms)),
        messages=messages,
    )


@settings(max_examples=300)
@given(valid_generates())
def test_valid_generate_round_trips(req):
    assert P.decode_request(P.encode_request(req), LIMITS) == req


@given(request_ids, st.sampled_from(sorted(P.ABORT_FINISH_REASONS)))
def test_abort_round_trips(rid, finish_reason):
    abort = P.AbortRequest(rid, finish_reason)
    assert P.decode_request(P.encode_request(abort), LIMITS) == abort


def test_a_plain_abort_is_the_revision_2_frame():
    assert P.abort_msg(5) == {"op": "abort", "id": 5}
    assert P.abort_msg(5, "stop") == {"op": "abort", "id": 5, "finish_reason": "stop"}
    assert decode({"op": "abort", "id": 5, "finish_reason": None}) == P.AbortRequest(5, "abort")


@pytest.mark.parametrize("reason", ["length", "error", "STOP", "", 1, True, ["stop"]], ids=repr)
def test_an_abort_may_end_only_as_abort_or_stop(reason):
    # an abort has no `done` of its own to carry bad_request: the `error` op answers it
    with pytest.raises(P.FrameError, match=r'^abort: finish_reason: must be "abort" or "stop"') as info:
        decode({"op": "abort", "id": "r9", "finish_reason": reason})
    assert "'r9'" in str(info.value)
    assert P.reject_msg(info.value)["code"] == P.ERR_BAD_REQUEST


def test_stats_and_ping_decode():
    assert decode({"op": "stats"}) == P.StatsRequest()
    assert decode({"op": "ping", "future_field": [1, {"x": 2}]}) == P.PingRequest()


def test_defaults_filled_and_nil_unknown_fields_ignored():
    req = decode(gen(another=None))
    assert req == P.GenerateRequest("r1", None, [1, 2, 3], SamplingParams(max_tokens=8), 0)


@pytest.mark.parametrize("name", [spec.name for spec in FIELDS])
def test_a_nil_sampling_field_means_its_default(name):
    assert decode(gen(**{name: None, "max_tokens": None})).sampling == SamplingParams()


def test_an_unknown_generate_field_is_refused_naming_it():
    # 1.4: a field the server does not know (a sampling setting of a later revision, a typo) is
    # refused rather than dropped, so nothing a client asked for is silently left undone
    with pytest.raises(P.BadRequest) as info:
        decode(gen(some_future_field={"nested": [1, 2]}))
    assert info.value.field == "some_future_field" and info.value.id == "r1"
    assert info.value.message.startswith(
        "some_future_field: unknown field; this server (protocol 1.10) knows: op, id,"
    )
    assert "min_p" in info.value.message and "timeout_ms" in info.value.message
    with pytest.raises(P.BadRequest) as info:
        decode(gen(**{"x" * 500: 1}))
    assert len(info.value.field) < 70


def test_string_prompt_and_int_for_float_fields():
    req = decode(gen(prompt_ids=_DROP, prompt="hello", temperature=1, top_p=1))
    assert req.prompt == "hello" and req.prompt_ids is None
    assert req.sampling.temperature == 1.0 and isinstance(req.sampling.temperature, float)
    assert isinstance(req.sampling.top_p, float)


def test_null_counts_as_absent_for_prompt_pair():
    assert decode(gen(prompt=None)).prompt_ids == [1, 2, 3]


def test_bytes_like_frames_accepted():
    data = frame(gen())
    assert P.decode_request(bytearray(data), LIMITS).id == "r1"
    assert P.decode_request(memoryview(data), LIMITS).id == "r1"


# ------------------------------------------------------------ each invalid field is named

INVALID_FIELDS = [
    ("max_tokens", [-1, -3, 1025, True, 1.0, "8", [8]]),
    ("temperature", [-0.1, float("nan"), float("inf"), 1e308, 3.5e38, -0.0 - 1e-300, "0", True]),
    ("top_p", [0, 0.0, -0.5, 1.0001, float("nan"), float("-inf"), 1e308, True]),
    ("top_k", [-2, MAX_TOP_K + 1, 32001, 1.0, True]),
    ("min_p", [-0.1, 1.01, float("nan"), float("inf"), "0.1", True]),
    ("presence_penalty", [-2.01, 2.01, float("nan"), float("-inf"), [0.5], False]),
    ("frequency_penalty", [-3, 3, float("nan"), 1e308, {"a": 1}, True]),
    ("repetition_penalty", [0, -1.0, float("nan"), float("inf"), 1e308, "1.2", True]),
    ("seed", [-1, 1.5, "1", True]),
    ("stop_token_ids", [[1] * 9, [-1], [32000], [True], [1.0], "1", 5, {"a": 1}]),
    ("ignore_eos", [0, 1, "true"]),
    ("priority", [1001, -1001, 0.5, True, None]),
    ("timeout_ms", [0, -5, 24 * 3600 * 1000 + 1, 1.5, True, "100"]),
    ("prompt_ids", [[], [-1], [32000], [1, True], [1.5], "abc", {"a": 1}, [1] * 4096]),
]


@pytest.mark.parametrize(
    "name,value",
    [(name, value) for name, values in INVALID_FIELDS for value in values],
    ids=lambda v: repr(v)[:20],
)
def test_invalid_field_is_named(name, value):
    with pytest.raises(P.BadRequest) as info:
        decode(gen(**{name: value}))
    assert info.value.field == name
    assert info.value.id == "r1"
    assert str(info.value).startswith(name + ":")


def test_max_tokens_message_format():
    # the server's cap where the declaration's range allows more
    # one range in every message: the server's cap, whatever the value's fault
    for value, shown in ((1025, "1025"), (-3, "-3"), (2**40, str(2**40)), ("8", "'8'")):
        with pytest.raises(P.BadRequest, match=rf"^max_tokens: must be an int in \[0, 1024\], got {shown}$"):
            decode(gen(max_tokens=value))


def test_float_fields_must_fit_float32():
    with pytest.raises(P.BadRequest) as info:
        decode(gen(temperature=1e308))
    assert info.value.message == ("temperature: must be a finite number in [0, 3.4028235e+38], got 1e+308")
    assert decode(gen(temperature=FLOAT32_MAX)).sampling.temperature == FLOAT32_MAX
    assert decode(gen(temperature=2**64 - 1)).sampling.temperature == float(2**64 - 1)
    with pytest.raises(P.BadRequest, match=r"^top_p: must be a finite number in \(0, 1\], got nan$"):
        decode(gen(top_p=float("nan")))


@pytest.mark.parametrize("absent", [_DROP, None], ids=["absent", "nil"])
def test_max_tokens_may_be_left_to_the_server(absent):
    # 1.3: no max_tokens means the rest of the context; the server resolves it after tokenizing
    assert decode(gen(max_tokens=absent)).sampling.max_tokens is None
    assert decode(gen(max_tokens=absent, prompt_ids=[1] * 4095)).sampling.max_tokens is None


def test_resolve_max_tokens():
    assert P.resolve_max_tokens(100, 7, LIMITS) == 7
    assert P.resolve_max_tokens(4000, None, LIMITS) == 96  # the rest of the context
    assert P.resolve_max_tokens(100, None, LIMITS) == 1024  # at most max_tokens_cap
    capped = P.Limits(vocab_size=32000, max_context=4096, max_tokens_cap=4096, default_max_tokens=300)
    assert P.resolve_max_tokens(100, None, capped) == 300
    assert P.resolve_max_tokens(4000, None, capped) == 96
    assert P.resolve_max_tokens(100, 2000, capped) == 2000  # the cap is for requests that give none
    with pytest.raises(P.BadRequest) as info:
        P.resolve_max_tokens(4096, None, LIMITS, request_id=3, field="messages")
    assert info.value.id == 3 and info.value.field == "messages"
    assert info.value.message.startswith("messages: prompt length 4096 leaves no room to generate")
    with pytest.raises(P.BadRequest, match="exceeds max_context"):
        P.resolve_max_tokens(4000, 97, LIMITS)


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": "hi"},  # both prompt and prompt_ids
        {"prompt_ids": _DROP},  # neither
        {"prompt_ids": _DROP, "prompt": ""},
        {"prompt_ids": _DROP, "prompt": 5},
        {"prompt_ids": _DROP, "prompt": b"bytes"},
        {"prompt_ids": _DROP, "prompt": "x" * (LIMITS.max_prompt_chars + 1)},
    ],
    ids=lambda f: repr(f)[:30],
)
def test_bad_prompt_is_named(fields):
    with pytest.raises(P.BadRequest) as info:
        decode(gen(**fields))
    assert info.value.field == "prompt"


def test_messages_decode_to_chat_turns():
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi", "name": "ann"}]
    req = decode(gen(prompt_ids=_DROP, messages=turns))
    assert req.messages == turns and req.prompt is None and req.prompt_ids is None
    assert P.generate_msg(req)["messages"] == turns


@pytest.mark.parametrize(
    "messages, field",
    [
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "user", "content": "x"}] * (LIMITS.max_messages + 1), "messages"),
        (["hello"], "messages[0]"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "messages[1].role"),
        ([{"role": 1, "content": "a"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": ["parts"]}], "messages[0].content"),
        ([{"role": "user", "content": "a", "images": []}], "messages[0]"),
        ([{"role": "user", "content": "a", "name": ""}], "messages[0].name"),
        ([{"role": "user", "content": "x" * (LIMITS.max_prompt_chars + 1)}], "messages"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_bad_messages_are_named(messages, field):
    with pytest.raises(P.BadRequest) as info:
        decode(gen(prompt_ids=_DROP, messages=messages))
    assert info.value.field == field and info.value.message.startswith(field + ":")


@pytest.mark.parametrize("other", [{"prompt": "hi", "prompt_ids": _DROP}, {}])
def test_messages_exclude_the_other_inputs(other):
    with pytest.raises(P.BadRequest, match="exactly one of prompt, prompt_ids and messages"):
        decode(gen(messages=[{"role": "user", "content": "hi"}], **other))


def test_context_limit_on_prompt_ids():
    assert decode(gen(prompt_ids=[1] * 4000, max_tokens=96)).sampling.max_tokens == 96
    with pytest.raises(P.BadRequest) as info:
        decode(gen(prompt_ids=[1] * 4000, max_tokens=97))
    assert info.value.field == "prompt_ids" and "max_context 4096" in info.value.message


def test_check_context_helper():
    P.check_context(4000, 96, LIMITS)
    with pytest.raises(P.BadRequest) as info:
        P.check_context(4000, 97, LIMITS, request_id=7)
    assert info.value.field == "prompt" and info.value.id == 7
    assert str(info.value).startswith("prompt:")


# ------------------------------------------------------------ frames that are not requests


@pytest.mark.parametrize(
    "msg",
    [
        [1, 2],
        "generate",
        5,
        None,
        {},
        {"op": None},
        {"op": 1},
        {"op": b"generate"},
        {"op": "nope"},
        {"op": "token", "id": 1},
        gen(id=_DROP),
        gen(id=None),
        gen(id=1.5),
        gen(id=True),
        gen(id=""),
        gen(id="x" * 257),
        gen(id=[1]),
        gen(id=2**63),
        gen(id=2**64 - 1),
        {"op": "abort"},
        {"op": "abort", "id": None},
        {"op": "abort", "id": {"a": 1}},
    ],
    ids=lambda m: repr(m)[:40],
)
def test_frame_errors(msg):
    with pytest.raises(P.FrameError):
        decode(msg)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # reserved byte
        b"\x82\xa2op",  # truncated
        frame({"op": "ping"}) + b"\x00",  # trailing data
        b"\x81\x01\xa2op",  # int map key (strict_map_key)
        b"\x81\xa2op\xa2\xff\xfe",  # invalid utf-8
        b"\xdd\xff\xff\xff\xff",  # array header claiming 4G entries
        b"\xdb\x7f\xff\xff\xff",  # str header claiming 2 GiB
        b"\xd7\xff" + b"\xff" * 8,  # invalid timestamp ext
    ],
)
def test_garbage_frames(data):
    with pytest.raises(P.FrameError):
        P.decode_request(data, LIMITS)


def test_non_bytes_frame():
    with pytest.raises(P.FrameError):
        P.decode_request("not bytes", LIMITS)  # type: ignore[arg-type]


def test_oversize_frame_rejected_before_unpacking(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("unpackb must not see an oversize frame")

    data = frame(gen(prompt_ids=_DROP, prompt="x" * 2000))
    limits = P.Limits(max_frame_bytes=1000)
    monkeypatch.setattr(P.msgpack, "unpackb", boom)
    with pytest.raises(P.FrameError, match="limit is 1000"):
        P.decode_request(data, limits)


def test_frame_of_exactly_the_limit_is_accepted():
    data = frame(gen())
    assert P.decode_request(data, P.Limits(max_frame_bytes=len(data))).id == "r1"


def test_deep_nesting_bomb_rejected():
    bomb = b"\x81\xa2op" + b"\x91" * 200_000 + b"\xc0"
    with pytest.raises(P.FrameError):
        P.decode_request(bomb, LIMITS)


def test_container_count_bomb_rejected():
    # One array holding 500k empty arrays: tiny on the wire, huge as Python objects.
    bomb = b"\xdd" + (500_000).to_bytes(4, "big") + b"\x90" * 500_000
    with pytest.raises(P.FrameError, match="maps/arrays"):
        P.decode_request(bomb, LIMITS)


# ------------------------------------------------------------ server -> client builders


def test_token_msg():
    assert msgpack.unpackb(P.encode(P.token_msg(3, [1, 2]))) == {"op": "token", "id": 3, "token_ids": [1, 2]}
    assert P.token_msg("a", (5,), "hi") == {"op": "token", "id": "a", "token_ids": [5], "text": "hi"}


def test_done_msg():
    assert P.done_msg("a", "stop", 3, 4) == {
        "op": "done",
        "id": "a",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }
    err = P.done_msg(1, "error", 0, 0, P.ERR_BAD_REQUEST, "max_tokens: bad")
    assert err["error"] == {"code": "bad_request", "message": "max_tokens: bad"}
    with pytest.raises(ValueError):
        P.done_msg(1, "error", 0, 0)
    with pytest.raises(ValueError):
        P.done_msg(1, "stop", 0, 0, P.ERR_OVERLOADED)
    with pytest.raises(ValueError):
        P.done_msg(1, "finished", 0, 0)


def test_error_pong_stats_msgs():
    assert P.error_msg(P.ERR_BAD_REQUEST, "unknown op") == {
        "op": "error",
        "id": None,
        "code": "bad_request",
        "message": "unknown op",
    }
    assert P.pong_msg() == {"op": "pong"}
    assert P.stats_msg({"running": 2, "op": "x"}) == {"running": 2, "op": "stats"}


def test_stats_msg_keys_are_strings_so_the_client_decodes_it():
    """The CUDA backend's description keys its step graphs by bucket number; a reply carrying
    that was dropped by every client as malformed (strict map keys), so `stats` never returned."""
    stats = {"backend": {"step_graph_nodes": {1: "119 kernel", 32: "124 kernel"}}, "per": [{2: 3}]}
    with pytest.raises(P.FrameError):  # what the server sent before
        P.decode_reply(P.encode({**stats, "op": "stats"}))
    reply = P.decode_reply(P.encode(P.stats_msg(stats)))
    assert reply["backend"]["step_graph_nodes"] == {"1": "119 kernel", "32": "124 kernel"}
    assert reply["per"] == [{"2": 3}]


def test_constants():
    assert P.PROTOCOL_VERSION == 1
    assert {
        "bad_request",
        "overloaded",
        "engine_dead",
        "shutdown",
        "duplicate_id",
        "timeout",
    } == P.ERROR_CODES
    assert {"stop", "length", "abort", "error"} == P.FINISH_REASONS


def test_encode_accepts_numpy_like_scalars():
    class FakeInt:
        def __index__(self):
            return 7

    assert msgpack.unpackb(P.encode({"x": FakeInt()})) == {"x": 7}
    with pytest.raises(TypeError):
        P.encode({"x": object()})


def test_decode_reply():
    assert P.decode_reply(P.encode(P.pong_msg())) == {"op": "pong"}
    for bad in (b"\xc1", frame([1]), frame({"op": "generate"})):
        with pytest.raises(P.FrameError):
            P.decode_reply(bad)


def test_float_checks_are_exact_at_bounds():
    assert decode(gen(top_p=1.0)).sampling.top_p == 1.0
    assert decode(gen(temperature=0)).sampling.temperature == 0.0
    assert math.isclose(decode(gen(top_p=1e-9)).sampling.top_p, 1e-9)
    assert decode(gen(seed=2**64 - 1)).sampling.seed == 2**64 - 1


def test_reject_msg():
    with pytest.raises(P.BadRequest) as bad:
        decode(gen(top_k=-2))
    assert P.reject_msg(bad.value) == P.done_msg(
        "r1", "error", 0, 0, "bad_request", f"top_k: must be an int in [-1, {MAX_TOP_K}], got -2"
    )
    with pytest.raises(P.FrameError) as frame_error:
        decode({"op": "nope"})
    assert P.reject_msg(frame_error.value) == {
        "op": "error",
        "id": None,
        "code": "bad_request",
        "message": "unknown op 'nope'",
    }
