"""ZeroMQ CURVE authentication (RFC 26, with a ZAP handler per RFC 27) for the ROUTER and its clients.

Keys are the files `zmq.auth.create_certificates` writes (`ringleader keygen`): `NAME.key` holds
the public key, `NAME.key_secret` the public and the secret key.  The server has a keypair and a
directory of the clients' public `*.key` files it accepts; a client has a keypair and the server's
public key.  A peer without keys, with the wrong server key, or with a key not in the directory
fails the handshake: the server never sees a frame from it.

Server side, in order:

    ctx = zmq.Context()                       # its own context: one ZAP handler per context
    sock = ctx.socket(zmq.ROUTER)
    auth = secure_server_socket(ctx, sock, curve)   # before bind
    sock.bind(address)
    ...
    sock.close(); auth.stop(); ctx.term()     # stop() before term(), else term() waits forever

Client side: `secure_client_socket(sock, curve)` before connect.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

log = logging.getLogger("ringleader.curve")

# The ZAP domain of the server socket.  With a domain set, ZAP_ENFORCE_DOMAIN makes libzmq refuse
# CURVE clients when no ZAP handler answers (without it, a CURVE server with no handler accepts
# every client that knows the server's public key).
ZAP_DOMAIN = "ringleader"

# Monitor events a client sees when the server refuses its handshake (the DEALER keeps retrying;
# its queued frames are never delivered).
HANDSHAKE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


class CurveError(ValueError):
    """A CURVE configuration problem: the message names the file or option and what is wrong."""


def require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveError(
            f"this libzmq ({zmq.zmq_version()}) was built without CURVE support; "
            "install a pyzmq wheel (it bundles a libzmq with CURVE) or build libzmq "
            "with libsodium"
        )


# ---- key files ------------------------------------------------------------------------------


def _check_z85_key(key: bytes | None, path: str, what: str) -> bytes:
    if not key:
        raise CurveError(f"{path}: no {what} in this file")
    try:
        ok = len(key) == 40 and len(z85.decode(key)) == 32
    except Exception:
        ok = False
    if not ok:
        raise CurveError(f"{path}: the {what} is not a 40-character Z85 CURVE key")
    return key


def _read_key_file(path: str) -> tuple[bytes, bytes | None]:
    if not os.path.exists(path):
        raise CurveError(f"{path}: no such key file")
    if not os.path.isfile(path):
        raise CurveError(f"{path}: not a file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except ValueError:
        raise CurveError(
            f"{path}: not a CURVE key file (no public-key line; create keys with `ringleader keygen`)"
        ) from None
    except OSError as exc:
        raise CurveError(f"{path}: cannot read: {exc}") from None
    return _check_z85_key(public, path, "public key"), secret


def load_keypair(path: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a NAME.key_secret file, checked to belong together."""
    public, secret = _read_key_file(path)
    if secret is None:
        raise CurveError(
            f"{path}: no secret key in this file (it is a public key file; give the NAME.key_secret file)"
        )
    _check_z85_key(secret, path, "secret key")
    if zmq.curve_public(secret) != public:
        raise CurveError(f"{path}: the secret key does not match the public key in the same file")
    return public, secret


def load_public_key(path: str) -> bytes:
    public, secret = _read_key_file(path)
    if secret is not None:
        raise CurveError(
            f"{path}: this file holds a secret key; a peer needs only the public "
            "NAME.key file (never copy NAME.key_secret off its machine)"
        )
    return public


def load_authorized_keys(directory: str) -> dict[bytes, str]:
    """The public keys of the `*.key` files in `directory`, each mapped to its file."""
    if not os.path.exists(directory):
        raise CurveError(f"{directory}: authorized-keys directory does not exist")
    if not os.path.isdir(directory):
        raise CurveError(f"{directory}: authorized-keys path is not a directory")
    keys: dict[bytes, str] = {}
    for path in sorted(Path(directory).glob("*.key")):  # what zmq.auth.load_certificates reads
        keys[_read_key_file(str(path))[0]] = str(path)
    if not keys:
        hint = (
            " (it holds *.key_secret files: copy the public NAME.key files instead)"
            if any(Path(directory).glob("*.key_secret"))
            else ""
        )
        raise CurveError(
            f"{directory}: authorized-keys directory has no *.key files{hint}; "
            "copy each client's public NAME.key into it"
        )
    return keys


