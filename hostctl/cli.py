"""`ringleader` command line: serve, gateway, ray-serve, generate, stats, bench, build-kernel, doctor, keygen."""

from __future__ import annotations

import argparse
import logging
import sys

from ringleader.hostctl.commands import (
    bench,
    build_kernel,
    doctor,
    gateway,
    generate,
    keygen,
    ray_serve,
    serve,
    stats,
    wait_ready,
)
from ringleader.hostctl.commands.cannot_start import CommandError
from ringleader.ipc.curve import CurveError

# one module per command (hostctl/commands/), in the order `--help` lists them: each has
# add_parser(subparsers), which sets args.run, and run(args)
COMMANDS = (serve, gateway, ray_serve, generate, stats, wait_ready, build_kernel, doctor, keygen, bench)
LONG_RUNNING = ("serve", "gateway", "ray-serve")  # log at info by default (one line per request, the stop)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringleader", description=__doc__, formatter_class=DefaultsFormatter
    )
    parser.add_argument("--version", action="version", version=version_line())
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default=None,
        help="default: INFO for serve and gateway (a line per finished request), else WARNING; "
        "DEBUG also prints the traceback of a start-up error",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub).formatter_class = DefaultsFormatter
    return parser


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help shows its default, unless the help says it already or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in help.lower()
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or isinstance(action, argparse._VersionAction)
        ):
            return help
        return f"{help} (default: %(default)s)" if help else "(default: %(default)s)"


def version_line() -> str:
    from importlib import metadata

    from ringleader.ipc.protocol import PROTOCOL_REVISION

    try:
        version = metadata.version("ringleader")
    except metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    return f"ringleader {version} (wire protocol revision {PROTOCOL_REVISION})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] == ["bench"]:  # the bench parses its own options
        logging.basicConfig(level="WARNING")
        return bench.run(argv[1:])
    args = parser.parse_args(argv)
    level = args.log_level or ("INFO" if args.command in LONG_RUNNING else "WARNING")
    output = None
    if args.command in LONG_RUNNING:
        from ringleader.hostctl.serving.log_output import LogOutput

        output = LogOutput(level)  # a stalled stderr must not stall the server
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except CommandError as exc:  # one line naming the flag at fault
        print(f"ringleader {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except CurveError as exc:  # the message names the option or file
        print(f"ringleader: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a handler of its own took over
        print(file=sys.stderr)
        return 130
    finally:
        if output is not None:
            output.stop()


if __name__ == "__main__":
    sys.exit(main())
