"""Protocol 1.7's `batch` frames: the builder and its inverse agree, the server sends one frame per
connection per step to a connection that said hello and today's frames to one that did not, and
an older client against this server (and this client against an older server's answer) works."""

from __future__ import annotations

import random

import msgpack
import pytest
from conftest import RawPeer, running_server

from ringleader.hostctl.serving.connection_frames import MAX_BATCH_CONTAINERS, ConnectionFrames
from ringleader.ipc import protocol as P
from ringleader.ipc.batch_frames import BadBatch, BatchFrame, expand_batch
from ringleader.ipc.client import AsyncClient, Client

PROMPT = list(range(300, 332))


def _random_messages(rng: random.Random) -> list[dict]:
    """Chunks with every mix of fields, then dones, as token/done maps (what a batch means)."""
    chunks = []
    for i in range(rng.randint(0, 30)):
        ids = [rng.randint(0, 1000) for _ in range(rng.choice([0, 1, 1, 1, 3]))]
        msg = {"op": "token", "id": rng.choice([i, f"r{i}"]), "token_ids": ids}
        if rng.random() < 0.4:
            msg["text"] = rng.choice(["", "a", "é", "hello"])
        if rng.random() < 0.3:
            msg["index"] = rng.randint(0, 3)
        if rng.random() < 0.2:
            msg["logprobs"] = [{"logprob": -0.5, "top_ids": [t], "top_logprobs": [-0.5]} for t in ids]
        if rng.random() < 0.1:
            msg["finish_reason"] = rng.choice(["stop", "length"])
        chunks.append(msg)
    dones = [
        P.done_msg(rng.randint(0, 99), rng.choice(["stop", "length", "abort"]), 3, 4)
        for _ in range(rng.randint(0, 4))
    ]
    return chunks + dones


def _batch_of_messages(messages: list[dict]) -> dict:
    batch = BatchFrame()
    for msg in messages:
        if msg["op"] == "done":
            batch.add_done(msg)
        elif set(msg) == {"op", "id", "token_ids"}:
            batch.add_ids(msg["id"], msg["token_ids"])
        elif set(msg) == {"op", "id", "token_ids", "text"}:
            batch.add_text(msg["id"], msg["token_ids"], msg["text"])
        else:
            fields = {k: v for k, v in msg.items() if k not in ("op", "id", "token_ids")}
            batch.add_chunk(msg["id"], msg["token_ids"], **fields)
    return batch.message()


@pytest.mark.parametrize("seed", range(40))
def test_a_batch_means_exactly_the_messages_it_was_built_from(seed):
    messages = _random_messages(random.Random(seed))
    wire = msgpack.unpackb(msgpack.packb(_batch_of_messages(messages)))
    assert wire["op"] == "batch"
    for name in ("text", "index", "logprobs", "finish_reason"):  # a column only where a chunk has it
        assert (name in wire) == any(name in m for m in messages if m["op"] == "token")
    assert list(expand_batch(wire)) == messages


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(n_tokens=[1]), "one entry per id"),
        (dict(n_tokens=[1, 2]), "add up"),
        (dict(n_tokens=[-1, 3]), "add up"),
        (dict(n_tokens=[1, True]), "add up"),
        (dict(text=["a"]), "one entry per id"),
        (dict(token_ids="ab"), "lists ids"),
        (dict(done=[{"op": "token"}]), "done maps"),
    ],
)
def test_a_malformed_batch_is_refused_before_anything_is_delivered(change, words):
    good = {"op": "batch", "ids": [1, 2], "n_tokens": [1, 1], "token_ids": [5, 6]}
    with pytest.raises(BadBatch, match=words):
        expand_batch({**good, **change})


def test_connection_frames_batch_only_the_connections_that_asked():
    frames = ConnectionFrames(lambda client: client == b"new")
    for client in (b"new", b"old"):
        frames.add_hot(client, [1, 2], [1, 1], [10, 20])
        frames.add_reply(client, P.token_msg(3, [30], "x", index=1))
        frames.add_reply(client, P.done_msg(1, "length", 2, 5))
    out: dict[bytes, list[dict]] = {}
    for client, frame in frames.frames():
        out.setdefault(client, []).append(msgpack.unpackb(frame))
    assert [m["op"] for m in out[b"new"]] == ["batch"]
    assert [m["op"] for m in out[b"old"]] == ["token", "token", "token", "done"]
    assert list(expand_batch(out[b"new"][0])) == out[b"old"]  # the same messages either way


