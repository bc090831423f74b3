"""`ringleader gateway`: an OpenAI-compatible HTTP API in front of a running server (the gateway
itself is hostctl/gateway/app.py; `serve --http` runs the same one in the server's process)."""

from __future__ import annotations

import argparse
import os
import sys

from ringleader.ipc.client.core import DEFAULT_ADDRESS
from ringleader.ipc.curve import add_curve_client_options, client_curve_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "gateway", help="an OpenAI-compatible HTTP API in front of a running ringleader server"
    )
    p.add_argument(
        "--upstream",
        default=DEFAULT_ADDRESS,
        help="the ringleader server's ZeroMQ address (tcp:// or ipc://)",
    )
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="HTTP address")
    add_http_options(p)
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the upstream to answer; meanwhile the HTTP API answers 503 (loading)",
    )
    add_curve_client_options(p)
    p.set_defaults(run=run)
    return p


def add_http_options(p: argparse.ArgumentParser) -> None:
    """What the OpenAI gateway takes, in `serve --http` and in `gateway`."""
    p.add_argument("--served-model-name", help="the model name clients send (default: the server's model)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("RINGLEADER_API_KEY"),
        help="generation routes then need 'Authorization: Bearer KEY' (default $RINGLEADER_API_KEY)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        from ringleader.hostctl.gateway.app import GatewayConfig, run_gateway
    except ImportError as exc:
        print(f"ringleader gateway: {exc}", file=sys.stderr)
        return 2

    from ringleader.hostctl.commands.http_fronts import bind_listen
    from ringleader.hostctl.gateway.upstream import check_upstream_address

    try:  # each in one line naming its flag, before anything connects
        check_upstream_address(args.upstream)
    except ValueError as exc:
        print(f"ringleader gateway: --upstream: {exc}", file=sys.stderr)
        return 2
    try:
        sock = bind_listen("--listen", args.listen)
    except ValueError as exc:
        print(f"ringleader gateway: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # bind_listen's words, without "[Errno 98]"
        print(f"ringleader gateway: {exc.strerror or exc}", file=sys.stderr)
        return 2
    config = GatewayConfig(
        upstream=args.upstream,
        sock=sock,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        curve=client_curve_from_args(args),
        startup_timeout_s=args.startup_timeout,
    )
    return run_gateway(config)
