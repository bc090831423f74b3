"""Shared fixtures: an in-process server on 127.0.0.1 with the CPU backend, and raw DEALER sockets."""

from __future__ import annotations

import contextlib
import os
import time

import msgpack
import pytest
import zmq

from ringleader.device.backends.cpu import CpuBackend
from ringleader.hostctl.serving.background_server import BackgroundServer
from ringleader.hostctl.serving.server import Server


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
