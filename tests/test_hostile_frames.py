"""Malformed and hostile frames against a live server: each gets a clear error, and the server
goes on serving everyone else."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import RawPeer


def replies_until_pong(peer: RawPeer) -> list[dict]:
    peer.send({"op": "ping"})
    return peer.recv_until(lambda m: m.get("op") == "pong", timeout=30)[:-1]


@pytest.mark.parametrize(
    "frame, needle",
    [
        (b"\xc1", "msgpack"),  # never-used msgpack byte
        (b"\x92\x01\x02", "map"),  # an array, not a map
        (msgpack.packb({"id": 1}), "op"),
        (msgpack.packb({"op": "launch_missiles"}), "op"),
        (msgpack.packb({"op": 7}), "op"),
        (msgpack.packb({"op": "generate", "prompt": "x", "max_tokens": 3}), "id"),
        (b"\xdd\xff\xff\xff\xff", ""),  # array32 header claiming 4G items
        (b"\x91" * 5000, ""),  # nesting bomb
    ],
)
def test_frames_that_are_not_requests_get_an_error(peer, frame, needle):
    peer.send_raw(frame)
    replies = replies_until_pong(peer)
    assert len(replies) == 1 and replies[0]["op"] == "error" and replies[0]["id"] is None
    assert replies[0]["code"] == "bad_request" and needle in replies[0]["message"].lower()


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),  # -1 is off (1.4)
        ({"seed": -5}, "seed"),
        ({"stop_token_ids": [1] * 9}, "stop_token_ids"),
        ({"prompt_ids": [1, 10**6]}, "prompt_ids"),
        ({"prompt_ids": []}, "prompt"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"priority": 10**9}, "priority"),
        ({"prompt": 5}, "prompt"),
    ],
)
def test_generate_with_a_bad_field_gets_a_done_naming_it(peer, fields, field):
    msg = {"op": "generate", "id": "bad", "prompt_ids": [1, 2], "max_tokens": 4, **fields}
    if "prompt" in fields:
        msg.pop("prompt_ids")
    peer.send(msg)
    replies = replies_until_pong(peer)
    assert len(replies) == 1
    done = replies[0]
    assert done["op"] == "done" and done["id"] == "bad" and done["finish_reason"] == "error"
    assert done["error"]["code"] == "bad_request" and field in done["error"]["message"]


def test_oversized_and_multipart_frames(peer):
    peer.send({"op": "generate", "id": "big", "prompt": "x" * (2 << 20), "max_tokens": 1})
    peer.send_raw(msgpack.packb({"op": "ping"}), b"extra")
    replies = replies_until_pong(peer)
    assert [r["op"] for r in replies] == ["error", "error"]
    assert "frame" in replies[0]["message"].lower()


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
request_like = st.fixed_dictionaries(
    {"op": st.sampled_from(["generate", "abort", "stats", "ping", "nope", ""]) | json_like},
    optional={
        "id": json_like,
        "prompt": json_like,
        "prompt_ids": json_like,
        "max_tokens": json_like,
        "temperature": json_like,
        "top_p": json_like,
        "top_k": json_like,
        "seed": json_like,
        "stop_token_ids": json_like,
        "ignore_eos": json_like,
        "priority": json_like,
    },
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frame=st.binary(max_size=64)
    | request_like.map(lambda m: msgpack.packb(m, use_bin_type=True) if _packable(m) else b"\xc1")
)
def test_fuzzed_frames_never_break_the_server(peer, frame):
    peer.send_raw(frame)
    for reply in replies_until_pong(peer):
        assert reply["op"] in {"error", "done", "token", "stats"}
        if reply["op"] == "error":
            assert reply["code"] == "bad_request" and reply["message"]


def _packable(m) -> bool:
    try:
        msgpack.packb(m, use_bin_type=True)
        return True
    except (OverflowError, ValueError, TypeError):
        return False


def test_server_still_serves_after_the_fuzzing(peer):
    peer.send({"op": "generate", "id": "after", "prompt_ids": [3, 4], "max_tokens": 5, "ignore_eos": True})
    msgs = peer.recv_until(lambda m: m["op"] == "done" and m["id"] == "after")
    assert msgs[-1]["finish_reason"] == "length"
    assert sum(len(m["token_ids"]) for m in msgs if m["op"] == "token" and m["id"] == "after") == 5
