"""What every command that talks to a running server takes: its address, the time-outs and the
CURVE client keys (--connect, --timeout, --connect-timeout, --curve-*), and the client they make.
A mistake in them, and a server that does not answer, are one line naming the flag
(CommandError, said by cli.main)."""

from __future__ import annotations

import argparse
import math

from ringleader.hostctl.commands.cannot_start import CommandError
from ringleader.ipc.client import core
from ringleader.ipc.client.connection import check_address
from ringleader.ipc.client.core import DEFAULT_ADDRESS
from ringleader.ipc.curve import add_curve_client_options, client_curve_from_args


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def add_connect_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", default=DEFAULT_ADDRESS, help="the server's ZeroMQ address (tcp://HOST:PORT)")


def add_client_options(p: argparse.ArgumentParser, timeout: float) -> None:
    add_connect_option(p)
    p.add_argument(
        "--timeout",
        type=seconds,
        default=timeout,
        help="seconds to wait for each reply (a server still loading its model answers once it serves)",
    )
    p.add_argument(
        "--connect-timeout",
        type=seconds,
        default=10.0,
        help="seconds to wait for a connection to the server",
    )
    add_curve_client_options(p)


def checked_address(args: argparse.Namespace) -> str:
    """--connect, or a CommandError naming it (exit code 2) when it is no address a client can
    connect to (127.0.0.1:5555 for tcp://127.0.0.1:5555)."""
    try:
        check_address(args.connect)
    except ValueError as exc:
        raise CommandError(f"--connect: {exc}") from None
    return args.connect


def client_from_args(args: argparse.Namespace):
    """A Client of the server at --connect, with add_client_options' settings.  The reply
    liveness limit (the time a server that answers nothing, not even a ping, is given) is never
    shorter than --timeout: a server loading its model answers nothing for a while, and the
    user's --timeout says how long to wait for it."""
    from ringleader.ipc.client import Client

    address = checked_address(args)
    return Client(
        address,
        timeout=args.timeout,
        connect_timeout=args.connect_timeout,
        reply_timeout=max(core.DEFAULT_REPLY_TIMEOUT_S, args.timeout),
        curve=client_curve_from_args(args),
    )


def no_answer(args: argparse.Namespace, exc: BaseException) -> CommandError:
    """The one line (exit code 1) for a server that did not answer: a TimeoutError after
    --timeout, or the ConnectionError of the client's liveness checks (no connection within
    --connect-timeout, the connection lost, a refused CURVE handshake)."""
    if isinstance(exc, TimeoutError):
        return CommandError(f"no server answered at {args.connect} within {args.timeout:g} s (--timeout)", 1)
    message = str(exc)
    if message.startswith("no connection to the server"):
        return CommandError(
            f"no server answered at {args.connect} within {args.connect_timeout:g} s "
            "(--connect-timeout; is `ringleader serve` running there?)",
            1,
        )
    return CommandError(f"{args.connect}: {message}", 1)
