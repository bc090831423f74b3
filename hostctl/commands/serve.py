"""`ringleader serve`: the server, on the engine of EngineConfig and the server of ServerConfig
(their flags: serve_flags.py).  Everything that can fail fast (options, the model's path, every
address and port, the optional packages asked for) is checked and bound before the model loads;
a start-up failure is one line naming the fault (the traceback too under --log-level debug)."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ringleader.device.engine_config import EngineConfig
from ringleader.hostctl.commands.cannot_start import cannot_start
from ringleader.hostctl.commands.gateway import add_http_options
from ringleader.hostctl.commands.serve_flags import (
    add_engine_options,
    add_server_options,
    engine_config_from_args,
    server_config_from_args,
)
from ringleader.ipc.client.core import DEFAULT_ADDRESS
from ringleader.ipc.curve import add_curve_server_options, server_curve_from_args

if TYPE_CHECKING:
    from ringleader.ipc.backend import Backend

log = logging.getLogger("ringleader.cli")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the server")
    add_engine_options(p)
    add_server_options(p)
    p.add_argument(
        "--bind",
        default=DEFAULT_ADDRESS,
        help="ZeroMQ address; a non-loopback one "
        "without CURVE keys is open to anyone who reaches it (a warning says so)",
    )
    add_curve_server_options(p)
    p.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API here (the gateway, in this process)",
    )
    p.add_argument(
        "--metrics", metavar="HOST:PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics"
    )
    add_http_options(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ringleader.hostctl.commands.http_fronts import HttpFronts
    from ringleader.hostctl.serving.frontend_socket import FrontendSocket
    from ringleader.hostctl.serving.server import Server
    from ringleader.ipc.backend import EngineDead

    opened: list[Callable[[], None]] = []  # closed if the start fails
    try:
        curve = server_curve_from_args(args)
        config = engine_config_from_args(args).resolved()
        server_config = server_config_from_args(args)
        _check_model_and_device(config)
        fronts = HttpFronts(args.http, args.metrics, curve=bool(args.curve_secret_key))
        opened.append(fronts.close)
        try:
            frontend = FrontendSocket(args.bind, curve=curve, max_frame_bytes=server_config.max_frame_bytes)
        except ValueError as exc:
            raise ValueError(f"--bind: {exc}") from None
        opened.append(lambda: frontend.close(0))
        _limit_malloc_arenas()
        log.info("loading %s on %s", config.model, config.device)
        started = time.monotonic()
        backend = open_configured_backend(config)
        log.info("loaded %s in %.1f s", backend.model.name, time.monotonic() - started)
        server = Server(backend, frontend, server_config)
        opened = [fronts.close]  # the server owns the frontend socket from here
        fronts.start(server, served_model_name=args.served_model_name, api_key=args.api_key)
    except Exception as exc:
        for close in reversed(opened):
            close()
        return cannot_start(exc)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.request_stop())

    def announce() -> None:  # the line a script may wait for: requests are served from now on
        print(
            f"ringleader: serving {backend.model.name} on {server.address} ({json.dumps(backend.description)})",
            file=sys.stderr,
            flush=True,
        )
        # what start-up made (the model, torch, the gateway's imports) is never garbage: a full
        # collection scanned it, about 0.1 s with every thread stopped (a TTFT p99 of 135 ms
        # where 27 was usual); frozen, collections scan only what serving makes
        gc.collect()
        gc.freeze()

    try:
        server.serve_forever(on_serving=announce)
    except EngineDead as exc:
        print(f"ringleader: the engine did not stop cleanly: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if server.serving.is_set():
            raise  # a fault while serving is a bug: its traceback matters
        return cannot_start(exc)  # the backend failed to start
    finally:
        fronts.close()
        # back to the collector before exit: what start-up made and since dropped (a socket, a
        # context) must be collected, or ZeroMQ's context waits at exit for a socket never closed
        gc.unfreeze()
        gc.collect()
    log.info("exited")
    return 0


def open_configured_backend(config: EngineConfig) -> Backend:
    from ringleader.device.backends import open_backend  # where serve reaches into device/

    return open_backend(config)


def _check_model_and_device(config: EngineConfig) -> None:
    """ValueError unless --model can name a model and --device can run here (no weights read)."""
    from ringleader.device.engine_config import cuda_unavailable_reason
    from ringleader.device.model.model_spec import check_model_spec

    check_model_spec(config.model)
    if config.device == "cuda":
        if config.scheduler == "device":  # settings that hang a persistent kernel, named first
            from ringleader.device.backends.cuda_preflight import refuse_unsafe_environment

            refuse_unsafe_environment()
        reason = cuda_unavailable_reason()
        if reason:
            raise ValueError(reason)


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives every thread that allocates its own arena and keeps the peak of each; a
    serving process with a few busy threads then holds tens of MB more than it uses (a soak
    measured about 21 MB less RSS with 2 arenas, at no CPU cost).  Other libcs: no-op."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass
