"""Protocol 1.10's tokenizer ops (ipc/tokenize_ops.py, hostctl/serving/tokenize_service.py): the
decoder's refusals naming the field, the server's answers on a raw socket and through both bundled
clients, a bad op answered on its own reply op while the server goes on, an older server's
refusal ending the caller at once, and the gateway's /tokenize, /detokenize, /tokenizer_info on
the `tiny` model (its byte tokenizer adds BOS, id 256).  On the real model, with a chat template:
test_gateway_echo.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import msgpack
import pytest
import zmq

from ringleader.hostctl.gateway.app import BackgroundGateway
from ringleader.ipc import protocol as P
from ringleader.ipc import tokenize_ops as ops
from ringleader.ipc.client import AsyncClient, Client, TokenizeError
from tests.conftest import RawPeer, running_server
from tests.conftest import post_json as post

LIMITS = P.Limits(vocab_size=264, max_context=512)
BOS = 256
USER = [{"role": "user", "content": "a"}]


@pytest.fixture(scope="module")
def stack():
    with running_server() as bg, BackgroundGateway(bg.address) as gw:
        yield bg, gw


def decoded(msg: dict) -> ops.TokenizeOp:
    return P.decode_request(msgpack.packb(msg), LIMITS)  # type: ignore[return-value]


# ---------------------------------------------------------------- the decoder


@pytest.mark.parametrize(
    "msg, field",
    [
        ({"op": "tokenize", "id": 1, "prompt": "a", "bogus": 1}, "bogus"),
        ({"op": "tokenize", "id": 1}, "prompt"),
        (
            {"op": "tokenize", "id": 1, "prompt": "a", "messages": [{"role": "user", "content": "a"}]},
            "prompt",
        ),
        ({"op": "tokenize", "id": 1, "prompt": 5}, "prompt"),
        ({"op": "tokenize", "id": 1, "prompt": "a", "add_special_tokens": 1}, "add_special_tokens"),
        ({"op": "tokenize", "id": 1, "prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),
        ({"op": "tokenize", "id": 1, "messages": USER, "add_special_tokens": True}, "add_special_tokens"),
        ({"op": "tokenize", "id": 1, "messages": [{"role": "robot", "content": "a"}]}, "messages[0].role"),
        (
            {"op": "tokenize", "id": 1, "messages": USER, "continue_final_message": True},
            "continue_final_message",
        ),
        ({"op": "tokenize", "id": 1, "prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
        ({"op": "detokenize", "id": 1, "token_ids": [1, 264]}, "token_ids"),
        ({"op": "detokenize", "id": 1, "token_ids": "12"}, "token_ids"),
        ({"op": "detokenize", "id": 1, "token_ids": [1], "skip_special_tokens": 0}, "skip_special_tokens"),
        ({"op": "tokenizer_info", "id": 1, "extra": True}, "extra"),
    ],
)
def test_a_bad_field_is_a_refusal_naming_it(msg, field):
    got = decoded(msg)
    assert isinstance(got, ops.RefusedOp) and got.field == field and got.id == 1
    assert got.message.startswith(f"{field}: ")
    reply = ops.refusal_reply(got.op, got.id, P.ERR_BAD_REQUEST, got.message)
    assert reply["op"] == ops.REPLY_OP[msg["op"]] and reply["error"]["message"] == got.message


def test_an_op_without_an_id_is_an_error_op_and_messages_round_trip():
    with pytest.raises(P.FrameError, match="tokenize: missing 'id'"):
        decoded({"op": "tokenize", "prompt": "a"})
    req = ops.TokenizeRequest(
        "t-1",
        None,
        [{"role": "assistant", "content": "Hi"}],
        False,
        True,
        {"enable_thinking": False},
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert decoded(ops.tokenize_msg(req)) == req
    plain = ops.TokenizeRequest(7, "", None)  # an empty prompt tokenizes (vLLM's does)
    assert decoded(ops.tokenize_msg(plain)) == plain and ops.tokenize_msg(plain) == {
        "op": "tokenize",
        "id": 7,
        "prompt": "",
    }
    detok = ops.DetokenizeRequest(3, [1, 2], True)
    assert decoded(ops.detokenize_msg(detok)) == detok
    assert decoded(ops.tokenizer_info_msg(4)) == ops.TokenizerInfoRequest(4)


# ---------------------------------------------------------------- the server, raw


def test_each_op_is_answered_and_a_bad_one_leaves_the_server_serving(stack):
    bg, _ = stack
    peer = RawPeer(bg.address)
    try:
        peer.send({"op": "generate", "id": "g", "prompt": "Hello", "max_tokens": 1})
        peer.send({"op": "tokenize", "id": "t", "prompt": "Hello", "return_token_strs": True})
        peer.send({"op": "tokenize", "id": "bad", "prompt": "x", "bogus": 1})
        peer.send({"op": "detokenize", "id": "d", "token_ids": [BOS, 72, 105]})
        peer.send({"op": "tokenizer_info", "id": "i"})
        got: dict = {}
        while len(got) < 5:  # the generate's done and the four replies
            msg = peer.recv()
            if msg["op"] != "token":
                got[msg["id"]] = msg
        assert got["g"]["op"] == "done" and got["g"]["finish_reason"] == "length"
        tokens = got["t"]
        assert tokens["op"] == "tokens" and tokens["token_ids"] == [BOS, 72, 101, 108, 108, 111]
        assert tokens["max_context"] == 512 and tokens["token_strs"][1:] == list("Hello")
        assert got["bad"] == {
            "op": "tokens",
            "id": "bad",
            "error": {"code": "bad_request", "message": got["bad"]["error"]["message"]},
        }
        assert got["bad"]["error"]["message"].startswith("bogus: unknown field")
        assert got["d"] == {"op": "text", "id": "d", "text": "Hi"}
        info = got["i"]
        assert (
            info["op"] == "tokenizer_info" and info["bos_token_id"] == BOS and info["eos_token_ids"] == [257]
        )
        assert info["max_context"] == 512 and info["vocab_size"] == 264 and info["chat_template"] is None
        peer.ping()  # still serving
    finally:
        peer.close()


# ---------------------------------------------------------------- the bundled clients


def test_the_sync_client_counts_what_generate_counts(stack):
    bg, _ = stack
    with Client(bg.address, timeout=30) as client:
        stream = client.generate("Hello there", max_tokens=1)
        list(stream)
        assert stream.done is not None
        counted = client.tokenize("Hello there")
        assert len(counted.token_ids) == stream.done.prompt_tokens == 12
        bare = client.tokenize("Hello there", add_special_tokens=False)
        assert bare.token_ids == counted.token_ids[1:]  # without the BOS a prompt gets
        assert client.detokenize(bare.token_ids) == "Hello there"
        assert client.tokenizer_info()["eos_token_ids"] == [257]
        with pytest.raises(TokenizeError) as info:
            client.tokenize(messages=[{"role": "user", "content": "hi"}])  # no chat template
        assert info.value.field == "messages" and "chat template" in info.value.message
        with pytest.raises(TokenizeError) as info:  # judged before sending
            client.tokenize("x", add_generation_prompt=False)
        assert info.value.field == "add_generation_prompt"
        with pytest.raises(TokenizeError) as info:  # the server's vocabulary
            client.detokenize([5000])
        assert info.value.field == "token_ids" and "[0, 264)" in info.value.message
        assert len(client._core.op_waiters) == 0  # nothing left waiting


def test_the_async_client_asks_the_same(stack):
    bg, _ = stack

    async def main():
        async with AsyncClient(bg.address, timeout=30) as client:
            got = await asyncio.gather(
                client.tokenize("Hi", return_token_strs=True),
                client.detokenize([72, 105]),
                client.tokenizer_info(),
            )
            with pytest.raises(TokenizeError) as info:
                await client.detokenize([-1])
            return got, info.value

    (tokenized, text, info), refused = asyncio.run(main())
    assert tokenized.token_ids == [BOS, 72, 105] and tokenized.token_strs[1:] == ["H", "i"]
    assert text == "Hi" and info["bos_token_id"] == BOS
    assert refused.field == "token_ids"


def test_a_server_without_the_ops_ends_the_caller_at_once():
    """A 1.9 server answers an op it does not know with an id-less error op: the client takes it
    as its oldest tokenize's answer rather than waiting out its timeout."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def old_server():
        while not stop.is_set():
            if not router.poll(50):
                continue
            who, frame = router.recv_multipart()
            op = msgpack.unpackb(frame)["op"]
            if op == "hello":
                reply = {"op": "hello", "protocol": "1.9", "batch": True}
            elif op == "ping":
                reply = P.pong_msg()
            else:
                reply = P.error_msg(P.ERR_BAD_REQUEST, f"unknown op '{op}'")
            router.send_multipart([who, msgpack.packb(reply)])

    thread = threading.Thread(target=old_server, daemon=True)
    thread.start()
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=20) as client:
            started = time.monotonic()
            with pytest.raises(TokenizeError) as info:
                client.tokenize("hi")
            assert info.value.code == ops.NOT_SUPPORTED and "tokenize" in info.value.message
            assert time.monotonic() - started < 5
    finally:
        stop.set()
        thread.join()
        router.close()


