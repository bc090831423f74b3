"""The C client (clients/c) against fake servers on real ROUTER sockets on 127.0.0.1: a hostile
one (malformed replies, a silent one), and a miniature 1.7 server that sends batch frames (the
decoder's unit checks, batches that mean their token and done messages, the bench tool on them,
a hello on every new connection).  The harness (the sanitized build, the check driver) is
test_c_client.py's."""

from __future__ import annotations

import json
import math
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import zmq
from test_c_client import (
    REQUESTS,
    SAN_ENV,
    build_c_client,
    by_request,
    check,
    check_sanitizers,
    hello_line,
    line_of,
    run_c,
    server_errors,
)

from ringleader.ipc import protocol as P
from ringleader.ipc.sampling_params import WIRE_FIELDS, SamplingError, SamplingParams


@pytest.fixture(scope="module")
def cbin(tmp_path_factory) -> Path:
    return build_c_client(tmp_path_factory)


# ---------------------------------------------------------------- against a fake server


def pk(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


HELLO_FRAME = pk({"op": "hello", "batch": True})  # what a 1.7 client sends first
HELLO_16_ERROR = pk({"op": "error", "id": None, "code": "bad_request", "message": "unknown op 'hello'"})


class FakeServer:
    """A ROUTER on 127.0.0.1 that records every frame and answers a generate with the raw frames
    `answer(msg)` returns; a ping gets its pong unless `pong` is False; a hello gets `hello` (None:
    no answer at all)."""

    def __init__(
        self,
        answer: Callable[[dict], list[bytes]] = lambda msg: [],
        pong: bool = True,
        hello: bytes | None = None,
        rebind_after_generates: int = 0,
    ):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.frames: list[bytes] = []
        self.answer, self.pong, self.hello = answer, pong, hello
        self.rebind_after, self.generates = rebind_after_generates, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, *rest = self.sock.recv_multipart()
            frame = rest[-1] if rest else b""
            self.frames.append(frame)
            msg = msgpack.unpackb(frame)
            if msg.get("op") == "ping" and self.pong:
                self.sock.send_multipart([ident, pk({"op": "pong"})])
            elif msg.get("op") == "hello" and self.hello is not None:
                self.sock.send_multipart([ident, self.hello])
            elif msg.get("op") == "generate":
                for reply in self.answer(msg):
                    self.sock.send_multipart([ident, reply])
                self.generates += 1
                if self.generates == self.rebind_after:
                    self._rebind()

    def _rebind(self) -> None:
        """Goes away and comes back on the same address: the client's next connection is new."""
        time.sleep(0.2)  # the replies just sent reach the client first
        self.sock.close()
        deadline = time.monotonic() + 5
        while True:
            self.sock = self.ctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            try:
                self.sock.bind(self.address)
                return
            except zmq.ZMQError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def ops(self) -> list[str]:
        return [msgpack.unpackb(f).get("op") for f in self.frames]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        self.ctx.term()


def done_frame(rid: int, **fields) -> bytes:
    return pk({"op": "done", "id": rid, "finish_reason": "length", **fields})


def hostile_answer(msg: dict) -> list[bytes]:
    """Scenario prompt_ids[0]: garbage around a request's replies (see test_malformed_replies)."""
    rid, scenario = msg["id"], msg["prompt_ids"][0]
    head = lambda n, op: bytes([0x80 + n]) + pk("op") + pk(op) + pk("id") + pk(rid)  # noqa: E731
    claim = lambda n: b"\xdd" + n.to_bytes(4, "big")  # noqa: E731
    token = lambda **f: pk({"op": "token", "id": rid, **f})  # noqa: E731
    if scenario == 0:  # tokens: only the two good ones count
        return [
            b"\xc1\xc1 not msgpack",
            pk(5),
            pk([1, 2, 3]),
            b"",
            token(token_ids="abc"),
            head(3, "token") + pk("token_ids") + claim(10**6) + pk(1) + pk(2),
            token(token_ids=["1", "2"]),
            token(token_ids=[1], text=5),
            token(token_ids=[1], index=-1),
            token(token_ids=[1], index=None),
            token(token_ids=[-1]),
            token(token_ids=[1 << 40]),
            token(token_ids=[1], finish_reason="bored"),
            token(token_ids=[1, 2], logprobs=[{"logprob": 0.0, "top_ids": [], "top_logprobs": []}]),
            token(token_ids=[1], logprobs=[{"logprob": "x", "top_ids": [], "top_logprobs": []}]),
            pk({"op": "token", "id": "x", "token_ids": [1]}),
            pk({"op": "token", "id": rid + 1000, "token_ids": [1]}),
            pk({"op": "token", "id": True, "token_ids": [1]}),
            pk({"op": "token", "id": float(rid), "token_ids": [1]}),
            pk({"op": "frobnicate", "id": rid}),
            pk({"op": 7, "id": rid}),
            head(3, "token") + pk("token_ids") + pk([3]) + pk("text") + b"\xa2\xff\xfe",  # bad UTF-8
            head(3, "token") + pk("token_ids") + pk([1]) + pk("extra") + b"\x91" * 11000 + b"\x90",
            token(token_ids=[1]) + b"\x00",  # trailing bytes
            token(token_ids=[1], text=b"bin"),
            token(token_ids=[7, 8], text="ok", future_field={"a": [1, 2]}),
            token(token_ids=[9], text="x" * 300_000),
            done_frame(rid, usage={"prompt_tokens": 1, "completion_tokens": 3}, timing={"queue_ms": 1.5}),
            done_frame(rid, finish_reason="stop"),  # after the done: ignored
            token(token_ids=[1]),
        ]
    bad_dones = {
        1: done_frame(rid, usage={"prompt_tokens": "many", "completion_tokens": 1}),
        2: done_frame(rid, usage=5),
        3: head(3, "done") + pk("choices") + claim(10**6) + pk(1),
        4: done_frame(rid, finish_reason=5),
        5: done_frame(rid, choices=[{"index": "a", "finish_reason": "stop", "completion_tokens": 1}]),
        6: done_frame(rid, usage={"prompt_tokens": -1}),
        7: done_frame(rid, usage={"prompt_tokens": (1 << 64) - 1}),
        8: done_frame(rid, error="string"),
        9: done_frame(rid, finish_reason=None),
        10: head(2, "done") + b"\xc1",
        11: done_frame(rid, error={"code": 5, "message": "m"}),
    }
    if scenario in bad_dones:
        return [bad_dones[scenario], done_frame(rid)]  # the second: after the done, ignored
    if scenario == 20:
        return [
            pk({"op": "error", "id": None, "code": "bad_request", "message": "not a request"}),
            done_frame(rid, finish_reason="error", error={"code": "overloaded", "message": "busy"}),
        ]
    if scenario == 21:
        return [done_frame(rid, finish_reason="error", error={"code": "weird", "message": "m"})]
    if scenario == 22:
        ends = [{"index": i, "finish_reason": "length", "completion_tokens": 2} for i in range(2)]
        return [done_frame(rid, choices=ends, timing={"queue_ms": math.nan})]
    return [done_frame(rid)]


@pytest.mark.parametrize("form", ["callback", "blocking"])
def test_malformed_replies(cbin, form):
    fake = FakeServer(hostile_answer, hello=HELLO_16_ERROR)  # a 1.6 server's answer to the hello
    scenarios = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 20, 21, 22]
    try:
        events = check(cbin, fake.address, [f"ids={s} max_tokens=4" for s in scenarios], "--form", form)
    finally:
        fake.close()
    got = by_request(events)
    ok = got[0]
    assert ok["ids"] == [7, 8, 9] and ok["text"] == "ok" + "x" * 300_000
    assert ok["done"]["finish_reason"] == "length" and ok["done"]["error_code"] is None
    assert ok["done"]["queue_ms"] == 1.5 and ok["done"]["completion_tokens"] == 3
    for k in range(1, 12):
        d = got[k]["done"]
        assert (d["finish_reason"], d["error_code"], d["local"]) == ("error", "bad_reply", True), (k, d)
        assert d["error_message"] == "malformed done message from the server"
    overloaded, weird, choices = got[12]["done"], got[13]["done"], got[14]["done"]
    assert (overloaded["error_code"], overloaded["error_message"]) == ("overloaded", "busy")
    assert (weird["error_code"], weird["error_code_str"]) == ("unknown", "weird")
    assert choices["n_choices"] == 2 and choices["error_code"] is None and choices["queue_ms"] is None
    # the hello's error op was taken as its answer, silently; the later one is reported
    assert server_errors(events) == ["not a request"] and hello_line(events)["batch_frames"] == 0
    assert fake.frames[0] == HELLO_FRAME


