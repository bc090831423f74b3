"""`ringleader stats`: a running server's stats, as JSON."""

from __future__ import annotations

import argparse
import json

from ringleader.hostctl.commands.client_options import add_client_options, client_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("stats", help="print a running server's stats")
    add_client_options(p, timeout=10.0)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        print(json.dumps(client.stats(), indent=2, sort_keys=True))
    return 0