def test_one_message_goes_plain_even_to_a_connection_that_asked():
    frames = ConnectionFrames(lambda client: True)
    frames.add_hot(b"c", [7], [2], [1, 2])
    assert [msgpack.unpackb(f) for _, f in frames.frames()] == [{"op": "token", "id": 7, "token_ids": [1, 2]}]


def test_a_batch_never_holds_more_maps_and_lists_than_a_client_takes():
    frames = ConnectionFrames(lambda client: True)
    entry = {"logprob": -1.0, "top_ids": [1], "top_logprobs": [-1.0]}
    for i in range(3000):  # 3000 tokens with logprobs in one CQ batch: about 12000 containers
        frames.add_reply(b"c", P.token_msg(i, [i], None, logprobs=[entry]))
    sent = frames.frames()
    assert len(sent) > 1
    expanded = []
    for _, frame in sent:
        assert len(frame) < P.DEFAULT_MAX_FRAME_BYTES * 4
        expanded += list(expand_batch(P.decode_reply(frame)))  # the client's own bounded decoder
    assert [m["id"] for m in expanded] == list(range(3000))
    assert MAX_BATCH_CONTAINERS < P.MAX_CONTAINERS_PER_FRAME


@pytest.fixture(scope="module")
def null_server():
    # a 0.5 ms step (slept): the streams advance in steps, as on a GPU
    with running_server(
        "null", n_slots=32, max_ctx=1024, token_budget=1024, null_step_us=500.0, null_step_wait="sleep"
    ) as bg:
        yield bg


def _run(peer: RawPeer, n: int, max_tokens: int, **extra) -> tuple[list[dict], dict[int, list[int]]]:
    for i in range(n):
        peer.send({"op": "generate", "id": i, "prompt_ids": PROMPT, "max_tokens": max_tokens, **extra})
    frames, tokens, done = [], {i: [] for i in range(n)}, set()
    while len(done) < n:
        msg = peer.recv()
        frames.append(msg)
        for m in expand_batch(msg) if msg["op"] == "batch" else [msg]:
            if m["op"] == "token":
                assert m["id"] not in done, "a token after its done"
                tokens[m["id"]] += m["token_ids"]
            elif m["op"] == "done":
                assert m["id"] not in done, "two dones"
                done.add(m["id"])
    return frames, tokens


def test_a_connection_that_says_hello_gets_one_frame_per_step(null_server):
    peer = RawPeer(null_server.address)
    try:
        peer.send({"op": "hello", "batch": True})
        assert peer.recv() == {"op": "hello", "protocol": "1.10", "batch": True}
        frames, tokens = _run(peer, 16, 40, detokenize=False)
        assert all(t == [PROMPT[-1] + 1 + k for k in range(40)] for t in tokens.values())
        batches = [f for f in frames if f["op"] == "batch"]
        # 16 streams in step: about one frame per step (40 steps), not one per stream (640)
        assert len(frames) < 16 * 40 / 4 and sum(len(b["ids"]) for b in batches) >= 4 * len(batches)
        assert all("text" not in b for b in batches)  # detokenize false: ids alone
        peer.send({"op": "hello", "batch": False})  # and back to per-request frames
        assert peer.recv()["batch"] is False
        frames, _ = _run(peer, 4, 10)
        assert {f["op"] for f in frames} == {"token", "done"}
    finally:
        peer.close()


def test_many_connections_each_get_their_own_streams_and_nothing_else(null_server):
    """Eight connections, the same ids on each, half of them batched: every connection gets
    exactly its own requests' tokens and one done each (the hot path groups by connection)."""
    peers = [RawPeer(null_server.address) for _ in range(8)]
    try:
        for k, peer in enumerate(peers):
            if k % 2 == 0:
                peer.send({"op": "hello", "batch": True})
                assert peer.recv()["batch"] is True
        for k, peer in enumerate(peers):
            for i in range(4):
                prompt = [300 + 50 * k + i]  # each connection's tokens are its own
                peer.send(
                    {"op": "generate", "id": i, "prompt_ids": prompt, "max_tokens": 30, "detokenize": False}
                )
        for k, peer in enumerate(peers):
            tokens, dones = {i: [] for i in range(4)}, []
            while len(dones) < 4:
                msg = peer.recv()
                for m in expand_batch(msg) if msg["op"] == "batch" else [msg]:
                    if m["op"] == "token":
                        tokens[m["id"]] += m["token_ids"]
                    else:
                        dones.append(m["id"])
            assert sorted(dones) == [0, 1, 2, 3]
            assert tokens == {i: [300 + 50 * k + i + 1 + t for t in range(30)] for i in range(4)}
            assert peer.quiet_for(0.2) == []
    finally:
        for peer in peers:
            peer.close()