@dataclass(frozen=True)
class ServerCurve:
    """The server's keypair file and the directory of client public keys it accepts.
    Checked on construction (CurveError); the files are read again by secure_server_socket."""

    secret_key_file: str
    authorized_keys_dir: str

    def __post_init__(self) -> None:
        self.load()
        load_authorized_keys(self.authorized_keys_dir)

    def load(self) -> tuple[bytes, bytes]:
        """(public, secret) of the server."""
        return load_keypair(self.secret_key_file)


@dataclass(frozen=True)
class ClientCurve:
    """The server's public key file and the client's keypair file.  Checked on construction."""

    server_public_key_file: str
    secret_key_file: str

    def __post_init__(self) -> None:
        self.load()

    def load(self) -> tuple[bytes, bytes, bytes]:
        """(server public, client public, client secret)."""
        return load_public_key(self.server_public_key_file), *load_keypair(self.secret_key_file)


def generate_keypair(directory: str | os.PathLike, name: str) -> tuple[str, str]:
    """Write `directory/NAME.key` (public) and `NAME.key_secret` (mode 0600); creates `directory`.
    Never overwrites: raises FileExistsError when either file exists."""
    require_curve()
    if not _NAME_RE.fullmatch(name):
        raise CurveError(
            f"key name {name!r}: use letters, digits, '.', '_' and '-' (not starting with '.' or '-')"
        )
    directory = os.fspath(directory)
    public_path = os.path.join(directory, f"{name}.key")
    secret_path = os.path.join(directory, f"{name}.key_secret")
    for path in (public_path, secret_path):
        if os.path.lexists(path):
            raise FileExistsError(
                f"{path} already exists; refusing to overwrite a key "
                "(choose another --name or directory, or remove it first)"
            )
    os.makedirs(directory, exist_ok=True)
    # Written into a private (0700) scratch directory, then hard-linked into place: a link never
    # replaces an existing file, and the secret key is never readable by others on the way.
    scratch = tempfile.mkdtemp(prefix=f".{name}.", dir=directory)
    try:
        tmp_public, tmp_secret = zmq.auth.create_certificates(scratch, name)
        os.chmod(tmp_secret, 0o600)
        os.chmod(tmp_public, 0o644)
        placed = []
        try:
            for src, dst in ((tmp_secret, secret_path), (tmp_public, public_path)):
                try:
                    os.link(src, dst)
                except FileExistsError:
                    raise FileExistsError(f"{dst} already exists; refusing to overwrite a key") from None
                except OSError:  # a filesystem without hard links
                    if os.path.lexists(dst):
                        raise FileExistsError(f"{dst} already exists; refusing to overwrite a key") from None
                    os.replace(src, dst)
                placed.append(dst)
        except BaseException:
            for dst in placed:
                os.unlink(dst)
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return public_path, secret_path


# ---- sockets --------------------------------------------------------------------------------


ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks (RFC 27): one handler per context
_ZAP_VERSION = b"1.0"
_ZAP_POLL_MS = 100  # how often the handler looks at its stop flag: stop() takes at most this long


