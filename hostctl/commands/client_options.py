"""What every command that talks to a running server takes: its address, the time-outs and the
CURVE client keys (--connect, --timeout, --connect-timeout, --curve-*), and the client they make."""

from __future__ import annotations

import argparse

from ringleader.ipc.client.core import DEFAULT_ADDRESS
from ringleader.ipc.curve import add_curve_client_options, client_curve_from_args


def add_client_options(p: argparse.ArgumentParser, timeout: float) -> None:
    p.add_argument("--connect", default=DEFAULT_ADDRESS, help="the server's ZeroMQ address")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds to wait for each reply")
    p.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds to wait for a connection to the server"
    )
    add_curve_client_options(p)


def client_from_args(args: argparse.Namespace):
    """A Client of the server at --connect, with add_client_options' settings."""
    from ringleader.ipc.client import Client

    return Client(
        args.connect,
        timeout=args.timeout,
        connect_timeout=args.connect_timeout,
        curve=client_curve_from_args(args),
    )
