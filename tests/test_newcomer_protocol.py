"""Protocol revision 1.3 on a real server over 127.0.0.1: a generate without max_tokens runs to
the end of the context (capped by the server's default_max_tokens), an abort can end its request
as a `stop`, and the float sampling fields are refused before they could overflow the ring's
float32, in the client's process as well as on the server."""

from __future__ import annotations

import asyncio
import math

import pytest

from ringleader.device.text.tokenizer import ByteTokenizer
from ringleader.hostctl.serving.server import Server
from ringleader.ipc import protocol as P
from ringleader.ipc.client import AsyncClient, Client
from ringleader.ipc.sampling_params import FLOAT32_MAX, SamplingParams
from tests.conftest import RawPeer, running_server, wait_until

MAX_CTX = 512  # running_server's default context


def finished(server) -> dict[str, int]:
    return dict(server.server.stats()["finished"])


# ---------------------------------------------------------------- max_tokens left to the server


def test_without_max_tokens_a_request_runs_to_the_end_of_the_context(tiny_server):
    with Client(tiny_server.address, timeout=60) as c:
        stream = c.complete(prompt_ids=[7] * 500, ignore_eos=True)
        assert stream.done.finish_reason == "length"
        assert stream.done.completion_tokens == len(stream.token_ids) == MAX_CTX - 500
        explicit = c.complete(prompt_ids=[7] * 500, max_tokens=3, ignore_eos=True)
        assert explicit.done.completion_tokens == 3  # an int max_tokens is unchanged


def test_the_servers_default_max_tokens_caps_only_requests_without_one():
    with running_server(server_options={"default_max_tokens": 5}) as srv:
        with Client(srv.address, timeout=60) as c:
            capped = c.complete(prompt_ids=[1, 2, 3], max_tokens=None, ignore_eos=True)
            assert capped.done.finish_reason == "length" and capped.done.completion_tokens == 5
            near_the_end = c.complete(prompt_ids=[1] * (MAX_CTX - 2), ignore_eos=True)
            assert near_the_end.done.completion_tokens == 2  # the context is the tighter bound
            asked = c.complete(prompt_ids=[1, 2, 3], max_tokens=20, ignore_eos=True)
            assert asked.done.completion_tokens == 20


def test_a_prompt_that_leaves_no_room_is_a_bad_request_naming_it(tiny_server, peer):
    full = "x" * MAX_CTX
    prompt_len = len(ByteTokenizer().encode(full))  # the tiny model's tokenizer
    peer.send({"op": "generate", "id": "full", "prompt": full})
    done = peer.recv_until(lambda m: m["op"] == "done")[-1]
    assert done["id"] == "full" and done["error"]["code"] == "bad_request"
    assert done["error"]["message"] == (
        f"prompt: prompt length {prompt_len} leaves no room to generate within max_context {MAX_CTX} "
        "(max_tokens was not given: the rest of the context)"
    )
    one_left = "x" * (len(full) - (prompt_len - MAX_CTX) - 1)
    peer.send({"op": "generate", "id": "one", "prompt": one_left, "max_tokens": None, "ignore_eos": True})
    done = peer.recv_until(lambda m: m["op"] == "done")[-1]
    assert done["id"] == "one" and done["finish_reason"] == "length"
    assert done["usage"] == {"prompt_tokens": MAX_CTX - 1, "completion_tokens": 1}


def test_default_max_tokens_must_be_positive():
    with pytest.raises(ValueError, match="default_max_tokens"):
        Server(None, default_max_tokens=0)  # type: ignore[arg-type]  # refused before the backend is read


# ---------------------------------------------------------------- an abort that ends as a stop


def test_an_abort_with_finish_reason_stop_ends_as_a_stop(tiny_server, peer):
    before = finished(tiny_server)
    peer.send({"op": "generate", "id": 1, "prompt_ids": [5, 6, 7], "max_tokens": 500, "ignore_eos": True})
    peer.recv_until(lambda m: m["op"] == "token")
    peer.send({"op": "abort", "id": 1, "finish_reason": "stop"})
    msgs = peer.recv_until(lambda m: m["op"] == "done")
    dones = [m for m in msgs + peer.quiet_for(0.3) if m["op"] == "done"]
    assert len(dones) == 1 and dones[0]["finish_reason"] == "stop" and "error" not in dones[0]
    assert 0 < dones[0]["usage"]["completion_tokens"] < 500
    after = finished(tiny_server)
    assert after.get("stop", 0) == before.get("stop", 0) + 1
    assert after.get("abort", 0) == before.get("abort", 0)