class CurveAuthenticator:
    """The ZAP handler of one server socket: a thread answering libzmq's handshake questions from
    the authorized-keys set.  Ours rather than pyzmq's ThreadAuthenticator, whose asyncio loop could
    miss its TERMINATE and leave stop() (and so the server's shutdown and ctx.term()) waiting
    forever; this one polls with a timeout and stop() is bounded.  stop() is idempotent; call it
    after closing the server socket and before terminating the context."""

    def __init__(self, ctx: zmq.Context, curve: ServerCurve, public_key: bytes, authorized: dict[bytes, str]):
        self.curve = curve
        self.public_key = public_key
        self.authorized = authorized  # replaced whole by reload(): the handler reads one snapshot
        self.refused = 0  # handshakes answered 400, for logs and tests
        self._lock = threading.Lock()
        self._stop = threading.Event()
        sock = ctx.socket(zmq.REP)
        sock.linger = 0
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close()
            if exc.errno == zmq.EADDRINUSE:
                raise CurveError(
                    "this zmq.Context already runs a ZAP handler (another CURVE server "
                    "or authenticator); give each CURVE server its own zmq.Context()"
                ) from None
            raise
        self._thread: threading.Thread | None = threading.Thread(
            target=self._serve, args=(sock,), name="ringleader-zap", daemon=True
        )
        self._thread.start()

    def _serve(self, sock: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if sock.poll(_ZAP_POLL_MS):
                    sock.send_multipart(self._answer(sock.recv_multipart()))
        except zmq.ZMQError as exc:  # the context was terminated under us: nothing left to guard
            if exc.errno != zmq.ETERM:
                log.error("ZAP handler stopped: %s", exc)
        finally:
            sock.close()

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request: 200 for an authorized CURVE key on our domain, else 400."""
        if len(request) < 6 or request[0] != _ZAP_VERSION:
            request_id = request[1] if len(request) > 1 else b""
            return [_ZAP_VERSION, request_id, b"500", b"malformed ZAP request", b"", b""]
        _, request_id, domain, address, _identity, mechanism, *credentials = request
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and credentials else None
        if domain == ZAP_DOMAIN.encode() and key is not None and key in self.authorized:
            return [_ZAP_VERSION, request_id, b"200", b"OK", key, b""]
        self.refused += 1
        log.debug(  # debug: a refused DEALER retries every 100 ms
            "refused a %s handshake from %s: %s",
            mechanism.decode(errors="replace"),
            address.decode(errors="replace"),
            "key not in the authorized-keys directory" if key is not None else "not a CURVE client",
        )
        return [_ZAP_VERSION, request_id, b"400", b"key not authorized", b"", b""]

    def reload(self) -> int:
        """Re-read the authorized-keys directory (raises CurveError, keeping the old set, if it is
        now invalid); returns the number of keys accepted from now on."""
        authorized = load_authorized_keys(self.curve.authorized_keys_dir)
        with self._lock:
            if self._thread is None:
                raise RuntimeError("the authenticator is stopped")
            self.authorized = authorized
        return len(authorized)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=10 * _ZAP_POLL_MS / 1000)
            if thread.is_alive():  # never seen; say so rather than hang the shutdown here
                log.error("the ZAP handler did not stop within %d ms", 10 * _ZAP_POLL_MS)

    def __enter__(self) -> CurveAuthenticator:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _check_unused(sock: zmq.Socket, what: str) -> None:
    if sock.getsockopt(zmq.LAST_ENDPOINT):
        raise RuntimeError(f"CURVE must be set up before the socket's first {what}")


def secure_server_socket(ctx: zmq.Context, sock: zmq.Socket, curve: ServerCurve) -> CurveAuthenticator:
    """Start a ZAP handler on `ctx` accepting the keys in `curve.authorized_keys_dir`, and make
    `sock` (of `ctx`, not yet bound) a CURVE server.  Only one ZAP handler can run per context:
    give each CURVE server its own zmq.Context() (not zmq.Context.instance())."""
    require_curve()
    _check_unused(sock, "bind")
    if sock.context is not ctx:
        raise ValueError("the socket must belong to the context the ZAP handler runs on")
    public, secret = curve.load()
    authorized = load_authorized_keys(curve.authorized_keys_dir)
    handle = CurveAuthenticator(ctx, curve, public, authorized)
    try:
        sock.zap_domain = ZAP_DOMAIN.encode()
        try:
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        except (AttributeError, zmq.ZMQError):  # libzmq < 4.3: the handler is still required by us
            log.warning(
                "libzmq %s lacks ZAP_ENFORCE_DOMAIN: stop the authenticator only after "
                "closing the server socket",
                zmq.zmq_version(),
            )
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
    except BaseException:
        handle.stop()
        raise
    log.info(
        "CURVE on: server key %s, %d authorized client key(s) from %s",
        public.decode(),
        len(authorized),
        curve.authorized_keys_dir,
    )
    return handle


def secure_client_socket(sock: zmq.Socket, curve: ClientCurve) -> None:
    """Make `sock` (not yet connected) a CURVE client of the server whose public key is given."""
    require_curve()
    _check_unused(sock, "connect")
    server_public, public, secret = curve.load()
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def describe_handshake_failure(event: int, value: int = 0) -> str:
    """Words for a HANDSHAKE_FAILED_* monitor event seen by a client."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the server refused this client's CURVE key (ZAP status {value}): its public "
            "key is not in the server's authorized-keys directory"
        )
    return (
        "the security handshake with the server failed: wrong server public key, or CURVE "
        "on one side only (--curve-server-key/--curve-secret-key must match the server's setup)"
    )