# ---------------------------------------------------------------- the gateway


def test_the_gateways_tokenizer_routes_answer_in_vllms_shapes(stack):
    _, gw = stack
    status, body = post(gw, "/tokenize", {"model": "tiny", "prompt": "Hi", "return_token_strs": True})
    assert status == 200 and body == {
        "count": 3,
        "max_model_len": 512,
        "tokens": [BOS, 72, 105],
        "token_strs": ["", "H", "i"],
    }
    status, body = post(gw, "/tokenize", {"prompt": "Hi", "add_special_tokens": False})  # lm-eval's probe
    assert status == 200 and body["tokens"] == [72, 105] and body["token_strs"] is None
    assert post(gw, "/detokenize", {"tokens": [72, 105]}) == (200, {"prompt": "Hi"})
    with urllib.request.urlopen(gw.url + "/tokenizer_info", timeout=30) as r:
        info = json.loads(r.read())
    assert "eos_token" in info and info["eos_token_id"] == 257 and info["model_max_length"] == 512


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "typical_p": 1}, "typical_p"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}]}, "messages"),  # no template
        ("/tokenize", {"prompt": "x", "chat_template": "{{ x }}"}, "chat_template"),
        ("/detokenize", {"tokens": [1, "x"]}, "tokens"),
        ("/detokenize", {"tokens": [99999]}, "tokens"),  # the server's vocabulary
        ("/detokenize", {}, "tokens"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(stack, path, body, param):
    _, gw = stack
    status, answer = post(gw, path, body)
    assert status == 400 and answer["error"]["param"] == param
    assert answer["error"]["message"].startswith(param)


def test_another_model_is_a_404(stack):
    _, gw = stack
    status, answer = post(gw, "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
