"""The gateway's upstream server, as its client sees it: an address checked before the client
makes any socket, and whether its connection is up now.

A malformed address must never reach the client: ZeroMQ refuses it only once the client's
socket exists, and a socket left open keeps the client's Context.term() waiting forever (the
gateway then hung without a word).  check_upstream_address tries the address on a socket of its
own, closed with linger 0 in a context of its own, so nothing is left for a term() to wait on."""

from __future__ import annotations

from typing import Any

import zmq

from ringleader.hostctl.serving.frontend_socket import check_bind_address


def check_upstream_address(address: str) -> None:
    """ValueError naming the address unless the gateway's client can connect to it: tcp:// or
    ipc:// (in serve's words for --bind), and an endpoint ZeroMQ takes."""
    check_bind_address(address)
    if address.partition("://")[0].lower() == "inproc":
        raise ValueError(
            f"{address!r}: inproc:// reaches only sockets of the same ZeroMQ context, never the "
            "gateway's; give the server's tcp:// or ipc:// address"
        )
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
    except zmq.ZMQError as exc:
        raise ValueError(f"{address!r} is not an address to connect to: {exc.strerror}") from None
    finally:
        sock.close(linger=0)
        context.term()


def connection_up(client: Any) -> bool | None:
    """Whether `client`'s connection to its server is up now (its socket monitor's last word:
    handshake done, or lost); None when the client does not say (a stand-in in tests)."""
    told = getattr(client, "connected", None)
    return told if isinstance(told, bool) else None