# ---- addresses ------------------------------------------------------------------------------


def is_loopback(bind_address: str) -> bool:
    """True when only this machine can reach `bind_address`: ipc://, inproc://, and tcp (or ws,
    udp) on 127.0.0.0/8, ::1 or localhost.  Wildcards, interface names and other hosts: False."""
    scheme, sep, rest = bind_address.partition("://")
    scheme = scheme.lower()
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme not in ("tcp", "ws", "wss", "udp"):
        return False
    rest = rest.split("/", 1)[0].rsplit(";", 1)[-1]  # drop a ws path and a connect source
    if rest.startswith("["):
        host = rest[1:].split("]", 1)[0]
    elif rest.count(":") == 1:
        host = rest.split(":", 1)[0]
    else:
        host = rest
    host = host.split("%", 1)[0]  # an IPv6 zone
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # '*', an interface name or a host name: may face the network
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def unauthenticated_bind_warning(bind_address: str, curve: ServerCurve | None) -> str | None:
    """The warning to log when a server binds beyond loopback without CURVE, else None."""
    if curve is not None or is_loopback(bind_address):
        return None
    return (
        f"{bind_address} is reachable from other machines and CURVE authentication is off "
        "(bound without CURVE keys): anyone who can connect can use this server (see "
        "`ringleader keygen`, "
        "--curve-secret-key and --authorized-keys)"
    )


# ---- command-line options -------------------------------------------------------------------


def add_curve_server_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("CURVE authentication (both options, or neither)")
    g.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        default=None,
        help="the server's NAME.key_secret (from `ringleader keygen`); turns CURVE on",
    )
    g.add_argument(
        "--authorized-keys",
        metavar="DIR",
        default=None,
        help="directory of the client public keys (*.key) this server accepts",
    )


def add_curve_client_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("CURVE authentication (both options, or neither)")
    g.add_argument("--curve-server-key", metavar="FILE", default=None, help="the server's public NAME.key")
    g.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        default=None,
        help="this client's NAME.key_secret (its NAME.key must be in the server's authorized-keys directory)",
    )


def _pair(args, a: str, b: str, flag_a: str, flag_b: str):
    va, vb = getattr(args, a, None), getattr(args, b, None)
    if (va is None) != (vb is None):
        given, missing = (flag_a, flag_b) if va is not None else (flag_b, flag_a)
        raise CurveError(f"{given} needs {missing} too (CURVE takes both, or neither)")
    return va, vb


def server_curve_from_args(args: argparse.Namespace) -> ServerCurve | None:
    """ServerCurve from add_curve_server_options' flags, None when neither is given; CurveError
    when only one is, or a file is unusable."""
    secret, authorized = _pair(
        args, "curve_secret_key", "authorized_keys", "--curve-secret-key", "--authorized-keys"
    )
    return None if secret is None else ServerCurve(secret, authorized)


def client_curve_from_args(args: argparse.Namespace) -> ClientCurve | None:
    """ClientCurve from add_curve_client_options' flags, None when neither is given; CurveError
    when only one is, or a file is unusable."""
    server_key, secret = _pair(
        args, "curve_server_key", "curve_secret_key", "--curve-server-key", "--curve-secret-key"
    )
    return None if server_key is None else ClientCurve(server_key, secret)