def test_a_request_still_on_the_host_ends_at_once_as_a_stop():
    # one slot: the device holds two requests (its window), the rest wait on the host
    with running_server(n_slots=1) as srv:
        peer = RawPeer(srv.address)
        try:
            for i in range(6):
                peer.send(
                    {"op": "generate", "id": i, "prompt_ids": [1, 2], "max_tokens": 480, "ignore_eos": True}
                )
            peer.send({"op": "stats"})
            stats = peer.recv_until(lambda m: m["op"] == "stats")[-1]
            assert stats["host_queue"] >= 3
            peer.send({"op": "abort", "id": 5, "finish_reason": "stop"})
            done = peer.recv_until(lambda m: m["op"] == "done")[-1]
            assert done["id"] == 5 and done["finish_reason"] == "stop"
            assert done["usage"]["completion_tokens"] == 0
            for i in range(5):
                peer.send({"op": "abort", "id": i})
            assert wait_until(lambda: srv.server.stats()["in_flight"] == 0)
            assert srv.server.stats()["finished"].get("stop", 0) == 1
        finally:
            peer.close()


def test_an_abort_with_another_finish_reason_is_refused_and_changes_nothing(tiny_server, peer):
    peer.send({"op": "generate", "id": "r", "prompt_ids": [5, 6], "max_tokens": 30, "ignore_eos": True})
    peer.recv_until(lambda m: m["op"] == "token")
    peer.send({"op": "abort", "id": "r", "finish_reason": "length"})
    msgs = peer.recv_until(lambda m: m["op"] == "done")
    errors = [m for m in msgs if m["op"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == "bad_request" and errors[0]["id"] is None
    assert errors[0]["message"].startswith('abort: finish_reason: must be "abort" or "stop", got \'length\'')
    assert msgs[-1]["id"] == "r" and msgs[-1]["finish_reason"] == "length"  # the abort was not applied
    assert msgs[-1]["usage"]["completion_tokens"] == 30


def test_both_clients_can_end_a_stream_as_a_stop(tiny_server):
    with Client(tiny_server.address, timeout=60) as c:
        stream = c.generate(prompt_ids=[3, 4], max_tokens=500, ignore_eos=True)
        next(stream)
        with pytest.raises(ValueError, match="finish_reason"):
            stream.abort(finish_reason="length")
        stream.abort(finish_reason="stop")
        done = stream.wait()
        assert done.finish_reason == "stop" and done.ok and 0 < done.completion_tokens < 500

    async def main():
        async with AsyncClient(tiny_server.address, timeout=60) as ac:
            stream = await ac.generate(prompt_ids=[3, 4], max_tokens=500, ignore_eos=True)
            await stream.__anext__()
            with pytest.raises(ValueError, match="finish_reason"):
                await stream.abort(finish_reason="error")
            await stream.abort(finish_reason="stop")
            return await stream.wait()

    done = asyncio.run(asyncio.wait_for(main(), 60))
    assert done.finish_reason == "stop" and 0 < done.completion_tokens < 500


# ---------------------------------------------------------------- float fields fit float32


@pytest.mark.parametrize(
    "name, value",
    [
        ("temperature", 1e308),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", -1.0),
        ("top_p", math.nan),
        ("top_p", 0.0),
        ("top_p", 1e308),
    ],
    ids=repr,
)
def test_sampling_params_refuse_what_float32_cannot_hold(name, value):
    with pytest.raises(ValueError, match=f"^{name}: must be a finite number in "):
        SamplingParams(max_tokens=4, **{name: value})


def test_sampling_params_accept_the_whole_range():
    assert SamplingParams(temperature=FLOAT32_MAX).temperature == FLOAT32_MAX
    assert SamplingParams(temperature=0, top_p=1).top_p == 1
    assert SamplingParams().max_tokens is None  # the rest of the context


def test_the_client_refuses_an_overflowing_temperature_before_sending(tiny_server):
    with Client(tiny_server.address, timeout=30) as c:
        accepted = c.stats()["accepted"]
        with pytest.raises(
            ValueError, match=r"^temperature: must be a finite number in \[0, 3.4028235e\+38\]"
        ):
            c.generate(prompt_ids=[1, 2], max_tokens=4, temperature=1e308)
        assert c.in_flight == 0
        assert c.stats()["accepted"] == accepted


def test_the_server_refuses_an_overflowing_temperature_from_a_raw_client(tiny_server, peer):
    peer.send({"op": "generate", "id": 9, "prompt_ids": [1], "max_tokens": 2, "temperature": 1e308})
    done = peer.recv_until(lambda m: m["op"] == "done")[-1]
    assert done["finish_reason"] == "error" and done["error"]["code"] == P.ERR_BAD_REQUEST
    assert done["error"]["message"].startswith("temperature: must be a finite number")
