"""The server's ROUTER socket, made and bound on its own so that `serve` can bind it before the
model loads: a busy port or a malformed address then fails in a second, not after the load.

FrontendSocket checks the address, sets the socket's options, turns CURVE on when keys are
given, and binds.  The Server takes it over (its frontend thread alone uses it from then on) and
closes it at shutdown.  Until the server serves, nothing reads it: frames that arrive while the
model loads wait in ZeroMQ's queue and are answered once it serves (`ringleader wait-ready`
relies on exactly that)."""

from __future__ import annotations

import errno
import logging

import zmq

from ringleader.ipc.client.connection import check_transport
from ringleader.ipc.curve import secure_server_socket, unauthenticated_bind_warning

log = logging.getLogger("ringleader.server")

HARD_FRAME_LIMIT = 64 << 20  # zmq drops a connection that sends more than this in one frame
ACCEPT_BACKLOG = 4096  # pending TCP connections (the kernel caps it at net.core.somaxconn)


class BindError(OSError):
    """The address cannot be bound; the message names it and what to do."""


def check_bind_address(address: str) -> None:
    """ValueError naming the address unless it is TRANSPORT://ENDPOINT with a transport we serve
    (the clients' own check, so both ends word a mistake alike)."""
    check_transport(address)


class FrontendSocket:
    """A bound ROUTER socket with the server's options; max_frame_bytes: the largest request frame
    (ServerConfig's); curve: ringleader.ipc.curve.ServerCurve or None."""

    def __init__(self, bind: str, *, max_frame_bytes: int, curve=None):
        check_bind_address(bind)
        self.max_frame_bytes = max_frame_bytes
        # ZAP is per context: a CURVE server keeps its own (and terminates it at close)
        self.context = zmq.Context() if curve is not None else zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        try:
            self.auth = secure_server_socket(self.context, self.socket, curve) if curve else None
        except BaseException:
            self._close_unbound()
            raise
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)
        self.socket.setsockopt(zmq.RCVHWM, 100_000)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max(HARD_FRAME_LIMIT, 4 * max_frame_bytes))
        # many clients connecting at once (a fleet's restart; 256 in the token-path bench) must
        # not overflow the accept queue and wait out a SYN retry (1 s): ZeroMQ's default is 100
        self.socket.setsockopt(zmq.BACKLOG, ACCEPT_BACKLOG)
        try:
            self.socket.bind(bind)
        except zmq.ZMQError as exc:
            self._close_unbound()
            raise BindError(exc.errno, _bind_failure(bind, exc)) from None
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        warning = unauthenticated_bind_warning(bind, curve)
        if warning:
            log.warning(warning)

    def _close_unbound(self) -> None:
        self.socket.close(linger=0)
        auth = getattr(self, "auth", None)  # unset when CURVE itself failed
        if auth is not None:
            auth.stop()
        if self.context is not zmq.Context.instance():
            self.context.term()

    def close(self, linger_ms: int) -> None:
        self.socket.close(linger=linger_ms)
        if self.auth is not None:
            self.auth.stop()
            self.context.term()


def _bind_failure(address: str, exc: zmq.ZMQError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"cannot bind {address}: the address is in use (another server there?); choose another --bind"
    if exc.errno in (errno.EADDRNOTAVAIL, errno.ENODEV):
        return f"cannot bind {address}: no interface of this machine has that address"
    if exc.errno == errno.EACCES:
        return f"cannot bind {address}: permission denied (ports below 1024 need privileges)"
    return f"cannot bind {address}: {exc.strerror}"
