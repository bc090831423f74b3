"""A newcomer's second hour (issue 55), as the command line meets it: a client command's mistake
or a server that does not answer is one line naming the flag, not a traceback; --timeout governs
the wait for a server still loading its model; the C client's build names the packages it
lacks; `serve` logs each phase of a model's load with its time, names its flags in its
refusals, and stops within --drain-timeout + 5 s.  Real sockets on 127.0.0.1, free ports."""

from __future__ import annotations

import logging
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from ringleader.hostctl import cli
from ringleader.ipc.client import AsyncClient, Client
from ringleader.ipc.client import core as client_core
from tests.conftest import RawPeer

CLI = [sys.executable, "-m", "ringleader.hostctl.cli"]
C_DIR = Path(__file__).resolve().parents[1] / "clients" / "c"


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture
def silent_server():
    """A ROUTER bound on a free port that never answers (as `serve` while its model loads:
    bound, connected, silent, not even a pong)."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    router.close(0)


# ---------------------------------------------------------------- client commands: one line each


@pytest.mark.parametrize("command", [["generate", "hi"], ["stats"], ["wait-ready"]])
def test_connect_without_a_transport_is_one_line_naming_the_flag(command, capsys):
    assert cli.main([*command, "--connect", "127.0.0.1:5555"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == (
        f"ringleader {command[0]}: --connect: '127.0.0.1:5555' is not a ZeroMQ address: "
        "it needs a transport, e.g. tcp://127.0.0.1:5555"
    )
    assert cli.main([*command, "--connect", "tcp://localhost"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"ringleader {command[0]}: --connect: 'tcp://localhost' names no port: ")
    assert "expected tcp://HOST:PORT" in line


def test_every_client_refuses_an_address_without_a_transport():
    for make in (Client, AsyncClient):
        with pytest.raises(
            ValueError, match=r"^'127\.0\.0\.1:5555' is not a ZeroMQ address: it needs a transport"
        ):
            make("127.0.0.1:5555")


@pytest.mark.parametrize("command", [["stats"], ["generate", "hi"]])
def test_no_server_is_one_line_and_exit_1(command):
    address = free_address()
    started = time.monotonic()
    r = subprocess.run(
        CLI + [*command, "--connect", address, "--connect-timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1, r.stderr
    assert one_line(r.stderr) == (
        f"ringleader {command[0]}: no server answered at {address} within 1 s "
        "(--connect-timeout; is `ringleader serve` running there?)"
    )
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--priority", str(10**30), "argument --priority: must be an integer in [-1000, 1000], got 1000000"),
        ("--priority", "-1001", "argument --priority: must be an integer in [-1000, 1000], got -1001"),
        (
            "--timeout-ms",
            str(10**30),
            "argument --timeout-ms: must be an integer in [1, 86400000], got 1000000",
        ),
        ("--timeout-ms", "0", "argument --timeout-ms: must be an integer in [1, 86400000], got 0"),
        ("--timeout", "-1", "argument --timeout: must be a number of seconds > 0, got '-1'"),
    ],
)
def test_generate_refuses_a_priority_or_timeout_the_server_would_not_take(flag, value, said, capsys):
    """msgpack cannot even encode 10**30 (OverflowError); the server's decoder takes priority in
    [-1000, 1000] and timeout_ms in [1, 86400000]: the command line refuses the rest by name."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "hi", flag, value, "--connect", free_address(), "--connect-timeout", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"ringleader generate: error: {said}" in err, err


# ---------------------------------------------------------------- --timeout governs a silent server


def test_a_streams_timeout_outlasts_a_shorter_reply_liveness_limit(silent_server):
    """A server still loading answers nothing, pings included: the liveness limit (reply_timeout)
    must not give it up before the caller's own per-chunk timeout."""
    with Client(silent_server, timeout=1.5, reply_timeout=0.3) as client:
        started = time.monotonic()
        stream = client.generate(prompt_ids=[1], max_tokens=2)
        try:
            done = stream.wait()
        except TimeoutError as exc:
            message = str(exc)
        else:
            message = done.error_message or ""
        waited = time.monotonic() - started
    assert waited >= 1.4, f"given up after {waited:.2f} s: {message}"
    assert "within 1.5 s" in message and waited < 10


def test_generate_timeout_governs_the_wait_for_a_silent_server(silent_server, monkeypatch, capsys):
    monkeypatch.setattr(client_core, "DEFAULT_REPLY_TIMEOUT_S", 0.3)  # the liveness default, made short
    started = time.monotonic()
    rc = cli.main(["generate", "hi", "--connect", silent_server, "--timeout", "1.5", "--max-tokens", "2"])
    waited = time.monotonic() - started
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    assert waited >= 1.4, f"gave up after {waited:.2f} s: {err}"
    assert "within 1.5 s" in err and silent_server in err, err


