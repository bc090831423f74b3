"""RayServeArgs: everything one Ray Serve deployment of ringleader takes, in one object that the
CLI (`ringleader ray-serve`), `serve run ringleader.hostctl.ray_serve.app:build_app key=value`
and a Ray Serve config file's `args:` all build, checked here once.  No Ray import: the CLI
checks its options before Ray starts.

The engine's own options are `ringleader serve`'s (hostctl/commands/serve_flags.py), passed
through as a dict keyed by config field (`n_slots`) or by flag (`slots`, `max-ctx`), and each
replica starts its engine with exactly those flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any

from ringleader.hostctl.commands.serve_flags import ENGINE_FLAGS, SERVER_FLAGS, Flag, serve_flags

ROUTINGS = ("prefix", "pow2")
ENGINE_FIELDS: dict[str, Flag] = {**ENGINE_FLAGS, **SERVER_FLAGS}
# the engine's own flags that a replica sets itself: its address is private to the replica
RESERVED_ENGINE_OPTIONS = ("bind", "http", "metrics")


class ArgsError(ValueError):
    """An option with a bad value; the message names it."""


@dataclass(frozen=True)
class RayServeArgs:
    # the engine: `ringleader serve`'s options by config field (model is one of them)
    engine: dict[str, Any] = field(default_factory=dict)
    # replicas: a fixed count, or autoscaling between min and max on ongoing requests
    replicas: int = 1
    min_replicas: int | None = None  # set with max_replicas: autoscaling
    max_replicas: int | None = None
    target_ongoing_requests: float = 32.0  # per engine replica, what the autoscaler aims at
    max_ongoing_requests: int = 256  # per engine replica: beyond, Ray queues the request
    ingress_replicas: int = 1
    routing: str = "prefix"  # prefix: prefix affinity; pow2: power of two choices on queue length
    # resources of each engine replica; None: 1 GPU unless the engine runs on the CPU
    num_gpus: float | None = None
    num_cpus: float = 0.0
    # health: how often Ray asks each replica, and how long an answer may take
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 10.0
    engine_start_timeout_s: float = 600.0  # a big model loads for minutes
    # the OpenAI front, as the gateway takes them
    served_model_name: str | None = None
    api_key: str | None = None
    # attach every replica to an engine already running there (ZeroMQ address) instead of
    # starting one each: to measure the proxy against the gateway on one engine
    engine_address: str | None = None

    def __post_init__(self) -> None:
        bad = [name for name in self.engine if name not in ENGINE_FIELDS]
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
        return serve_flags(**self.engine)

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
    by_flag = {flag.flag[2:]: name for name, flag in ENGINE_FIELDS.items()}
    out: dict[str, Any] = {}
    for key, value in options.items():
        name = key if key in ENGINE_FIELDS else by_flag.get(key.replace("_", "-"))
        if name is None:
            if key.replace("_", "-") in RESERVED_ENGINE_OPTIONS:
                raise ArgsError(f"engine: {key} is set by each replica for its own engine")
            raise ArgsError(f"unknown option {key!r} (neither a ray-serve option nor a serve option)")
        out[name] = _engine_value(name, value)
    return out


def _engine_value(name: str, value: Any) -> Any:
    flag = ENGINE_FIELDS[name]
    options = flag.options
    if value is None:
        return None
    if options.get("action") is argparse.BooleanOptionalAction:
        return _coerce(name, value, "bool")
    kind = options.get("type")
    try:
        if kind is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            value = kind(value)
    except (TypeError, ValueError):
        raise ArgsError(
            f"{flag.flag[2:]}: expected {getattr(kind, '__name__', kind)}, got {value!r}"
        ) from None
    choices = options.get("choices")
    if choices is not None and value not in choices:
        raise ArgsError(f"{flag.flag[2:]}: one of {', '.join(choices)}, got {value!r}")
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
