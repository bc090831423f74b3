"""The Ray Serve application: an OpenAIIngress in front of EngineReplica deployments (one
ringleader engine each), built from one RayServeArgs.

    build_app(args)   what `serve run ringleader.hostctl.ray_serve.app:build_app model=tiny`
                      and a Ray Serve config file's import_path deploy (args: a dict)
    run(args, ...)    what `ringleader ray-serve` does: start or join Ray, deploy, serve until
                      SIGINT/SIGTERM, shut the app down

Why two deployments: Ray's request router picks a replica from a handle call's arguments, and
only the ingress has read the request's body; a handle call carrying the checked request lets
the router keep requests that share a prompt prefix on one engine (prefix_router.py), as Ray
Serve LLM routes its engines.  The ingress is light (parsing, bytes passed through); engines
are the replicas that count, with `num_gpus` each.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any

import ray
from ray import serve

from ringleader.hostctl.ray_serve.args import RayServeArgs
from ringleader.hostctl.ray_serve.ingress import OpenAIIngress
from ringleader.hostctl.ray_serve.replica import EngineReplica

log = logging.getLogger("ringleader.ray_serve")

APP_NAME = "ringleader"
PREFIX_ROUTER = "ringleader.hostctl.ray_serve.prefix_router.PrefixAffinityRouter"
ROUTING_STATS_PERIOD_S = 2.0


def engine_gpus(args: RayServeArgs) -> float:
    """GPUs per engine replica: as asked, else none for a CPU engine, one for a CUDA engine, and
    for `auto` one when the Ray cluster has GPUs."""
    if args.num_gpus is not None:
        return args.num_gpus
    device = args.engine_device()
    if device == "cpu":
        return 0.0
    if device == "cuda":
        return 1.0
    return 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def engine_deployment_options(args: RayServeArgs) -> dict[str, Any]:
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": args.num_cpus, "num_gpus": engine_gpus(args)},
        "max_ongoing_requests": args.max_ongoing_requests,
        "health_check_period_s": args.health_check_period_s,
        "health_check_timeout_s": args.health_check_timeout_s,
        # a replica's in-flight streams drain with its engine (serve's --drain-timeout)
        "graceful_shutdown_timeout_s": 30.0,
    }
    if args.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": args.min_replicas,
            "max_replicas": args.max_replicas,
            "target_ongoing_requests": args.target_ongoing_requests,
        }
    else:
        options["num_replicas"] = args.replicas
    # pow2 is the same router without affinity: it still steers a retry away from a refuser
    options["request_router_config"] = {
        "request_router_class": PREFIX_ROUTER,
        "request_router_kwargs": {"affinity": args.routing == "prefix"},
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
    }
    return options


def build_app(args: RayServeArgs | dict[str, Any]) -> serve.Application:
    """The application: `serve run` and config files pass a dict (RayServeArgs.from_dict)."""
    if not isinstance(args, RayServeArgs):
        args = RayServeArgs.from_dict(dict(args))
    engine = serve.deployment(name="EngineReplica", **engine_deployment_options(args))(EngineReplica)
    ingress = serve.deployment(
        name="OpenAIIngress",
        num_replicas=args.ingress_replicas,
        max_ongoing_requests=max(1024, args.max_ongoing_requests * 4),
        ray_actor_options={"num_cpus": 0},
    )(OpenAIIngress)
    return ingress.bind(engine.bind(args), args)


def run(args: RayServeArgs, *, host: str, port: int, address: str | None, name: str = APP_NAME) -> int:
    """`ringleader ray-serve`: deploy on the Ray cluster at `address` (None: a local one started
    here), with Ray Serve's HTTP proxy at host:port; serve until SIGINT/SIGTERM."""
    ray.init(address=address, log_to_driver=True)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(args), name=name, route_prefix="/")
        url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        print(
            f"ringleader: Ray Serve app {name!r} at {url}/v1 for {args.model!r} "
            f"({_replicas_line(args)}, routing {args.routing})",
            file=sys.stderr,
            flush=True,
        )
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        print("ringleader: stopping the Ray Serve app", file=sys.stderr, flush=True)
        serve.delete(name)
    finally:
        if address is None:  # the cluster was started here: it ends here
            serve.shutdown()
            ray.shutdown()
    return 0


def _replicas_line(args: RayServeArgs) -> str:
    if args.autoscaling:
        return f"{args.min_replicas}..{args.max_replicas} engine replicas, autoscaling"
    return f"{args.replicas} engine replica{'s' if args.replicas != 1 else ''}"