BAD_FIELDS = [
    ("temperature", "temperature=nan"),
    ("temperature", "temperature=-1"),
    ("temperature", "temperature=inf"),
    ("temperature", "temperature=1e39"),
    ("top_p", "top_p=0"),
    ("top_p", "top_p=1.5"),
    ("top_k", "top_k=2000"),
    ("top_k", "top_k=-2"),
    ("min_p", "min_p=1.5"),
    ("presence_penalty", "presence_penalty=3"),
    ("frequency_penalty", "frequency_penalty=-2.5"),
    ("repetition_penalty", "repetition_penalty=0"),
    ("max_tokens", "max_tokens=-1"),
    ("max_tokens", "max_tokens=4294967296"),
    ("n", "n=0"),
    ("n", "n=129"),
    ("logprobs", "logprobs=21"),
    ("priority", "priority=1001"),
    ("timeout_ms", "timeout_ms=0"),
    ("stop_token_ids", "stop=1,2,3,4,5,6,7,8,9"),
    ("prompt_ids", "ids=-1"),
    ("prompt", "text=Hello"),  # and prompt_ids too: exactly one of them
]


def py_number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def test_local_validation_refuses_without_sending(cbin):
    fake = FakeServer(lambda msg: [done_frame(msg["id"])])
    try:
        for field, setting in BAD_FIELDS:
            refused, ping, _ = run_c(
                cbin, "ringleader-c-check", "invalid", "--address", fake.address, setting
            )
            assert refused["code"] == "invalid_argument" and refused["in_flight"] == 0, (setting, refused)
            assert refused["message"].startswith(field + ": "), (setting, refused)
            assert ping["code"] == "ok"
            if field in WIRE_FIELDS:  # a sampling field: refused in the Python client's words
                key, _, text = setting.partition("=")
                value = [int(t) for t in text.split(",")] if key == "stop" else py_number(text)
                with pytest.raises(SamplingError) as err:
                    SamplingParams(**{field: value})
                assert refused["message"] == str(err.value)
    finally:
        fake.close()
    assert set(fake.ops()) == {"hello", "ping"}  # nothing refused ever left the client


