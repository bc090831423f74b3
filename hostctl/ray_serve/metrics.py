"""ReplicaMetrics: each replica's engine figures, exported through Ray's metrics (the per-node
Prometheus endpoint a Ray cluster is scraped at), where Ray Serve adds the `deployment`,
`replica` and `application` labels itself.  Ray names them `ray_` + the name given here and
refuses `:` in names (the engine's own endpoint says `ringleader:kv_cache_usage_perc`), so this
one is scraped as `ray_ringleader_kv_cache_usage_perc`.

The gauges are what routers and autoscalers read (the KV pool's use, running and waiting
requests, vLLM's names); the counters follow the engine's own totals.  They are read from the
engine's `stats` reply every poll (ReplicaMetrics.update), never per request.
"""

from __future__ import annotations

from typing import Any

from ray.serve.metrics import Counter, Gauge, Histogram

from ringleader.hostctl.gateway.metrics import GatewayMetrics
from ringleader.ipc.histogram import TTFT_BUCKETS

# the engine's cumulative totals mirrored as counters: (name, description, stats path)
_TOTALS = (
    ("ringleader_prompt_tokens_total", "Prompt tokens the engine prefilled", ("prompt_tokens",)),
    ("ringleader_generation_tokens_total", "Tokens the engine generated", ("output_tokens",)),
    ("ringleader_num_preemptions_total", "Requests that gave their KV pages back", ("device", "preemptions")),
)


def engine_load(stats: dict[str, Any]) -> dict[str, float]:
    """Running, waiting and the KV pool's use from an engine's `stats` reply."""
    device = stats.get("device") or {}
    running = int(device.get("active_slots") or 0)
    in_flight = int(stats.get("in_flight") or 0)
    return {
        "kv_cache_usage_perc": float(device.get("kv_cache_usage_perc") or 0.0),
        "num_requests_running": float(running),
        "num_requests_waiting": float(max(0, in_flight - running)),
    }


class ReplicaMetrics:
    def __init__(self, model_name: str):
        tags = ("model_name",)
        self._tags = {"model_name": model_name}
        self._gauges = {
            "kv_cache_usage_perc": Gauge(
                "ringleader_kv_cache_usage_perc", "Share of the KV page pool requests hold (0..1)", tags
            ),
            "num_requests_running": Gauge(
                "ringleader_num_requests_running", "Requests holding a batch slot", tags
            ),
            "num_requests_waiting": Gauge(
                "ringleader_num_requests_waiting", "Requests accepted, not yet in a slot", tags
            ),
        }
        self._alive = Gauge("ringleader_engine_alive", "1 while the replica's engine serves", tags)
        self._counters = [(Counter(name, doc, tags), path) for name, doc, path in _TOTALS]
        self._last: list[float] = [0.0] * len(_TOTALS)

    def update(self, stats: dict[str, Any] | None) -> None:
        """The engine's figures now; None: it does not answer."""
        self._alive.set(0.0 if stats is None or stats.get("engine_dead") else 1.0, self._tags)
        if stats is None:
            return
        for key, value in engine_load(stats).items():
            self._gauges[key].set(value, self._tags)
        for i, (counter, path) in enumerate(self._counters):
            total = _total(stats, path)
            if total > self._last[i]:  # an engine restarted inside the replica starts again at 0
                counter.inc(total - self._last[i], self._tags)
            self._last[i] = total


def _total(stats: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = stats
    for key in path:
        value = (value or {}).get(key)
    return float(value or 0)


class ReplicaAnswerMetrics(GatewayMetrics):
    """The gateway's per-request observations in a replica (answer.py makes them), also set in
    Ray's metrics: time to first token from the replica's call to the first token's bytes, and
    the engine's errors by code.  Once per request, never per token."""

    def __init__(self, model_name: str):
        super().__init__()
        self._tags = {"model_name": model_name}
        self._ttft = Histogram(
            "ringleader_replica_time_to_first_token_seconds",
            "Streams: from the replica's call to its first token's bytes",
            boundaries=list(TTFT_BUCKETS),
            tag_keys=("model_name",),
        )
        self._errors = Counter(
            "ringleader_upstream_errors_total",
            "Requests the replica's engine ended with an error, by its code",
            tag_keys=("model_name", "code"),  # type: ignore[arg-type]  # Ray annotates a 1-tuple
        )

    def first_token_written(self, seconds: float) -> None:
        super().first_token_written(seconds)
        self._ttft.observe(seconds, self._tags)

    def upstream_error(self, code: str) -> None:
        super().upstream_error(code)
        self._errors.inc(1.0, {**self._tags, "code": code})
