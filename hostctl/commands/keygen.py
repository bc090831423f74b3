"""`ringleader keygen`: a CURVE keypair, NAME.key (public) and NAME.key_secret; never overwrites."""

from __future__ import annotations

import argparse
import sys

from ringleader.ipc.curve import CurveError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "keygen", help="create a CURVE keypair: NAME.key (public) and NAME.key_secret; never overwrites"
    )
    p.add_argument("directory", help="where to write the keys (created if missing)")
    p.add_argument("--name", default="ringleader", help="file name stem (default: ringleader)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ringleader.ipc.curve import generate_keypair

    try:
        public, secret = generate_keypair(args.directory, args.name)
    except (CurveError, OSError) as exc:
        print(f"ringleader: keygen: {exc}", file=sys.stderr)
        return 2
    print(
        f"public key: {public}\nsecret key: {secret}  (keep it private, on this machine only)\n\n"
        f"For the server:  ringleader serve --curve-secret-key {secret} --authorized-keys DIR\n"
        f"  and give clients {public} for their --curve-server-key.\n"
        f"For a client:  copy {public} into the server's --authorized-keys DIR (read when the "
        f"server starts), then\n  ringleader generate ... --curve-server-key SERVER.key "
        f"--curve-secret-key {secret}"
    )
    return 0
