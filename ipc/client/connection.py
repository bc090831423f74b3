"""The ZeroMQ side both client shells share: how their DEALER socket is set up and watched."""

from __future__ import annotations

from typing import TypeVar

import zmq

from ringleader.ipc.curve import HANDSHAKE_FAILED_EVENTS, ClientCurve, secure_client_socket

CLOSE_LINGER_MS = 200  # time to flush the aborts close() sends for requests still in flight
MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS

SocketT = TypeVar("SocketT", bound=zmq.Socket)


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
