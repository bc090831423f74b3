"""`ringleader bench`: the benchmark (bench/cli.py), which parses its own options; the product
reaches the bench only here, when the command runs."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    # a placeholder for the command list: main() hands `bench`'s arguments to run() unparsed
    return subparsers.add_parser("bench", help="benchmark (see `ringleader bench --help`)", add_help=False)


def run(argv: list[str]) -> int:
    """Runs the bench's own command line on argv (what follows `ringleader bench`)."""
    from ringleader.bench.cli import main as bench_main

    return bench_main(argv)
