"""Shared fixtures: an in-process server on 127.0.0.1 with the CPU backend, and raw DEALER sockets."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import urllib.error
import urllib.request

import msgpack
import pytest
import torch
import zmq

from ringleader.device.backends.cpu import CpuBackend
from ringleader.hostctl.serving.background_server import BackgroundServer
from ringleader.hostctl.serving.server import Server

# The ports a user's own server takes by default (serve's ZeroMQ address, the gateway's HTTP):
# held for the whole run, so a test that needs one of them free fails here as it would beside a
# server the README's first session left running (where that server holds it already).
DEFAULT_PORTS = (5555, 8000)


@pytest.fixture(scope="session", autouse=True)
def default_ports_held():
    held = []
    for port in DEFAULT_PORTS:
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
            held.append(sock)
        except OSError:  # someone's server has it: the same test
            sock.close()
    yield
    for sock in held:
        sock.close()


def wait_until(pred, timeout: float = 20.0, step: float = 0.01) -> bool:
    """Polls pred until it holds or `timeout` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


@contextlib.contextmanager
def running_server(model="tiny", *, server_options=None, backend_cls=CpuBackend, **backend_options):
    backend_options.setdefault("n_slots", 8)
    backend_options.setdefault("max_ctx", 512)
    backend_options.setdefault("token_budget", 64)
    backend = backend_cls(model, **backend_options)
    opts = dict(watchdog_s=10.0, drain_timeout_s=0.5)
    opts.update(server_options or {})
    server = Server(backend, "tcp://127.0.0.1:0", **opts)
    with BackgroundServer(server) as bg:
        yield bg


