"""The C client (clients/c) against the real server on `tiny` (protocol 1.7: the client says
`hello` first and reads per-request and batch frames alike; a 1.6 server answers the hello with
an `error` op); against fake ones in test_c_client_fake_servers.py, which shares this harness.

Built once with AddressSanitizer and UBSan (`make SANITIZE=1`, warnings as errors); every C
process runs with the sanitizers made fatal and must leave nothing on stderr that they wrote.
Real sockets on 127.0.0.1 only.  The C side is driven by the test driver
(clients/c/tests/check.c, `ringleader-c-check`), the example (`ringleader-c-generate`) and the
bench tool (`ringleader-c-bench`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ringleader.ipc.client import Client

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


def build_c_client(tmp_path_factory) -> Path:
    """The C client built with the sanitizers, once per test session (make again is a no-op: the
    batch frames' tests in test_c_client_batch.py share the build); the folder of its programs."""
    missing = _toolchain_missing()
    if missing:
        if os.environ.get("RINGLEADER_REQUIRE_FETCHED"):
            pytest.fail(f"C client toolchain missing: {missing}; {APT}")
        pytest.skip(f"C client toolchain missing: {missing}; {APT}")
    build = tmp_path_factory.getbasetemp() / "c-build"
    build.mkdir(exist_ok=True)
    proc = subprocess.run(
        ["make", "-j1", "-C", str(C_DIR), "SANITIZE=1", f"BUILD={build}"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return build


@pytest.fixture(scope="module")
def cbin(tmp_path_factory) -> Path:
    return build_c_client(tmp_path_factory)


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


@pytest.fixture(scope="module")
def batch_answer(server) -> int:
    """What the C client's hello should come to on the real server: 1 (batch frames) from a 1.7
    server, 0 from a 1.6 one (its `error` op, taken silently)."""
    with Client(server, timeout=10) as c:
        protocol = c.stats()["protocol"]
    assert protocol in ("1.6", "1.7", "1.8", "1.9", "1.10"), protocol
    return 0 if protocol == "1.6" else 1


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


def hello_line(events: list[dict]) -> dict:
    """The driver's closing "hello" line: how the server answered the client's hello."""
    (hello,) = [e for e in events if e.get("event") == "hello"]
    return hello


def server_errors(events: list[dict]) -> list[str]:
    return [e["message"] for e in events if e.get("event") == "server_error"]


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


def test_tokens_match_the_python_client(cbin, server, batch_answer):
    expected = python_results(server, REQUESTS)
    events = check(cbin, server, [line_of(kw) for kw in REQUESTS])
    # the hello was answered (1.7: batch frames; 1.6: its error op) and nothing was reported
    assert hello_line(events)["batch_frames"] == batch_answer and server_errors(events) == []
    got = by_request(events)
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


def test_many_in_flight_callbacks_and_blocking(cbin, server, batch_answer):
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
    assert all(e.get("req") != 5 for e in blocking[done5 + 1 :])
    for events in (callback, blocking):
        assert hello_line(events)["batch_frames"] == batch_answer and server_errors(events) == []


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


def test_stats_and_ping(cbin, server, batch_answer):
    events = run_c(cbin, "ringleader-c-check", "stats", "--address", server)
    stats, ping, hello = events
    assert stats["code"] == "ok" and stats["protocol"] in ("1.6", "1.7", "1.8", "1.9", "1.10")
    assert hello["batch_frames"] == batch_answer
    assert stats["vocab_size"] == 264 and stats["max_context"] == MAX_CTX
    assert ping["code"] == "ok" and 0 < ping["rtt"] < 5


def test_bench_tool(cbin, server, batch_answer, tmp_path):
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
    messages = sum(len(r["chunk_n"]) + 1 for r in out["requests"])  # token messages and dones
    # 1.6: a frame each; 1.7: batch frames carry several (the measured run's frames only)
    assert 0 < out["frames"] <= messages and (batch_answer or out["frames"] == messages)
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