def test_an_older_client_gets_the_frames_of_1_6(null_server):
    """A client that never says hello: one `token` frame per request per step, text included,
    every key of 1.6 and nothing else."""
    peer = RawPeer(null_server.address)
    try:
        frames, tokens = _run(peer, 8, 12)
        assert {f["op"] for f in frames} == {"token", "done"}
        assert all(set(f) == {"op", "id", "token_ids", "text"} for f in frames if f["op"] == "token")
        assert all(t == [PROMPT[-1] + 1 + k for k in range(12)] for t in tokens.values())
    finally:
        peer.close()


def test_a_bad_hello_and_a_bad_detokenize_are_refused_by_name(null_server):
    peer = RawPeer(null_server.address)
    try:
        peer.send({"op": "hello", "batch": "yes"})
        error = peer.recv()
        assert error["op"] == "error" and error["message"].startswith("hello: batch:")
        peer.send({"op": "generate", "id": 1, "prompt_ids": PROMPT, "max_tokens": 2, "detokenize": 0})
        done = peer.recv()
        assert done["error"]["code"] == "bad_request" and done["error"]["message"].startswith("detokenize:")
    finally:
        peer.close()


def test_ids_alone_means_no_token_strings_in_logprobs_either(null_server):
    """detokenize false: the logprobs entries carry ids and logprobs, not the tokens' texts."""
    with Client(null_server.address, timeout=30) as client:
        asked = {
            d: client.generate(prompt_ids=PROMPT, max_tokens=4, logprobs=2, detokenize=d)
            for d in (True, False)
        }
        entries = {d: [e for chunk in s for e in chunk.logprobs] for d, s in asked.items()}
    assert len(entries[True]) == len(entries[False]) == 4
    assert all(e.token is not None and e.top_tokens for e in entries[True])
    assert all(e.token is None and e.top_tokens is None for e in entries[False])
    assert [e.top_ids for e in entries[True]] == [e.top_ids for e in entries[False]]


def test_the_bundled_clients_read_batches_and_say_which_they_got(null_server):
    with Client(null_server.address, timeout=30) as client:
        streams = [client.generate(prompt_ids=PROMPT, max_tokens=30, detokenize=False) for _ in range(12)]
        assert all(s.wait().ok and s.text is None and len(s.token_ids) == 30 for s in streams)
        assert client.batched  # the server answered its hello

    async def go():
        async with AsyncClient(null_server.address, timeout=30) as client:
            streams = [await client.generate(prompt_ids=PROMPT, max_tokens=30) for _ in range(12)]
            dones = [await s.wait() for s in streams]
            return client.batched, dones, [s.token_ids for s in streams]

    import asyncio

    batched, dones, ids = asyncio.run(go())
    assert batched and all(d.ok for d in dones) and all(t == ids[0] for t in ids)


def test_the_bundled_client_takes_an_older_servers_refusal_of_hello_quietly():
    """A 1.6 server answers hello with an id-less error: the client goes on with plain frames
    and reports no error."""
    import zmq

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=10) as client:
            stream = client.generate(prompt_ids=[1], max_tokens=2)
            seen = []
            while len(seen) < 2 and router.poll(5000):
                who, frame = router.recv_multipart()
                msg = msgpack.unpackb(frame)
                seen.append(msg["op"])
                if msg["op"] == "hello":  # what a 1.6 server says to an op it does not know
                    error = P.error_msg(P.ERR_BAD_REQUEST, "unknown op 'hello'")
                    router.send_multipart([who, P.encode(error)])
                else:
                    router.send_multipart([who, P.encode(P.token_msg(msg["id"], [5, 6]))])
                    router.send_multipart([who, P.encode(P.done_msg(msg["id"], "length", 1, 2))])
            assert sorted(seen) == ["generate", "hello"]  # in either order: the client reads both kinds
            assert stream.wait().ok and stream.token_ids == [5, 6]
            assert client.last_error is None and not client.batched
    finally:
        router.close(0)