def transformers_fp32(gguf):
    """transformers' model of a GGUF file, dequantized to fp32 (the real model's reference);
    skips where transformers cannot load one."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()


def post_json(gw, path: str, body) -> tuple[int, dict]:
    """POST `body` as JSON to `path` of a gateway (anything with a `url`): (status, its JSON
    answer), an error status's too."""
    req = urllib.request.Request(
        gw.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class RawPeer:
    """A DEALER socket speaking the wire protocol by hand, as docs/protocol.md describes."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, msg) -> None:
        self.sock.send(msgpack.packb(msg, use_bin_type=True))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = 30.0) -> dict:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no reply within %.1f s" % timeout)
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def recv_until(self, pred, timeout: float = 60.0) -> list[dict]:
        out, deadline = [], time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.01, deadline - time.monotonic()))
            out.append(msg)
            if pred(msg):
                return out

    def quiet_for(self, seconds: float) -> list[dict]:
        """Everything that arrives within `seconds` (to catch duplicates after the last done)."""
        out = []
        while self.sock.poll(int(seconds * 1000)):
            out.append(msgpack.unpackb(self.sock.recv(), raw=False))
        return out

    def ping(self) -> None:
        self.send({"op": "ping"})
        self.recv_until(lambda m: m.get("op") == "pong", timeout=30)

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture(scope="module")
def tiny_server():
    with running_server() as bg:
        yield bg


@pytest.fixture(scope="module")
def server():
    """The tiny model's server with 8 slots and 512 positions, one per test module (the gateway
    tests' upstream); a module that needs another defines its own."""
    with running_server("tiny", n_slots=8, max_ctx=512) as bg:
        yield bg


@pytest.fixture(scope="module")
def gateway(server):
    """The HTTP gateway in front of the module's `server`."""
    from ringleader.hostctl.gateway.app import BackgroundGateway  # aiohttp: the http extra

    with BackgroundGateway(server.address) as gw:
        yield gw


@pytest.fixture
def peer(tiny_server):
    p = RawPeer(tiny_server.address)
    yield p
    p.close()


# CI sets this: a file the tests download (the real model, an older NVRTC) that cannot be had
# fails its tests instead of skipping them.
REQUIRE_FETCHED = "RINGLEADER_REQUIRE_FETCHED"


def fetched(what: str, cached, fetch):
    """cached() or else fetch(); skips when neither gives it, unless $RINGLEADER_REQUIRE_FETCHED."""
    path = cached()
    if path is None:
        try:
            path = fetch()
        except Exception as exc:
            if os.environ.get(REQUIRE_FETCHED):
                raise
            pytest.skip(f"{what} is not available: {exc}")
    return path


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the real model's GGUF file (bench/smollm2.py: $RINGLEADER_TEST_GGUF, the cache, or
    a download)."""
    from ringleader.bench import smollm2

    return fetched("the SmolLM2 GGUF file", smollm2.cached_path, smollm2.fetch)


# ---- the heavy tests: left out of a plain `pytest -q`, which stays under 10 minutes on two idle
# cores; CI runs them too (`pytest -q -m heavy`, .ci/run).  Each costs 10-60 s on such a machine:
# Triton kernels under the interpreter, greedy parity with transformers under load, soak-like runs.
HEAVY_TESTS = (
    "tests/test_split_k_attention.py::test_split_k_under_interpreter",
    "tests/test_fused_step.py::test_fused_step_under_interpreter",
    "tests/test_static_step.py::test_triton_under_interpreter",
    "tests/test_triton_sample_row.py::test_sample_rows_under_interpreter",
    "tests/test_fused_projections.py::test_fused_projections_under_interpreter",
    "tests/test_triton_structured_sampling.py::test_structured_sampling_under_interpreter",
    "tests/test_triton_fused.py::test_fused_kernels_under_interpreter",
    "tests/test_triton_aot.py::test_every_product_kernel_compiles_for_sm90",
    "tests/test_real_model.py::test_greedy_matches_transformers_under_concurrency",
    "tests/test_real_model.py::test_greedy_matches_transformers_when_a_tiny_kv_pool_forces_preemption",
    "tests/test_structured_bench.py::test_quick_run_writes_sane_figures",
    "tests/test_memory_growth.py::",
    "tests/test_ray_serve.py::test_a_stalled_engine_fails_the_health_check_and_its_streams_end_once",
    "tests/test_ray_serve.py::test_the_readmes_ray_serve_command_serves_and_stops_on_sigint",
    "tests/test_logprobs.py::test_greedy_logprobs_equal_transformers_log_softmax",
    "tests/test_prompt_logprobs_real.py::test_prompt_logprobs_equal_transformers_log_softmax",
    "tests/test_spec_decode_real.py::",
    "tests/test_lm_eval.py::",
    "tests/test_structured_output.py::test_the_openai_clients_response_format_returns_valid_json_every_time",
    "tests/test_gpu_bringup.py::test_every_gpu_only_test_runs_in_some_stage",
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "heavy: one of conftest.HEAVY_TESTS; `pytest -q -m heavy` runs them (CI does)"
    )


@pytest.hookimpl(tryfirst=True)  # marked before -m selects
def pytest_collection_modifyitems(config, items):
    """Marks HEAVY_TESTS `heavy`, and leaves them out when neither -m nor a test file was named
    (`pytest -q`, `pytest -q tests/`): naming a file or a test runs its heavy tests too."""
    heavy = [item for item in items if item.nodeid.startswith(HEAVY_TESTS)]
    for item in heavy:
        item.add_marker(pytest.mark.heavy)
    named_a_file = any(os.path.isfile(arg.split("::")[0]) for arg in config.args)
    if not named_a_file and not config.option.keyword:  # the whole suite: no entry may go stale
        stale = [p for p in HEAVY_TESTS if not any(item.nodeid.startswith(p) for item in items)]
        if stale:
            raise pytest.UsageError(f"conftest.HEAVY_TESTS names no test: {stale}")
    if heavy and not config.option.markexpr and not named_a_file:
        config.hook.pytest_deselected(items=heavy)
        left_out = set(heavy)
        items[:] = [item for item in items if item not in left_out]
        config._heavy_left_out = len(heavy)


def pytest_terminal_summary(terminalreporter, config):
    left_out = getattr(config, "_heavy_left_out", 0)
    if left_out:
        terminalreporter.write_line(
            f"{left_out} heavy tests left out: `pytest -q -m heavy` runs them (CI does)"
        )
