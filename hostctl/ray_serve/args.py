"""RayServeArgs: everything one Ray Serve deployment of ringleader takes, in one object that the
CLI (`ringleader ray-serve`), `serve run ringleader.hostctl.ray_serve.app:build_app key=value`
and a Ray Serve config file's `args:` all build, checked here once.  No Ray import: the CLI
checks its options before Ray starts.  Its own fields declare their `ray-serve` flags (option(),
ringleader.ipc.config_options).

The engine's own options are `ringleader serve`'s, the option() fields of EngineConfig and
ServerConfig, passed through as a dict keyed by config field (`n_slots`) or by flag (`slots`,
`max-ctx`), and each replica starts its engine with exactly those flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ringleader.device.engine_config import EngineConfig
from ringleader.hostctl.serving.config import ServerConfig
from ringleader.ipc.config_options import ConfigOption, command_line, option, options_by_name

ROUTINGS = ("prefix", "pow2")
# `ringleader serve`'s options by config field: what a replica's engine may be given
SERVE_OPTIONS: dict[str, ConfigOption] = options_by_name(EngineConfig, ServerConfig)
# the engine's own flags that a replica sets itself: its address is private to the replica
RESERVED_ENGINE_OPTIONS = ("bind", "http", "metrics")


class ArgsError(ValueError):
    """An option with a bad value; the message names it."""


# The fields with option() are `ringleader ray-serve`'s own options, in the order --help lists them.
# fmt: off
@dataclass(frozen=True)
class RayServeArgs:
    # the engine: `ringleader serve`'s options by config field (model is one of them)
    engine: dict[str, Any] = field(default_factory=dict)
    # replicas: a fixed count, or autoscaling between min and max on ongoing requests
    replicas: int = option(
        1, flag="--replicas", type=int,
        help="engine replicas (one engine, and on GPU nodes one GPU, each)")
    min_replicas: int | None = option(  # set with max_replicas: autoscaling
        None, flag="--min-replicas", type=int, help="with --max-replicas: autoscale between the two")
    max_replicas: int | None = option(
        None, flag="--max-replicas", type=int, help="with --min-replicas: autoscale between the two")
    target_ongoing_requests: float = option(
        32.0, flag="--target-ongoing-requests", type=float,
        help="autoscaling: requests per engine replica the autoscaler aims at")
    max_ongoing_requests: int = option(
        256, flag="--max-ongoing-requests", type=int,
        help="requests one engine replica takes at once; beyond, Ray's proxy queues them")
    ingress_replicas: int = option(
        1, flag="--ingress-replicas", type=int, help="replicas of the HTTP ingress")
    routing: str = option(
        "prefix", flag="--routing", choices=ROUTINGS,
        help="prefix: requests sharing a prompt prefix prefer the replica that holds it (its "
        "prefix cache), unless it is busier; pow2: power of two choices on queue length (as Ray's "
        "default router); either way a request sent again avoids the replicas that refused it")
    # resources of each engine replica; None: 1 GPU unless the engine runs on the CPU
    num_gpus: float | None = option(
        None, flag="--num-gpus", type=float,
        help="GPUs per engine replica (default: 1 unless --device cpu)")
    num_cpus: float = option(
        0.0, flag="--num-cpus", type=float, help="Ray CPUs reserved per engine replica")
    # health: how often Ray asks each replica, and how long an answer may take
    health_check_period_s: float = option(
        2.0, flag="--health-check-period", type=float,
        help="seconds between Ray's health checks of a replica (a replica whose engine died is "
        "replaced)")
    health_check_timeout_s: float = option(
        10.0, flag="--health-check-timeout", type=float, help="seconds a health check may take")
    engine_start_timeout_s: float = option(  # a big model loads for minutes
        600.0, flag="--engine-start-timeout", type=float,
        help="seconds a replica's engine may take to load its model")
    # the OpenAI front, as the gateway takes them (their flags: the gateway's, add_http_options)
    served_model_name: str | None = None
    api_key: str | None = None
    engine_address: str | None = option(
        None, flag="--engine-address",
        help="attach every replica to this running engine (ZeroMQ address) instead of starting "
        "one each (to measure the proxy against the gateway on one engine)")
    # fmt: on

    def __post_init__(self) -> None:
        bad = [name for name in self.engine if name not in SERVE_OPTIONS]
        if bad:
            raise ArgsError(f"engine: unknown option(s) {', '.join(sorted(bad))}")
        for name in ("replicas", "ingress_replicas", "max_ongoing_requests"):
            if getattr(self, name) < 1:
                raise ArgsError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ArgsError("min_replicas and max_replicas: give both (autoscaling) or neither")
        low, high = self.min_replicas, self.max_replicas
        if high is not None and low is not None and not (0 <= low <= high and high >= 1):
            raise ArgsError(
                f"min_replicas/max_replicas: need 0 <= min <= max and max >= 1, got "
                f"{self.min_replicas}/{self.max_replicas}"
            )
        if self.routing not in ROUTINGS:
            raise ArgsError(f"routing: one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        for name in ("target_ongoing_requests", "health_check_period_s", "health_check_timeout_s"):
            if not getattr(self, name) > 0:
                raise ArgsError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.num_cpus < 0 or (self.num_gpus is not None and self.num_gpus < 0):
            raise ArgsError("num_cpus/num_gpus: must not be negative")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def model(self) -> str:
        return str(self.engine.get("model") or "tiny")

    def engine_device(self) -> str:
        return str(self.engine.get("device") or "auto")

    def engine_argv(self) -> list[str]:
        """`ringleader serve` flags of the engine options (the replica adds --bind)."""
        return command_line(SERVE_OPTIONS, self.engine)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RayServeArgs:
        """From a config file's `args:` or `serve run`'s key=value pairs (strings then): names as
        the fields are named; `engine` a mapping of serve options by field or flag name, and any
        other serve option given at the top level joins it."""
        known = {f.name: f for f in fields(cls)}
        own: dict[str, Any] = {}
        engine = dict(_engine_options(values.get("engine") or {}))
        for key, value in values.items():
            name = key.replace("-", "_")
            if name == "engine":
                continue
            if name in known:
                own[name] = _coerce(name, value, known[name].type)
            else:
                engine.update(_engine_options({key: value}))
        return cls(engine=engine, **own)


def _engine_options(options: Any) -> dict[str, Any]:
    """Serve options keyed by field or flag name, their values coerced as the flag parses them."""
    if not isinstance(options, dict):
        raise ArgsError(f"engine: expected a mapping of serve options, got {options!r}")
    by_flag = {declared.flag.removeprefix("--"): name for name, declared in SERVE_OPTIONS.items()}
    out: dict[str, Any] = {}
    for key, value in options.items():
        name = key if key in SERVE_OPTIONS else by_flag.get(key.replace("_", "-"))
        if name is None:
            if key.replace("_", "-") in RESERVED_ENGINE_OPTIONS:
                raise ArgsError(f"engine: {key} is set by each replica for its own engine")
            raise ArgsError(f"unknown option {key!r} (neither a ray-serve option nor a serve option)")
        out[name] = _engine_value(name, value)
    return out


def _engine_value(name: str, value: Any) -> Any:
    declared = SERVE_OPTIONS[name]
    shown = declared.flag.removeprefix("--")
    if value is None:
        return None
    if declared.is_switch:
        return _coerce(name, value, "bool")
    kind = declared.type
    try:
        if isinstance(kind, type) and (isinstance(value, bool) or not isinstance(value, kind)):
            value = kind(value)
    except (TypeError, ValueError):
        raise ArgsError(f"{shown}: expected {getattr(kind, '__name__', kind)}, got {value!r}") from None
    if declared.choices is not None and value not in declared.choices:
        raise ArgsError(f"{shown}: one of {', '.join(declared.choices)}, got {value!r}")
    return value


def _coerce(name: str, value: Any, kind: Any) -> Any:
    """`serve run` hands every value as a string; a config file as YAML typed it."""
    text = str(kind)
    if value is None or not isinstance(value, str):
        return value
    try:
        if "bool" in text:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if "int" in text:
            return int(value)
        if "float" in text:
            return float(value)
    except ValueError:
        raise ArgsError(f"{name}: cannot read {value!r} as {text}") from None
    return value
