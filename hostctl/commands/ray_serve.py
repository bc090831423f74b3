"""`ringleader ray-serve`: many engines behind one OpenAI endpoint on Ray Serve, one engine per
replica (the app is hostctl/ray_serve/; docs/scale-out.md).  It takes `serve`'s engine and
server options as they are, for every replica's engine; ray is imported only when it runs."""

from __future__ import annotations

import argparse
import os
import sys

from ringleader.device.engine_config import EngineConfig
from ringleader.hostctl.commands.gateway import add_http_options
from ringleader.hostctl.commands.serve_flags import (
    ENGINE_FLAGS,
    SERVER_FLAGS,
    add_config_options,
    add_engine_options,
    add_server_options,
)
from ringleader.hostctl.ray_serve.args import ArgsError, RayServeArgs
from ringleader.hostctl.serving.config import ServerConfig
from ringleader.ipc.config_options import options_by_name

# engine options naming files: made absolute, since a replica's engine starts in Ray's folder
PATH_OPTIONS = ("model", "chat_template", "trace_path")
INSTALL_HINT = "pip install 'ringleader[ray]' (Ray Serve, CPU-only from PyPI)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ray-serve",
        help="serve the OpenAI API from many engines on Ray Serve, one engine per replica (extra: ray)",
    )
    add_engine_options(p)
    add_server_options(p)
    add_config_options(p, RayServeArgs)
    p.add_argument(
        "--listen",
        default="127.0.0.1:8000",
        metavar="HOST:PORT",
        help="Ray Serve's HTTP proxy (every node's)",
    )
    p.add_argument(
        "--address",
        help="the Ray cluster to deploy on ('auto': the one `ray start` runs here); default: "
        "start a local one for this command's life",
    )
    p.add_argument("--name", default="ringleader", help="the Ray Serve application's name")
    add_http_options(p)
    p.set_defaults(run=run)
    return p


def args_from_cli(args: argparse.Namespace) -> RayServeArgs:
    """RayServeArgs of the command line: engine options that differ from serve's defaults, the
    model always."""
    engine_defaults, server_defaults = EngineConfig(), ServerConfig()
    engine = {
        name: getattr(args, name)
        for name in ENGINE_FLAGS
        if name == "model" or getattr(args, name) != getattr(engine_defaults, name)
    }
    engine.update(
        {
            name: getattr(args, name)
            for name in SERVER_FLAGS
            if getattr(args, name) != getattr(server_defaults, name)
        }
    )
    for name in PATH_OPTIONS:
        value = engine.get(name)
        if isinstance(value, str) and not os.path.isabs(value) and os.path.exists(value):
            engine[name] = os.path.abspath(value)
    own = {name: getattr(args, name) for name in options_by_name(RayServeArgs)}
    return RayServeArgs(engine=engine, served_model_name=args.served_model_name, api_key=args.api_key, **own)


def run(args: argparse.Namespace) -> int:
    from ringleader.hostctl.commands.http_fronts import bind_listen, parse_listen

    try:
        host, port = parse_listen(args.listen)
        ray_args = args_from_cli(args)
        if args.address is None:  # a port in use fails here, in one line, not inside Ray's start
            bind_listen("--listen", args.listen).close()
    except (OSError, ValueError, ArgsError) as exc:
        print(f"ringleader ray-serve: {exc}", file=sys.stderr)
        return 2
    try:
        from ringleader.hostctl.ray_serve import app
    except ImportError as exc:
        print(f"ringleader ray-serve: needs Ray Serve ({exc}): {INSTALL_HINT}", file=sys.stderr)
        return 2
    return app.run(ray_args, host=host, port=port, address=args.address, name=args.name)