def test_generate_frames_equal_the_python_clients(cbin):
    fake = FakeServer(lambda msg: [done_frame(msg["id"])])
    requests = REQUESTS + [
        dict(
            prompt_ids=[1], max_tokens=3, priority=-5, timeout_ms=2500, stop_token_ids=[3, 4], n=2, logprobs=0
        )
    ]
    try:
        check(cbin, fake.address, [line_of(kw) for kw in requests])
    finally:
        fake.close()
    sent = [f for f in fake.frames if msgpack.unpackb(f)["op"] == "generate"]
    assert len(sent) == len(requests)
    for i, (frame, kw) in enumerate(zip(sent, requests)):
        kw = dict(kw)
        prompt, prompt_ids = kw.pop("prompt", None), kw.pop("prompt_ids", None)
        priority, timeout_ms = kw.pop("priority", 0), kw.pop("timeout_ms", None)
        want = P.GenerateRequest(i + 1, prompt, prompt_ids, SamplingParams(**kw), priority, timeout_ms)
        assert frame == P.encode(P.generate_msg(want)), (msgpack.unpackb(frame), P.generate_msg(want))


def test_silent_server_keepalive_then_disconnected(cbin):
    fake = FakeServer(pong=False)
    start = time.monotonic()
    try:
        events = check(cbin, fake.address, ["ids=1 max_tokens=4"], "--reply-timeout-ms", "1500")
    finally:
        fake.close()
    (done,) = [e for e in events if e["event"] == "done"]
    assert done["error_code"] == "disconnected" and "no reply" in done["error_message"]
    assert 1.5 <= done["t"] - start < 4.0
    # the hello (never answered: nothing waited for it), then one keep-alive ping at a third of
    # reply_timeout
    assert fake.ops() == ["hello", "generate", "ping"]


