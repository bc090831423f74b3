"""A newcomer's first hour, as the installed command line meets it: start-up mistakes are one
line naming the fault (before the model loads), `wait-ready` bridges the load, the server logs
each finished request and its stop, Ctrl-C in generate exits 130, every --help shows defaults."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

from ringleader.hostctl import cli
from ringleader.hostctl.commands.serve_flags import ENGINE_FLAGS
from tests.conftest import RawPeer

CLI = [sys.executable, "-m", "ringleader.hostctl.cli"]
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_fails(*flags: str, env: dict | None = None, before_load: bool = True) -> str:
    """Runs `serve FLAGS` expecting a start-up failure; its stderr, checked to be one line
    (found before the model began to load unless before_load is False)."""
    if "--bind" not in flags:  # never the default port: a server of the README's may hold it
        flags = ("--bind", "tcp://127.0.0.1:0", *flags)
    r = subprocess.run(
        CLI + ["serve", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("ringleader: cannot start: ")]
    assert len(errors) == 1, r.stderr
    assert not before_load or "loading" not in r.stderr, (
        f"the model began to load before the mistake was found:\n{r.stderr}"
    )
    return errors[0]


@pytest.fixture
def truncated_gguf(tmp_path) -> Path:
    """A GGUF header that promises a tensor the file does not hold (as a cut-off download does)."""
    import gguf
    import numpy as np

    whole = tmp_path / "whole.gguf"
    writer = gguf.GGUFWriter(str(whole), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    return cut


def test_startup_mistakes_are_one_line_naming_the_fault(tmp_path, truncated_gguf):
    assert "no GGUF file named '/nope.gguf'" in serve_fails("--model", "/nope.gguf")
    line = serve_fails("--model", str(ROOT / "README.md"))
    assert "README.md is not a GGUF file" in line and "--model takes a preset" in line
    assert "no preset, file or directory named 'tinny'" in serve_fails("--model", "tinny")
    assert "directory without config.json" in serve_fails("--model", str(tmp_path))
    assert "cut.gguf is not a readable GGUF file" in serve_fails(
        "--model", str(truncated_gguf), before_load=False
    )
    assert "'8000' is not a ZeroMQ address: it needs a transport" in serve_fails("--bind", "8000")
    assert "--http: expected HOST:PORT, got '8000'" in serve_fails("--http", "8000")
    assert "--metrics: expected HOST:PORT" in serve_fails("--metrics", "localhost:70000")


def test_a_no_scheme_bind_gets_no_false_reachable_warning():
    r = subprocess.run(
        CLI + ["serve", "--bind", "127.0.0.1:5605"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert "reachable from other machines" not in r.stderr
    assert "tcp://127.0.0.1:5605" in r.stderr  # the fix is spelled out


def test_busy_ports_fail_before_the_model_loads():
    """llama-1b's random weights take many seconds to make: a busy port must fail first."""
    address = f"tcp://127.0.0.1:{free_port()}"
    holder = zmq.Context.instance().socket(zmq.ROUTER)
    holder.bind(address)
    try:
        line = serve_fails("--model", "llama-1b", "--bind", address)
        assert f"cannot bind {address}: the address is in use" in line
    finally:
        holder.close(0)
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        line = serve_fails("--model", "llama-1b", "--http", f"127.0.0.1:{port}")
        assert f"--http 127.0.0.1:{port}: cannot bind: the port is in use" in line
        line = serve_fails("--model", "llama-1b", "--metrics", f"127.0.0.1:{port}")
        assert "--metrics" in line and "the port is in use" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_says_what_to_use():
    line = serve_fails("--device", "cuda")
    assert "--device cuda" in line and "--device cpu" in line


