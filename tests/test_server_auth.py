"""CURVE on the real server: an authorized client is served end to end; a client without keys,
or with keys the server does not know, gets nothing and is told why; an open bind warns."""

from __future__ import annotations

import logging

import pytest

from ringleader.device.backends.cpu import CpuBackend
from ringleader.hostctl.serving.server import Server
from ringleader.ipc.client import ERR_DISCONNECTED, Client
from ringleader.ipc.curve import ClientCurve, ServerCurve, generate_keypair
from tests.conftest import running_server


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    server_pub, server_secret = generate_keypair(root / "server", "server")
    client_pub, client_secret = generate_keypair(root / "authorized", "alice")
    _, stranger_secret = generate_keypair(root / "strangers", "mallory")
    return dict(
        server_pub=server_pub,
        server_secret=server_secret,
        client_secret=client_secret,
        stranger_secret=stranger_secret,
        authorized=str(root / "authorized"),
    )


def test_only_authorized_clients_get_through(keys):
    curve = ServerCurve(keys["server_secret"], keys["authorized"])
    with running_server(server_options=dict(curve=curve)) as bg:
        alice = ClientCurve(keys["server_pub"], keys["client_secret"])
        with Client(bg.address, timeout=30, curve=alice) as c:
            stream = c.complete(prompt_ids=[1, 2], max_tokens=4)
            assert stream.done.finish_reason == "length" and len(stream.token_ids) == 4
        mallory = ClientCurve(keys["server_pub"], keys["stranger_secret"])
        for client_curve in (mallory, None):
            with Client(bg.address, timeout=30, connect_timeout=3, curve=client_curve) as c:
                done = c.generate(prompt_ids=[1, 2], max_tokens=4).wait()
                assert done.error_code == ERR_DISCONNECTED
                with pytest.raises(ConnectionError):
                    c.stats()
        assert bg.server.metrics.snapshot()["accepted"] == 1  # only alice's request


def test_a_non_loopback_bind_without_keys_warns(caplog):
    backend = CpuBackend("tiny", n_slots=2, max_ctx=64, token_budget=16)
    with caplog.at_level(logging.WARNING, logger="ringleader.server"):
        server = Server(backend, "tcp://0.0.0.0:0")
    server._socket.close(0)
    server.wake.close()
    assert any("without CURVE keys" in r.message for r in caplog.records)