# ---------------------------------------------------------------- batch frames (protocol 1.7)


def test_batch_decoder_unit_checks(cbin):
    """clients/c/tests/batch_checks.c: hand-made batch frames through the decoder (exits 1 when a
    check fails)."""
    lines = run_c(cbin, "ringleader-c-check", "unit")
    assert [line for line in lines if not line["ok"]] == []
    names = {line["check"] for line in lines}
    assert {
        "several_chunks_text_nil_and_present_then_a_done",
        "done_entries_judged_one_by_one",
        "text_list_shorter_than_chunks",
        "n_tokens_sum_above_token_ids",
        "truncated",
    } <= names


PLAIN_FRAMES = 99  # a request whose prompt starts with this gets per-request token/done frames


def batch_frame(chunks: list[dict], dones: list[dict]) -> bytes:
    """The batch frame that means `chunks` (token messages: id, ids, text, index, logprobs,
    finish_reason) and then `dones` (protocol.md "batch")."""
    m: dict = {"op": "batch", "ids": [c["id"] for c in chunks], "n_tokens": [len(c["ids"]) for c in chunks]}
    m["token_ids"] = [t for c in chunks for t in c["ids"]]
    for key in ("text", "index", "logprobs", "finish_reason"):
        if any(c[key] is not None for c in chunks):
            m[key] = [c[key] for c in chunks]
    if dones:
        m["done"] = dones
    return pk(m)


def token_frame(chunk: dict) -> bytes:
    m = {"op": "token", "id": chunk["id"], "token_ids": chunk["ids"]}
    m.update({k: chunk[k] for k in ("text", "index", "logprobs", "finish_reason") if chunk[k] is not None})
    return pk(m)


