"""The ZeroMQ side both client shells share: the address they connect to (checked before a socket
is made: ZeroMQ says only "Invalid argument"), and how their DEALER socket is set up and watched."""

from __future__ import annotations

from typing import TypeVar

import zmq

from ringleader.ipc.curve import HANDSHAKE_FAILED_EVENTS, ClientCurve, secure_client_socket

CLOSE_LINGER_MS = 200  # time to flush the aborts close() sends for requests still in flight
MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS

SocketT = TypeVar("SocketT", bound=zmq.Socket)
# the transports a ringleader server binds (FrontendSocket checks its address with check_transport)
TRANSPORTS = ("tcp", "ipc", "inproc")


def check_transport(address: str) -> None:
    """ValueError naming the address unless it is TRANSPORT://ENDPOINT with a transport a server
    binds (the mistake of `127.0.0.1:5555` for `tcp://127.0.0.1:5555`, said in the words `serve
    --bind` uses).  Every client checks this before it makes a socket."""
    if not isinstance(address, str):
        raise ValueError(f"the server's address must be a str such as tcp://127.0.0.1:5555, got {address!r}")
    scheme, sep, endpoint = address.partition("://")
    if not sep:
        raise ValueError(
            f"{address!r} is not a ZeroMQ address: it needs a transport, e.g. tcp://{address or '127.0.0.1:5555'}"
        )
    if scheme.lower() not in TRANSPORTS:
        raise ValueError(f"{address!r}: the transport must be one of {', '.join(TRANSPORTS)}, got {scheme!r}")
    if not endpoint:
        raise ValueError(f"{address!r} names no endpoint, e.g. {scheme}://127.0.0.1:5555")


def check_address(address: str) -> None:
    """check_transport, and for tcp a HOST:PORT with a port in 1..65535 (what connecting needs;
    ZeroMQ itself says only "Invalid argument")."""
    check_transport(address)
    scheme, _, endpoint = address.partition("://")
    if scheme.lower() != "tcp":
        return
    host, colon, port = endpoint.rpartition(":")
    if not colon or not host:
        raise ValueError(f"{address!r} names no port: expected tcp://HOST:PORT, e.g. tcp://{endpoint}:5555")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{address!r}: expected tcp://HOST:PORT with a port in 1..65535, got {port!r}")


def setup_dealer(sock: SocketT, curve: ClientCurve | None, *, immediate: bool) -> SocketT:
    """Options for a client's DEALER (before connect); returns its monitor socket.

    immediate: frames wait in our queue, not for a server that is not there."""
    sock.setsockopt(zmq.RCVHWM, 0)  # a ROUTER drops replies to a full pipe: never let ours fill
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    if curve is not None:
        secure_client_socket(sock, curve)
    return sock.get_monitor_socket(MONITOR_EVENTS)


def has_input(sock: zmq.Socket) -> bool:
    """True when a frame is waiting to be read (without reading it)."""
    events = sock.getsockopt(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)
