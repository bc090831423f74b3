"""CURVE authentication (ipc/curve.py) on real sockets on 127.0.0.1: keys, a secured ROUTER and
DEALERs with and without authorized keys, address classification, option helpers, keygen CLI."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from ringleader.hostctl import cli
from ringleader.ipc import curve as C

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@pytest.fixture
def keys(tmp_path):
    """server and alice keypairs; alice authorized, mallory not."""
    authorized = tmp_path / "authorized"
    server_pub, server_sec = C.generate_keypair(tmp_path / "server", "server")
    alice_pub, alice_sec = C.generate_keypair(tmp_path / "alice", "alice")
    _, mallory_sec = C.generate_keypair(tmp_path / "mallory", "mallory")
    authorized.mkdir()
    (authorized / "alice.key").write_bytes(Path(alice_pub).read_bytes())
    return argparse.Namespace(
        server=C.ServerCurve(server_sec, str(authorized)),
        server_pub=server_pub,
        alice=C.ClientCurve(server_pub, alice_sec),
        mallory=C.ClientCurve(server_pub, mallory_sec),
        authorized=authorized,
        tmp=tmp_path,
    )


class SecuredRouter:
    """A ROUTER on its own context, secured with secure_server_socket, bound to 127.0.0.1."""

    def __init__(self, server_curve: C.ServerCurve):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.auth = C.secure_server_socket(self.ctx, self.sock, server_curve)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    def recv(self, timeout_s: float):
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.sock.recv_multipart()

    def close(self):
        self.sock.close()
        self.auth.stop()
        self.ctx.term()


@pytest.fixture
def router(keys):
    r = SecuredRouter(keys.server)
    yield r
    r.close()


@pytest.fixture
def client_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def dealer(ctx, address, client_curve=None, monitor=False):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = 5000  # a send never waits forever on a peer the server refused
    if client_curve is not None:
        C.secure_client_socket(sock, client_curve)
    mon = sock.get_monitor_socket(C.HANDSHAKE_FAILED_EVENTS) if monitor else None
    sock.connect(address)
    return sock, mon


def send_if_queued(sock, frame: bytes) -> None:
    """Send from a peer the server refuses: once its handshake has failed the DEALER has no pipe
    to queue into, and a blocking send would wait forever (EAGAIN here instead)."""
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass


# ---- keys -----------------------------------------------------------------------------------


def test_generate_keypair_writes_loadable_private_keys_and_refuses_overwrite(tmp_path):
    d = tmp_path / "new" / "dir"
    pub, sec = C.generate_keypair(d, "node-1")
    assert (pub, sec) == (str(d / "node-1.key"), str(d / "node-1.key_secret"))
    public, secret = C.load_keypair(sec)
    assert C.load_public_key(pub) == public and zmq.curve_public(secret) == public
    assert stat.S_IMODE(os.stat(sec).st_mode) == 0o600
    assert sorted(os.listdir(d)) == ["node-1.key", "node-1.key_secret"]  # no scratch left
    before = Path(sec).read_bytes()
    with pytest.raises(FileExistsError, match="node-1.key.*refusing to overwrite"):
        C.generate_keypair(d, "node-1")
    os.unlink(pub)  # either file existing is enough to refuse
    with pytest.raises(FileExistsError, match="node-1.key_secret.*refusing to overwrite"):
        C.generate_keypair(d, "node-1")
    assert Path(sec).read_bytes() == before
    for bad in ("", "../x", "a/b", ".hidden", "-x"):
        with pytest.raises(C.CurveError, match="key name"):
            C.generate_keypair(d, bad)


def test_key_file_errors_name_the_file_and_the_problem(tmp_path):
    pub, sec = C.generate_keypair(tmp_path / "k", "k")
    other_pub, other_sec = C.generate_keypair(tmp_path / "o", "o")
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = str(tmp_path / "nope.key_secret")
    with pytest.raises(C.CurveError, match=f"{missing}: no such key file"):
        C.ServerCurve(missing, str(tmp_path / "k"))
    with pytest.raises(C.CurveError, match=f"{pub}: no secret key"):
        C.ServerCurve(pub, str(tmp_path / "k"))
    with pytest.raises(C.CurveError, match="does not exist"):
        C.ServerCurve(sec, str(tmp_path / "absent"))
    with pytest.raises(C.CurveError, match="no \\*.key files"):
        C.ServerCurve(sec, str(empty))
    (empty / "x.key_secret").write_bytes(Path(sec).read_bytes())
    with pytest.raises(C.CurveError, match="copy the public NAME.key"):
        C.ServerCurve(sec, str(empty))
    (empty / "junk.key").write_text("hello\n")
    with pytest.raises(C.CurveError, match="junk.key: not a CURVE key file"):
        C.ServerCurve(sec, str(empty))
    with pytest.raises(C.CurveError, match=f"{pub}: no secret key"):
        C.ClientCurve(other_pub, pub)
    with pytest.raises(C.CurveError, match=f"{other_sec}: this file holds a secret key"):
        C.ClientCurve(other_sec, sec)
    mixed = tmp_path / "mixed.key_secret"  # public of one pair, secret of another
    mixed.write_text(
        Path(sec).read_text().replace(C.load_keypair(sec)[0].decode(), C.load_keypair(other_sec)[0].decode())
    )
    with pytest.raises(C.CurveError, match="does not match"):
        C.ClientCurve(other_pub, str(mixed))
    assert C.ClientCurve(other_pub, sec).load()[0] == C.load_public_key(other_pub)


# ---- sockets --------------------------------------------------------------------------------


def test_authorized_dealer_exchanges_frames(keys, router, client_ctx):
    sock, _ = dealer(client_ctx, router.address, keys.alice)
    sock.send(b"hello")
    got = router.recv(5)
    assert got is not None and got[1] == b"hello"
    router.sock.send_multipart([got[0], b"world"])
    assert sock.poll(5000) and sock.recv() == b"world"
    assert router.auth.running and router.auth.public_key == C.load_public_key(keys.server_pub)


def test_unauthenticated_peers_get_nothing_through(keys, router, client_ctx):
    plain, plain_mon = dealer(client_ctx, router.address, None, monitor=True)
    mallory, mallory_mon = dealer(client_ctx, router.address, keys.mallory, monitor=True)
    wrong_server = C.ClientCurve(C.generate_keypair(keys.tmp / "fake", "fake")[0], keys.alice.secret_key_file)
    spoof, _ = dealer(client_ctx, router.address, wrong_server)
    for s in (plain, mallory, spoof):
        send_if_queued(s, b"let me in")
    assert router.recv(1.0) is None
    # each refused peer is told its handshake failed (the DEALER retries, nothing is delivered)
    for mon in (plain_mon, mallory_mon):
        assert mon.poll(2000)
        assert recv_monitor_message(mon)["event"] & C.HANDSHAKE_FAILED_EVENTS
    assert C.describe_handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400).startswith(
        "the server refused this client's CURVE key"
    )
    # the same server still serves an authorized client, and only its frame arrives
    alice, _ = dealer(client_ctx, router.address, keys.alice)
    alice.send(b"alice")
    got = router.recv(5)
    assert got is not None and got[1] == b"alice"
    assert router.recv(0.5) is None


def test_reload_picks_up_a_newly_authorized_key(keys, router, client_ctx):
    mallory, _ = dealer(client_ctx, router.address, keys.mallory)
    send_if_queued(mallory, b"first")
    assert router.recv(0.5) is None
    mallory_pub = keys.mallory.secret_key_file[: -len("_secret")]
    (keys.authorized / "mallory.key").write_bytes(Path(mallory_pub).read_bytes())
    assert router.auth.reload() == 2
    mallory.close()
    mallory, _ = dealer(client_ctx, router.address, keys.mallory)
    mallory.send(b"second")
    got = router.recv(5)
    assert got is not None and got[1] == b"second"


def test_one_zap_handler_per_context_and_separate_contexts_coexist(keys, router, client_ctx):
    second = router.ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(C.CurveError, match="own zmq.Context"):
            C.secure_server_socket(router.ctx, second, keys.server)
    finally:
        second.close(linger=0)
    other = SecuredRouter(keys.server)  # a second server in this process, its own context
    try:
        a, _ = dealer(client_ctx, router.address, keys.alice)
        b, _ = dealer(client_ctx, other.address, keys.alice)
        a.send(b"to first")
        b.send(b"to second")
        assert router.recv(5)[1] == b"to first"
        assert other.recv(5)[1] == b"to second"
    finally:
        other.close()


def test_without_a_running_handler_the_server_refuses_everyone(keys, router, client_ctx):
    router.auth.stop()
    router.auth.stop()  # idempotent
    assert not router.auth.running
    alice, _ = dealer(client_ctx, router.address, keys.alice)
    send_if_queued(alice, b"hello")
    assert router.recv(1.0) is None  # fail closed: ZAP_ENFORCE_DOMAIN, not "no handler, allow"


def test_setup_must_come_before_bind_and_connect(keys, client_ctx):
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(RuntimeError, match="before the socket's first bind"):
            C.secure_server_socket(ctx, sock, keys.server)
        sock.close()
    finally:
        ctx.term()  # no authenticator was left running
    plain, _ = dealer(client_ctx, "tcp://127.0.0.1:1")
    with pytest.raises(RuntimeError, match="before the socket's first connect"):
        C.secure_client_socket(plain, keys.alice)


# ---- addresses and options ------------------------------------------------------------------


@pytest.mark.parametrize(
    "address,expected",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.1.2.3:1", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("TCP://LOCALHOST:1", True),
        ("ipc:///tmp/rl.sock", True),
        ("inproc://x", True),
        ("tcp://[::ffff:127.0.0.1]:1", True),
        ("ws://127.0.0.1:80/path", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://10.0.0.5:5555", False),
        ("tcp://example.com:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://192.168.1.2;127.0.0.1:5555", True),
        ("pgm://eth0;239.1.1.1:5555", False),
        ("127.0.0.1:5555", False),
    ],
)
def test_is_loopback(address, expected):
    assert C.is_loopback(address) is expected


def test_unauthenticated_bind_warning(keys):
    assert C.unauthenticated_bind_warning("tcp://127.0.0.1:5555", None) is None
    assert C.unauthenticated_bind_warning("tcp://0.0.0.0:5555", keys.server) is None
    assert "CURVE authentication is off" in C.unauthenticated_bind_warning("tcp://*:5555", None)


def test_option_helpers(keys):
    sp = argparse.ArgumentParser()
    C.add_curve_server_options(sp)
    cp = argparse.ArgumentParser()
    C.add_curve_client_options(cp)
    assert C.server_curve_from_args(sp.parse_args([])) is None
    assert C.client_curve_from_args(cp.parse_args([])) is None
    s = C.server_curve_from_args(
        sp.parse_args(
            ["--curve-secret-key", keys.server.secret_key_file, "--authorized-keys", str(keys.authorized)]
        )
    )
    assert s == keys.server
    c = C.client_curve_from_args(
        cp.parse_args(
            ["--curve-server-key", keys.server_pub, "--curve-secret-key", keys.alice.secret_key_file]
        )
    )
    assert c == keys.alice
    with pytest.raises(C.CurveError, match="--curve-secret-key needs --authorized-keys"):
        C.server_curve_from_args(sp.parse_args(["--curve-secret-key", keys.server.secret_key_file]))
    with pytest.raises(C.CurveError, match="--authorized-keys needs --curve-secret-key"):
        C.server_curve_from_args(sp.parse_args(["--authorized-keys", str(keys.authorized)]))
    with pytest.raises(C.CurveError, match="--curve-server-key needs --curve-secret-key"):
        C.client_curve_from_args(cp.parse_args(["--curve-server-key", keys.server_pub]))
    with pytest.raises(C.CurveError, match="--curve-secret-key needs --curve-server-key"):
        C.client_curve_from_args(cp.parse_args(["--curve-secret-key", keys.alice.secret_key_file]))
    with pytest.raises(C.CurveError, match="no such key file"):
        C.client_curve_from_args(
            cp.parse_args(
                [
                    "--curve-server-key",
                    str(keys.tmp / "x.key"),
                    "--curve-secret-key",
                    keys.alice.secret_key_file,
                ]
            )
        )


# ---- CLI ------------------------------------------------------------------------------------


def test_keygen_cli(tmp_path, capsys):
    d = tmp_path / "keys"
    assert cli.main(["keygen", str(d), "--name", "srv"]) == 0
    out = capsys.readouterr().out
    assert str(d / "srv.key") in out and str(d / "srv.key_secret") in out
    assert "--authorized-keys" in out
    C.load_keypair(str(d / "srv.key_secret"))
    assert cli.main(["keygen", str(d), "--name", "srv"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    # the installed entry point, default name
    r = subprocess.run(
        [sys.executable, "-m", "ringleader.hostctl.cli", "keygen", str(d)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert C.load_keypair(str(d / "ringleader.key_secret"))