class BatchServer:
    """A 1.7 server in miniature on a real ROUTER on 127.0.0.1. It answers a hello only once a
    generate has come on that connection (a client that waited for the answer would hang), then
    steps every 2 ms: one batch frame per connection with the next token of each of its streams
    (the choices of an n > 1 request with index and finish_reason, text on every other token,
    logprobs when asked, a text-only tail chunk before a single choice ends) and the dones of those
    that ended. A request whose prompt starts with PLAIN_FRAMES gets per-request token and done
    frames instead, between the batches. Steps 2 and 4 first send a malformed batch (a list not one
    entry per chunk; n_tokens not summing to the token ids) that would abort a request if it meant
    anything. `meant[id]`: the chunks and the done a request was sent; `frames_sent`: every frame."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.frames: list[bytes] = []
        self.meant: dict[int, dict] = {}
        self.frames_sent = self.steps = self.widest_batch = 0
        self.conns: dict[bytes, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _send(self, ident: bytes, frame: bytes) -> None:
        self.sock.send_multipart([ident, frame])
        self.frames_sent += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = any(c["streams"] for c in self.conns.values())
            if self.sock.poll(2 if busy else 50):
                while True:
                    try:
                        ident, frame = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frame(ident, frame)
            if any(c["streams"] for c in self.conns.values()):
                self.steps += 1
                for ident, conn in self.conns.items():
                    self._step(ident, conn)

    def _on_frame(self, ident: bytes, frame: bytes) -> None:
        self.frames.append(frame)
        msg = msgpack.unpackb(frame)
        conn = self.conns.setdefault(ident, {"hello_unanswered": False, "streams": []})
        if msg["op"] == "hello":
            conn["hello_unanswered"] = True
        elif msg["op"] == "ping":
            self._send(ident, pk({"op": "pong"}))
        elif msg["op"] == "generate":
            if conn["hello_unanswered"]:  # only now: the client went on without it
                conn["hello_unanswered"] = False
                self._send(ident, pk({"op": "hello", "protocol": "1.7", "batch": True}))
            rid, n = msg["id"], msg.get("n", 1)
            choices = [{"index": i, "left": msg["max_tokens"], "k": 0} for i in range(n)]
            stream = {"id": rid, "n": n, "logprobs": msg.get("logprobs"), "choices": choices}
            stream.update(plain=msg["prompt_ids"][0] == PLAIN_FRAMES, first=msg["prompt_ids"][0])
            stream["prompt_tokens"] = len(msg["prompt_ids"])
            conn["streams"].append(stream)
            self.meant[rid] = {"chunks": [], "done": None}

    def _chunks_of(self, st: dict, ch: dict) -> list[dict]:
        k, single = ch["k"], st["n"] == 1
        ch["k"], ch["left"] = k + 1, ch["left"] - 1
        tid = (st["first"] * 7 + 31 * ch["index"] + k) % 264
        lp = -0.25 * (k + 1)
        lps = None if st["logprobs"] is None else [{"logprob": lp, "top_ids": [tid], "top_logprobs": [lp]}]
        chunk = {"id": st["id"], "ids": [tid], "text": f"<{tid}>" if k % 2 == 0 else None, "logprobs": lps}
        chunk["index"] = None if single else ch["index"]
        chunk["finish_reason"] = "length" if not single and ch["left"] == 0 else None
        if not (single and ch["left"] == 0):
            return [chunk]
        tail = {"id": st["id"], "ids": [], "text": "\ufffd", "index": None, "finish_reason": None}
        tail["logprobs"] = None if st["logprobs"] is None else []
        return [chunk, tail]

    def _step(self, ident: bytes, conn: dict) -> None:
        chunks, dones, plain = [], [], []
        for st in list(conn["streams"]):
            for ch in st["choices"]:
                if ch["left"] > 0:
                    made = self._chunks_of(st, ch)
                    self.meant[st["id"]]["chunks"] += made
                    (plain if st["plain"] else chunks).extend(made)
            if all(ch["left"] == 0 for ch in st["choices"]):
                completion = sum(ch["k"] for ch in st["choices"])
                done = {"op": "done", "id": st["id"], "finish_reason": "length", "timing": {"queue_ms": 0.5}}
                done["usage"] = {"prompt_tokens": st["prompt_tokens"], "completion_tokens": completion}
                if st["n"] > 1:
                    done["choices"] = [
                        {"index": ch["index"], "finish_reason": "length", "completion_tokens": ch["k"]}
                        for ch in st["choices"]
                    ]
                self.meant[st["id"]]["done"] = done
                conn["streams"].remove(st)
                if st["plain"]:
                    plain.append(done)
                else:
                    dones.append(done)
        if self.steps in (2, 4) and chunks:  # malformed: means nothing, or it would abort one
            ids = [c["id"] for c in chunks]
            bad = {"op": "batch", "ids": ids, "n_tokens": [1] * len(ids), "token_ids": [5] * len(ids)}
            bad["done"] = [{"op": "done", "id": ids[0], "finish_reason": "abort"}]
            if self.steps == 2:
                bad["text"] = ["x"] * (len(ids) + 1)
            else:
                bad["token_ids"] = [5] * (len(ids) + 1)
            self._send(ident, pk(bad))
        for m in plain:
            self._send(ident, pk(m) if m.get("op") == "done" else token_frame(m))
        if chunks or dones:
            width = len({c["id"] for c in chunks} | {d["id"] for d in dones})
            self.widest_batch = max(self.widest_batch, width)
            self._send(ident, batch_frame(chunks, dones))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        self.ctx.term()


def c_tokens(events: list[dict], req: int) -> list[tuple]:
    return [
        (e["index"], e["token_ids"], e["text"], e["finish_reason"], e["logprobs"])
        for e in events
        if e.get("req") == req and e["event"] == "token"
    ]


def meant_tokens(chunks: list[dict]) -> list[tuple]:
    def lps(c: dict):
        return None if c["logprobs"] is None else [[e["logprob"], e["top_ids"]] for e in c["logprobs"]]

    return [(c["index"] or 0, c["ids"], c["text"], c["finish_reason"], lps(c)) for c in chunks]


BATCH_REQUESTS = [
    "ids=1,2 max_tokens=5",
    "ids=3 max_tokens=3 logprobs=1",
    "ids=4,5 max_tokens=4 n=2",
    f"ids={PLAIN_FRAMES},1 max_tokens=4",
    "ids=7 max_tokens=1",
    "ids=8,8,8 max_tokens=7 logprobs=0 n=3",
]


@pytest.mark.parametrize("form", ["callback", "blocking"])
def test_batch_frames_mean_their_token_and_done_messages(cbin, form):
    fake = BatchServer()
    try:
        events = check(cbin, fake.address, BATCH_REQUESTS, "--form", form)
    finally:
        fake.close()
    # hello first, byte for byte; the generates went on without its answer (sent after them)
    assert fake.frames[0] == HELLO_FRAME
    assert [msgpack.unpackb(f)["op"] for f in fake.frames] == ["hello"] + ["generate"] * len(BATCH_REQUESTS)
    assert hello_line(events)["batch_frames"] == 1 and server_errors(events) == []
    assert hello_line(events)["frames"] == fake.frames_sent  # each frame counted once
    assert fake.widest_batch >= 3  # batches carried several requests
    got = by_request(events)
    for req in range(len(BATCH_REQUESTS)):
        meant = fake.meant[req + 1]
        assert c_tokens(events, req) == meant_tokens(meant["chunks"]), req
        done, want = got[req]["done"], meant["done"]
        assert (done["finish_reason"], done["error_code"], done["local"]) == ("length", None, False)
        assert done["completion_tokens"] == want["usage"]["completion_tokens"]
        assert done["n_choices"] == len(want.get("choices", [])) and done["queue_ms"] == 0.5


def test_bench_tool_on_batch_frames(cbin, tmp_path):
    fake = BatchServer()
    reqs = tmp_path / "requests.txt"
    specs = [(3 + i, [1 + i, 2]) for i in range(7)]
    reqs.write_text("".join(f"{m} {' '.join(map(str, ids))}\n" for m, ids in specs))
    env = dict(os.environ, **SAN_ENV)
    try:
        proc = subprocess.run(
            [str(cbin / "ringleader-c-bench"), "--address", fake.address, "--requests-file", str(reqs)]
            + ["--concurrency", "3", "--warmup", "0", "--ignore-eos"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    finally:
        fake.close()
    check_sanitizers(proc.stderr)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for r, (m, _) in zip(out["requests"], specs, strict=True):
        assert r["error_code"] is None and r["finish_reason"] == "length", r
        assert sum(r["chunk_n"]) == m == r["completion_tokens"]
        assert r["chunk_n"] == [1] * m + [0]  # one per chunk: every token, then the text tail
        assert r["send_t"] <= r["chunk_t"][0] <= r["chunk_t"][-1] <= r["done_t"]
    messages = sum(len(r["chunk_n"]) + 1 for r in out["requests"])
    # the frames received (the hello's answer, batches, malformed ones): fewer than the messages
    assert out["frames"] == fake.frames_sent < messages


def test_hello_again_on_a_new_connection(cbin):
    hello_17 = pk({"op": "hello", "protocol": "1.7", "batch": True})
    fake = FakeServer(lambda msg: [done_frame(msg["id"])], hello=hello_17, rebind_after_generates=1)
    try:
        events = check(
            cbin, fake.address, ["ids=1 max_tokens=2", "ids=2 max_tokens=2"], "--one-by-one", "1500"
        )
    finally:
        fake.close()
    got = by_request(events)
    assert [got[i]["done"]["finish_reason"] for i in (0, 1)] == ["length", "length"]
    assert fake.ops() == ["hello", "generate", "hello", "generate"]  # the second connection's first
    assert hello_line(events)["batch_frames"] == 1