def test_a_missing_http_package_is_named_before_the_load():
    code = (
        "import sys; sys.modules['aiohttp'] = None; "
        "from ringleader.hostctl.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "serve", "--model", "llama-1b", "--http", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "the HTTP gateway needs aiohttp: pip install 'aiohttp>=" in r.stderr
    assert 'pip install -e ".[http]"' in r.stderr  # never the unpublished "ringleader[http]"
    assert "loading" not in r.stderr


def test_build_kernel_without_nvrtc_is_one_line():
    r = subprocess.run(CLI + ["build-kernel", "--nvrtc", "/nope/libnvrtc.so"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "ringleader: build-kernel: $RINGLEADER_NVRTC=/nope/libnvrtc.so: no such file" in r.stderr
    code = (
        "import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None; "
        "from ringleader.hostctl.cli import main; sys.exit(main(['build-kernel']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "NVRTC needs cuda-bindings" in r.stderr and "pip install" in r.stderr


def test_log_level_debug_keeps_the_traceback():
    r = subprocess.run(
        CLI + ["--log-level", "debug", "serve", "--model", "/nope.gguf"], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert "Traceback" in r.stderr and "ringleader: cannot start: no GGUF file" in r.stderr


def test_generate_refuses_a_temperature_float32_cannot_hold():
    r = subprocess.run(
        CLI + ["generate", "hi", "--temperature", "1e308", "--connect-timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "temperature" in r.stderr and "1e+308" in r.stderr


# ---------------------------------------------------------------- a server's life, as scripts see it


def test_wait_ready_bridges_the_load_then_the_server_logs_requests_and_its_stop(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log_file:
        serve = subprocess.Popen(
            CLI + ["serve", "--bind", address, "--slots", "4", "--max-ctx", "256"],
            stderr=log_file,
            stdin=subprocess.DEVNULL,
        )
    try:
        r = subprocess.run(
            CLI + ["wait-ready", "--connect", address, "--timeout", "120"],
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert r.returncode == 0, r.stderr
        assert f"ready: tiny at {address}" in r.stderr
        # the serving line is written once requests are served, after any other start-up line
        assert log_path.read_text().rstrip().splitlines()[-1].startswith("ringleader: serving tiny on")
        r = subprocess.run(
            CLI + ["generate", "Hello", "--max-tokens", "5", "--ignore-eos", "--connect", address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    log = log_path.read_text()
    assert re.search(
        r"INFO ringleader\.requests: request \d+ of client [0-9a-f]+: length, 6 prompt \+ 5 completion "
        r"tokens, TTFT \d+\.\d ms, total \d+\.\d ms",
        log,
    ), log
    assert "stopping: nothing in flight" in log and "stopped (shutdown took" in log, log
    assert "INFO ringleader.cli: exited" in log, log


def test_wait_ready_gives_up_naming_the_address():
    address = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = subprocess.run(
        CLI + ["wait-ready", "--connect", address, "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert f"no ringleader server served at {address} within 1 s" in r.stderr
    assert time.monotonic() - t0 < 30


def test_a_server_whose_stderr_nobody_reads_keeps_serving_and_exits():
    """Each request logs a line; 1,000 of them overflow a pipe nobody reads.  The completion
    thread must not wait on it (the lines are dropped instead), and SIGTERM still ends it."""
    address = f"tcp://127.0.0.1:{free_port()}"
    serve = subprocess.Popen(
        CLI + ["serve", "--bind", address, "--slots", "32", "--max-ctx", "64"],
        stderr=subprocess.PIPE,  # never read
        stdin=subprocess.DEVNULL,
    )
    peer = RawPeer(address)
    try:
        peer.ping()
        n = 1000
        for i in range(n):
            rid = f"a-long-request-id-that-makes-each-log-line-longer-{i:06d}"
            peer.send({"op": "generate", "id": rid, "prompt_ids": [1], "max_tokens": 1, "ignore_eos": True})
        ended: set[str] = set()

        def all_ended(m: dict) -> bool:
            if m["op"] == "done":
                assert m["finish_reason"] == "length" and m["id"] not in ended, m
                ended.add(m["id"])
            return len(ended) == n

        peer.recv_until(all_ended, timeout=120)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
    finally:
        peer.close()
        if serve.poll() is None:
            serve.kill()
            serve.wait()


# Ctrl-C as a terminal sends it: a suite run as a background job (`pytest &`) hands its children
# SIGINT ignored, and Python then installs no KeyboardInterrupt handler, so the CLI starts with one
AS_IN_A_TERMINAL = [
    sys.executable,
    "-c",
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'ringleader'; runpy.run_module('ringleader.hostctl.cli', run_name='__main__')",
]


def test_ctrl_c_in_generate_aborts_and_exits_130(served_tiny):
    gen = subprocess.Popen(
        AS_IN_A_TERMINAL
        + ["generate", "--prompt-ids", "1,2", "--max-tokens", "2000", "--ignore-eos"]
        + ["--connect", served_tiny],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert gen.stdout is not None
    gen.stdout.read(8)  # it streams
    gen.send_signal(signal.SIGINT)
    assert gen.wait(timeout=30) == 130
    assert "[abort:" in gen.stderr.read()


@pytest.fixture
def served_tiny():
    address = f"tcp://127.0.0.1:{free_port()}"
    serve = subprocess.Popen(
        CLI + ["serve", "--bind", address, "--slots", "2"],
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert (
            subprocess.run(CLI + ["wait-ready", "--connect", address, "--quiet"], timeout=150).returncode == 0
        )
        yield address
    finally:
        serve.kill()
        serve.wait()


# ---------------------------------------------------------------- the command line's own text


def test_version():
    r = subprocess.run(CLI + ["--version"], capture_output=True, text=True)
    assert r.returncode == 0 and re.fullmatch(r"ringleader \S+ \(wire protocol revision \d+\)\n", r.stdout)


def test_every_option_with_a_default_shows_it_in_help():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = []
    for name, command in commands.items():
        formatter = command.formatter_class(prog=name)
        for action in command._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            shown = formatter._get_help_string(action) or ""
            if not action.help:
                missing.append(f"{name} {action.option_strings[0]}: no help")
            elif action.default not in (None, False) and "default" not in shown.lower():
                missing.append(f"{name} {action.option_strings[0]}: default not shown")
    assert not missing, missing
    assert "GGUF" in ENGINE_FLAGS["model"].help


def test_help_runs_for_every_command():
    for command in (
        "serve",
        "gateway",
        "generate",
        "stats",
        "wait-ready",
        "build-kernel",
        "doctor",
        "keygen",
    ):
        r = subprocess.run(CLI + [command, "--help"], capture_output=True, text=True, env={**os.environ})
        assert r.returncode == 0 and "usage: ringleader " + command in r.stdout, r.stderr


def test_log_lines_are_never_lost_silently_when_read(tmp_path):
    """The log output writes every queued line before the process exits."""
    code = (
        "import logging; from ringleader.hostctl.serving.log_output import LogOutput; out = LogOutput('INFO'); "
        "[logging.getLogger('x').info('line %d', i) for i in range(500)]; out.stop(); print(out.dropped)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "0"
    assert r.stderr.count("INFO x: line ") == 500