# ---------------------------------------------------------------- the C client's build


def test_the_c_clients_make_names_the_packages_its_headers_need(tmp_path):
    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.skip("make or cc not found")
    empty_root = tmp_path / "root"  # a compiler that sees no system headers: none installed
    empty_root.mkdir()
    r = subprocess.run(
        [
            "make",
            "-C",
            str(C_DIR),
            f"BUILD={tmp_path / 'build'}",
            "PKG_CONFIG=false",
            f"CC=cc --sysroot={empty_root}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "libzmq's headers (zmq.h) and msgpack-c's headers (msgpack.h) not found" in r.stderr, r.stderr
    assert "sudo apt-get install build-essential pkg-config libzmq3-dev libmsgpack-dev" in r.stderr
    assert "fatal error" not in r.stderr  # found before anything is compiled
    r = subprocess.run(
        ["make", "-C", str(C_DIR), f"BUILD={tmp_path / 'build'}", "CC=no-such-cc"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "a C compiler (no-such-cc) not found" in r.stderr, r.stderr
    if subprocess.run(["pkg-config", "--exists", "libzmq"]).returncode == 0:  # installed: no hint
        r = subprocess.run(
            ["make", "-C", str(C_DIR), f"BUILD={tmp_path / 'build'}", "deps"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0 and "apt-get" not in r.stderr, r.stderr


# ---------------------------------------------------------------- serve: its load, its refusals, its stop


def test_a_gguf_load_logs_each_phase_with_its_time(tmp_path, caplog):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from ringleader.device.model import LlamaModel
    from tests.test_gguf_checkpoint import hf_model as hf_model_fixture
    from tests.test_gguf_checkpoint import write_gguf

    path = write_gguf(tmp_path / "m.gguf", hf_model_fixture.__wrapped__(), qtype="Q4_1")
    with caplog.at_level(logging.INFO, logger="ringleader.load"):
        LlamaModel.from_spec(str(path), weights="quantized")
    said = [r.getMessage() for r in caplog.records if r.name == "ringleader.load"]
    phases = [
        "reading the GGUF metadata of m.gguf",
        r"reading 21 tensors \(\d+\.\d MiB\), keeping the quantized matrices",
        "arranging the tensors as the model's 2 layers",
        r"repacking 9 quantized matrices for the CPU's quantized kernel",
    ]
    assert len(said) == 2 * len(phases), said
    for i, phase in enumerate(phases):  # a line as it begins, a line with its time as it ends
        assert re.fullmatch(phase + r"\.\.\.", said[2 * i]), said
        assert re.fullmatch(phase + r": \d+\.\d s", said[2 * i + 1]), said


def serve_refuses(*flags: str) -> str:
    r = subprocess.run(
        CLI + ["serve", *flags, "--bind", free_address()],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 2, r.stderr
    return one_line(r.stderr)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--drain-timeout", "-1"], "--drain-timeout (drain_timeout_s) must be >= 0 seconds, got -1"),
        (["--page-size", "3"], "--page-size (page_size) must be a power of two, got 3"),
        (
            ["--default-max-tokens", "0"],
            "--default-max-tokens (default_max_tokens) must be an integer >= 1 (or unset: no cap), got 0",
        ),
        (["--watchdog-s", "0"], "--watchdog-s (watchdog_s) must be > 0 seconds, got 0"),
    ],
)
def test_serve_refuses_a_value_naming_its_flag(flags, said):
    assert serve_refuses(*flags) == f"ringleader: cannot start: {said}"


def test_sigterm_with_a_request_in_flight_exits_within_the_drain_timeout_plus_5_s(tmp_path):
    address = free_address()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log_file:
        serve = subprocess.Popen(
            CLI + ["serve", "--bind", address, "--slots", "2", "--max-ctx", "4096", "--drain-timeout", "1"],
            stderr=log_file,
            stdin=subprocess.DEVNULL,
        )
    peer = RawPeer(address)
    try:
        peer.ping()  # served: the model loaded
        peer.send({"op": "generate", "id": 1, "prompt_ids": [1], "max_tokens": 4000, "ignore_eos": True})
        peer.recv_until(lambda m: m["op"] in ("token", "batch"))
        signalled = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
        took = time.monotonic() - signalled
    finally:
        peer.close()
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    log = log_path.read_text()
    assert took <= 1 + 5, f"exited {took:.1f} s after SIGTERM, --drain-timeout 1 promises 6 s at most\n{log}"
    assert "stopping: draining 1 requests in flight (up to 1 s" in log, log
    # the load's phases, each with its time, and the load's own
    assert re.search(
        r"INFO ringleader\.load: making the random weights of tiny \(seed 0\): \d+\.\d s", log
    ), log
    assert re.search(r"INFO ringleader\.cli: loaded tiny in \d+\.\d s", log), log
