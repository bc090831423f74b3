"""`ringleader stats`: a running server's stats, as JSON."""

from __future__ import annotations

import argparse
import json

from ringleader.hostctl.commands.client_options import add_client_options, client_from_args, no_answer


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("stats", help="print a running server's stats")
    add_client_options(p, timeout=10.0)
    p.add_argument(
        "--timeline-after-seq",
        type=_step,
        default=None,
        metavar="N",
        help="the device timeline's figures over the steps after step N only (the `steps` counter "
        "of an earlier reading; protocol 1.6)",
    )
    p.set_defaults(run=run)
    return p


def _step(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a step number >= 0, got {text!r}")
    return n


def run(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        try:
            stats = client.stats(timeline_after_seq=args.timeline_after_seq)
        except (TimeoutError, ConnectionError) as exc:
            raise no_answer(args, exc) from None
        print(json.dumps(stats, indent=2, sort_keys=True))
    return 0
