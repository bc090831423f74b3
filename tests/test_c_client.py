"""The C client (clients/c) against the real server on `tiny` and against a hostile fake one.

Built once with AddressSanitizer and UBSan (`make SANITIZE=1`, warnings as errors); every C
process runs with the sanitizers made fatal and must leave nothing on stderr that they wrote.
Real sockets on 127.0.0.1 only.  The C side is driven by the test driver
(clients/c/tests/check.c, `ringleader-c-check`), the example (`ringleader-c-generate`) and the
bench tool (`ringleader-c-bench`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from ringleader.ipc import protocol as P
from ringleader.ipc.client import Client
from ringleader.ipc.sampling_params import WIRE_FIELDS, SamplingError, SamplingParams

REPO = Path(__file__).resolve().parents[1]
C_DIR = REPO / "clients" / "c"
APT = "apt-get install -y build-essential pkg-config libzmq3-dev libmsgpack-dev  (newer Debian: libmsgpack-c-dev)"
SAN_ENV = {
    "ASAN_OPTIONS": "halt_on_error=1:detect_leaks=1:abort_on_error=0",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
}
MAX_CTX = 1024


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _toolchain_missing() -> str | None:
    for tool in ("make", "cc", "pkg-config"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    have = lambda name: subprocess.run(["pkg-config", "--exists", name]).returncode == 0  # noqa: E731
    if not have("libzmq"):
        return "libzmq headers not found (pkg-config libzmq)"
    if not (have("msgpack-c") or have("msgpack")):
        return "msgpack-c headers not found (pkg-config msgpack-c / msgpack)"
    return None


@pytest.fixture(scope="module")
def cbin(tmp_path_factory) -> Path:
    """The C client built with the sanitizers; the folder of its programs."""
    missing = _toolchain_missing()
    if missing:
        if os.environ.get("RINGLEADER_REQUIRE_FETCHED"):
            pytest.fail(f"C client toolchain missing: {missing}; {APT}")
        pytest.skip(f"C client toolchain missing: {missing}; {APT}")
    build = tmp_path_factory.mktemp("c-build")
    proc = subprocess.run(
        ["make", "-j1", "-C", str(C_DIR), "SANITIZE=1", f"BUILD={build}"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return build


def start_server(address: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ringleader.hostctl.cli", "serve", "--model", "tiny", "--bind", address]
    cmd += ["--slots", "8", "--max-ctx", str(MAX_CTX), "--threads", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(
                f"server exited {proc.returncode}: {proc.stderr.read()[-3000:] if proc.stderr else ''}"
            )
        try:
            with Client(address, timeout=1.0, connect_timeout=1.0) as c:
                c.ping()
            return proc
        except Exception:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("server did not answer ping within 120 s")
            time.sleep(0.3)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    if proc.stderr:
        proc.stderr.close()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    address = free_address()
    proc = start_server(address)
    yield address
    stop_server(proc)


def check_sanitizers(stderr: str) -> None:
    assert "runtime error" not in stderr, stderr
    assert "ERROR: AddressSanitizer" not in stderr, stderr
    assert "ERROR: LeakSanitizer" not in stderr, stderr


def run_c(
    cbin: Path, program: str, *args: str, stdin: str = "", timeout: float = 60, rc: int = 0
) -> list[dict]:
    """Runs a C program, checks its exit code and the sanitizers; its stdout as JSON lines."""
    env = dict(os.environ, **SAN_ENV)
    proc = subprocess.run(
        [str(cbin / program), *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=env
    )
    check_sanitizers(proc.stderr)
    assert proc.returncode == rc, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def check(cbin: Path, address: str, lines: list[str], *opts: str, timeout: float = 60) -> list[dict]:
    return run_c(
        cbin,
        "ringleader-c-check",
        "run",
        "--address",
        address,
        *opts,
        stdin="\n".join(lines) + "\n",
        timeout=timeout,
    )


def by_request(events: list[dict]) -> dict[int, dict]:
    """Per request index: its token ids and text (choice 0), and its one done."""
    out: dict[int, dict] = {}
    for e in events:
        if "req" not in e:
            continue
        r = out.setdefault(e["req"], {"ids": [], "text": "", "dones": [], "logprobs": []})
        if e["event"] == "token" and e["index"] == 0:
            r["ids"] += e["token_ids"]
            r["text"] += e["text"] or ""
            r["logprobs"] += e["logprobs"] or []
        elif e["event"] == "done":
            r["dones"].append(e)
    for r in out.values():
        assert len(r["dones"]) == 1, r
        r["done"] = r["dones"][0]
    return out


def line_of(kw: dict) -> str:
    """A check.c request line for the generate keywords `kw`."""
    parts = []
    for key, value in kw.items():
        if key == "prompt_ids":
            parts.append("ids=" + ",".join(map(str, value)))
        elif key == "stop_token_ids":
            parts.append("stop=" + ",".join(map(str, value)))
        elif key != "prompt":
            parts.append(f"{key}={int(value) if isinstance(value, bool) else value}")
    if "prompt" in kw:
        parts.append("text=" + kw["prompt"])
    return " ".join(parts)


REQUESTS = [
    dict(prompt_ids=[1, 2, 3], max_tokens=12),
    dict(prompt_ids=[5, 6, 7, 8], max_tokens=10, temperature=0.8, seed=11),
    dict(prompt_ids=[9, 10], max_tokens=10, temperature=1.2, seed=3, top_k=20, top_p=0.9),
    dict(prompt="Hello there", max_tokens=9),
    dict(prompt="The sky is", max_tokens=8, temperature=0.7, seed=5, min_p=0.05, top_k=40),
    dict(
        prompt_ids=[4, 4, 4], max_tokens=10, ignore_eos=True, repetition_penalty=1.3, seed=9, temperature=0.5
    ),
]


def python_results(address: str, requests: list[dict]) -> list[tuple]:
    """Per request: choice 0's ids, text and logprobs ([logprob, top ids] each), the finish, the
    completion tokens of all choices."""
    out = []
    with Client(address, timeout=60) as c:
        for kw in requests:
            s = c.complete(**kw)
            assert s.done is not None
            lps = [[e.logprob, e.top_ids] for e in s.logprobs or []]
            out.append((s.token_ids, s.text or "", lps, s.done.finish_reason, s.done.completion_tokens))
    return out


# ---------------------------------------------------------------- against the real server


def test_tokens_match_the_python_client(cbin, server):
    expected = python_results(server, REQUESTS)
    got = by_request(check(cbin, server, [line_of(kw) for kw in REQUESTS]))
    for i, (ids, text, lps, finish, completion) in enumerate(expected):
        assert got[i]["ids"] == ids, (i, REQUESTS[i])
        assert got[i]["text"] == text, i
        assert got[i]["logprobs"] == lps, i
        assert got[i]["done"]["finish_reason"] == finish
        assert got[i]["done"]["completion_tokens"] == completion
        assert got[i]["done"]["error_code"] is None
    # the example program: the same tokens, and its --json lines
    for i in (1, 3):
        kw = REQUESTS[i]
        args = ["--address", server, "--max-tokens", str(kw["max_tokens"]), "--json"]
        args += (
            ["--prompt", kw["prompt"]]
            if "prompt" in kw
            else ["--prompt-ids", ",".join(map(str, kw["prompt_ids"]))]
        )
        for key in ("temperature", "seed", "top_k", "top_p"):
            if key in kw:
                args += ["--" + key.replace("_", "-"), str(kw[key])]
        events = run_c(cbin, "ringleader-c-generate", *args)
        assert [t for e in events if e["event"] == "token" for t in e["token_ids"]] == expected[i][0]
        assert "".join(e["text"] or "" for e in events if e["event"] == "token") == expected[i][1]
        assert [e["event"] for e in events][-1] == "done"


def test_many_in_flight_callbacks_and_blocking(cbin, server):
    requests = [dict(prompt_ids=[i + 1, i + 2], max_tokens=6 + 3 * i, ignore_eos=True) for i in range(6)]
    lines = [line_of(kw) for kw in requests]
    callback = check(cbin, server, lines)
    blocking = check(cbin, server, lines, "--form", "blocking")
    a, b = by_request(callback), by_request(blocking)
    for i, kw in enumerate(requests):
        assert a[i]["ids"] == b[i]["ids"] and len(a[i]["ids"]) == kw["max_tokens"]
        assert a[i]["done"]["finish_reason"] == b[i]["done"]["finish_reason"] == "length"
    # callbacks: the requests were in flight together (a token of the last before the first's done)
    first_done = next(k for k, e in enumerate(callback) if e["event"] == "done")
    assert any(e["event"] == "token" and e["req"] == 5 for e in callback[:first_done])
    # blocking: the last request was read first, the others buffered meanwhile
    assert blocking[0]["req"] == 5
    done5 = next(k for k, e in enumerate(blocking) if e["event"] == "done")
    assert blocking[done5]["req"] == 5
    assert all(e["req"] != 5 for e in blocking[done5 + 1 :])


@pytest.mark.parametrize("reason", ["abort", "stop"])
def test_abort_mid_stream(cbin, server, reason):
    line = "ids=1,2,3 max_tokens=900 ignore_eos=1"
    events = check(
        cbin, server, [line, "ids=4,5 max_tokens=5"], "--abort-after", "2", "--abort-reason", reason
    )
    assert {"req": 0, "event": "abort_sent", "code": "ok"} in events
    r = by_request(events)
    assert r[0]["done"]["finish_reason"] == reason
    assert r[0]["done"]["error_code"] is None
    assert 2 <= len(r[0]["ids"]) < 900
    assert r[1]["done"]["finish_reason"] == "length"  # the other request went on


def test_stats_and_ping(cbin, server):
    events = run_c(cbin, "ringleader-c-check", "stats", "--address", server)
    stats, ping = events
    assert stats["code"] == "ok" and stats["protocol"] == "1.6"
    assert stats["vocab_size"] == 264 and stats["max_context"] == MAX_CTX
    assert ping["code"] == "ok" and 0 < ping["rtt"] < 5


def test_bench_tool(cbin, server, tmp_path):
    reqs = tmp_path / "requests.txt"
    specs = [(5 + i, [1 + i, 2, 3 + i]) for i in range(8)]
    reqs.write_text("".join(f"{m} {' '.join(map(str, ids))}\n" for m, ids in specs))
    env = dict(os.environ, **SAN_ENV)
    proc = subprocess.run(
        [str(cbin / "ringleader-c-bench"), "--address", server, "--requests-file", str(reqs)]
        + ["--concurrency", "4", "--warmup", "2", "--ignore-eos", "--temperature", "0.5", "--seed", "7"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    check_sanitizers(proc.stderr)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["client"] == "c" and out["concurrency"] == 4
    assert out["wall_s"] > 0 and out["cpu_user_s"] >= 0 and out["cpu_sys_s"] >= 0
    assert [r["index"] for r in out["requests"]] == list(range(8))
    for r, (m, ids) in zip(out["requests"], specs):
        assert r["error_code"] is None and r["error_message"] is None, r
        assert r["finish_reason"] == "length" and r["max_tokens"] == m and r["prompt_tokens"] == len(ids)
        assert sum(r["chunk_n"]) == m == r["completion_tokens"]
        assert len(r["chunk_t"]) == len(r["chunk_n"])
        assert r["send_t"] <= r["chunk_t"][0] <= r["chunk_t"][-1] <= r["done_t"]
        assert r["server_queue_ms"] is None or r["server_queue_ms"] >= 0


def test_server_killed_mid_stream_ends_disconnected(cbin):
    address = free_address()
    proc = start_server(address)
    try:
        env = dict(os.environ, **SAN_ENV)
        args = [str(cbin / "ringleader-c-check"), "run", "--address", address, "--reply-timeout-ms", "1500"]
        c = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        assert c.stdin and c.stdout
        c.stdin.write("ids=1,2,3 max_tokens=900 ignore_eos=1\n")
        c.stdin.close()
        c.stdin = None  # communicate() below must not flush it
        first = json.loads(c.stdout.readline())
        assert first["event"] == "token"
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        out, err = c.communicate(timeout=30)
    finally:
        stop_server(proc)
    check_sanitizers(err)
    assert c.returncode == 0, err
    done = [json.loads(line) for line in out.splitlines() if '"done"' in line]
    assert len(done) == 1 and done[0]["error_code"] == "disconnected" and done[0]["local"]
    assert done[0]["t"] - killed < 1.5 + 2.0  # reply_timeout, and some slack


def test_no_server_ends_disconnected_within_connect_timeout(cbin):
    start = time.monotonic()
    events = check(cbin, free_address(), ["ids=1 max_tokens=4"], "--connect-timeout-ms", "1000")
    (done,) = [e for e in events if e["event"] == "done"]
    assert done["error_code"] == "disconnected" and "no connection" in done["error_message"]
    assert 1.0 <= done["t"] - start < 3.5


# ---------------------------------------------------------------- against a fake server


def pk(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class FakeServer:
    """A ROUTER on 127.0.0.1 that records every frame and answers a generate with the raw frames
    `answer(msg)` returns; a ping gets its pong unless `pong` is False."""

    def __init__(self, answer: Callable[[dict], list[bytes]] = lambda msg: [], pong: bool = True):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.frames: list[bytes] = []
        self.answer, self.pong = answer, pong
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
            elif msg.get("op") == "generate":
                for reply in self.answer(msg):
                    self.sock.send_multipart([ident, reply])

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
    fake = FakeServer(hostile_answer)
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
    assert {"event": "server_error", "message": "not a request"} in events


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
    ("max_tokens", "max_tokens=0"),
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
            refused, ping = run_c(cbin, "ringleader-c-check", "invalid", "--address", fake.address, setting)
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
    assert set(fake.ops()) == {"ping"}  # nothing refused ever left the client


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
    assert fake.ops() == ["generate", "ping"]  # one keep-alive ping, at a third of reply_timeout
