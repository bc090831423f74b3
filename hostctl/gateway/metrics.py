"""The gateway's own Prometheus metrics (served at its GET /metrics): HTTP requests by route and
status, their duration, time to first token as an HTTP client sees it, streams in progress and
clients that went away.  Observed once per request (and per stream's first token), never per
token.  docs/metrics.md lists them.

The server's idiom (hostctl/serving/prometheus.py): GatewayMetrics keeps plain counts and
ringleader.ipc.histogram histograms, and GatewayCollector turns them into metric families when
Prometheus scrapes.  Both run on the gateway's event loop, so neither needs a lock."""

from __future__ import annotations

from typing import Any

from ringleader.hostctl.serving.prometheus import MetricFamilies, load_prometheus_client
from ringleader.ipc.histogram import TTFT_BUCKETS, Histogram

# seconds; the upper ones catch long generations
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class GatewayMetrics:
    """What the gateway counts, one method per event.  A labelled series appears once it is
    first counted; the routes are the registered ones and `unmatched` (app.route_label)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}  # (route, status) -> HTTP requests answered
        self.in_progress: dict[str, int] = {}  # route -> generation requests being answered
        self.duration: dict[str, Histogram] = {}  # route -> seconds from arrival to the last byte
        self.ttft = Histogram(TTFT_BUCKETS)  # streams: arrival -> the first token's bytes written
        self.disconnects = 0  # generation requests whose HTTP client went away
        self.upstream_errors: dict[str, int] = {}  # code -> generation requests the server ended in error
        self.prompt_tokens = 0  # the usage of completed answers
        self.generation_tokens = 0

    def answered(self, route: str, status: int) -> None:
        key = (route, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1

    def generation_started(self, route: str) -> None:
        self.in_progress[route] = self.in_progress.get(route, 0) + 1

    def generation_ended(self, route: str, seconds: float) -> None:
        self.in_progress[route] -= 1
        if route not in self.duration:
            self.duration[route] = Histogram(DURATION_BUCKETS)
        self.duration[route].observe(seconds)

    def first_token_written(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def client_disconnected(self) -> None:
        self.disconnects += 1

    def upstream_error(self, code: str) -> None:
        self.upstream_errors[code] = self.upstream_errors.get(code, 0) + 1

    def usage(self, prompt_tokens: int, generation_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens


class GatewayCollector:
    """A prometheus_client collector of GatewayMetrics, in a registry of its own (with the
    process collector unless the server's endpoint exports the process already); exposition()
    is what GET /metrics answers."""

    def __init__(self, metrics: GatewayMetrics, *, process: bool = True):
        self._prom = load_prometheus_client()
        self._metrics = metrics
        self.registry = self._prom.CollectorRegistry(auto_describe=False)
        if process:
            self._prom.ProcessCollector(registry=self.registry)
        self.registry.register(self)

    def collect(self) -> list:
        m = self._metrics
        out = MetricFamilies(self._prom)
        out.counter(
            "gateway_requests",
            "HTTP requests answered, by route and status code",
            dict(m.requests),
            labels=["route", "status"],
        )
        out.histogram(
            "gateway_request_duration_seconds",
            "From the request's arrival to its last byte, by route",
            {route: h.snapshot() for route, h in m.duration.items()},
            labels=["route"],
        )
        out.histogram(
            "gateway_time_to_first_token_seconds",
            "From an HTTP generation request's arrival to its first token's bytes written",
            m.ttft.snapshot(),
        )
        out.gauge(
            "gateway_requests_in_progress",
            "Generation requests being answered, by route",
            dict(m.in_progress),
            labels=["route"],
        )
        out.counter(
            "gateway_client_disconnects",
            "Generation requests whose HTTP client went away before the answer ended (each aborted upstream)",
            m.disconnects,
        )
        out.counter(
            "gateway_upstream_errors",
            "Generation requests the ringleader server ended with an error, by its code",
            dict(m.upstream_errors),
            labels=["code"],
        )
        out.counter("gateway_prompt_tokens", "Prompt tokens of completed requests", m.prompt_tokens)
        out.counter(
            "gateway_generation_tokens", "Tokens generated for completed requests", m.generation_tokens
        )
        return out.families

    def exposition(self) -> tuple[bytes, Any]:
        """(body, content type) of GET /metrics."""
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST

    def exposition_of(self, registry: Any) -> bytes:
        """Another registry's series in the same format (under `serve --http`, the engine's,
        which GET /metrics serves after the gateway's own)."""
        return self._prom.generate_latest(registry)
