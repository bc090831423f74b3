"""`ringleader wait-ready`: waits until a server answers at --connect.  It answers once its model
has loaded and it serves (`serve` binds first, so requests sent while it loads wait for it, not
fail)."""

from __future__ import annotations

import argparse
import sys
import time

from ringleader.hostctl.commands.client_options import add_connect_option, checked_address, seconds
from ringleader.ipc.curve import add_curve_client_options, client_curve_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "wait-ready",
        help="wait until a server serves (its model loaded); exit 1 if none does in --timeout seconds",
    )
    add_connect_option(p)
    p.add_argument("--timeout", type=seconds, default=300.0, help="seconds to wait")
    p.add_argument("--quiet", action="store_true", help="print nothing when ready")
    add_curve_client_options(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ringleader.ipc.client import Client

    address = checked_address(args)
    # no liveness checks: a server that is still starting is neither connected nor answering
    with Client(
        address, connect_timeout=None, reply_timeout=None, curve=client_curve_from_args(args)
    ) as client:
        started = time.monotonic()
        try:
            stats = client.stats(timeout=args.timeout)
        except TimeoutError:
            print(
                f"ringleader wait-ready: no ringleader server served at {args.connect} within {args.timeout:g} s",
                file=sys.stderr,
            )
            return 1
        except ConnectionError as exc:  # the connection was lost, or CURVE refused
            print(f"ringleader wait-ready: {args.connect}: {exc}", file=sys.stderr)
            return 1
    dead = stats.get("engine_dead")
    if dead:
        print(f"ringleader wait-ready: the server at {args.connect} answers, but its engine is dead: {dead}")
        return 1
    if not args.quiet:
        print(
            f"ready: {stats.get('model')} at {args.connect} (waited {time.monotonic() - started:.1f} s)",
            file=sys.stderr,
        )
    return 0
