"""The gateway's own Prometheus metrics (served at its GET /metrics): HTTP requests by route and
status, their duration, time to first token as an HTTP client sees it, streams in progress and
clients that went away.  Observed once per request (and per stream's first token), never per
token.  docs/metrics.md lists them."""

from __future__ import annotations

from hostctl.prometheus import load_prometheus_client

# seconds; the upper ones catch long generations
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40)


class GatewayMetrics:
    def __init__(self, *, process: bool = True):
        pc = load_prometheus_client()
        self.registry = pc.CollectorRegistry()
        if process:  # a gateway in the server's process leaves these to the server's endpoint
            pc.ProcessCollector(registry=self.registry)
        r = self.registry
        self.requests = pc.Counter(
            "ringleader:gateway_requests",
            "HTTP requests answered, by route and status code",
            ["route", "status"],
            registry=r,
        )
        self.duration = pc.Histogram(
            "ringleader:gateway_request_duration_seconds",
            "From the request's arrival to its last byte, by route",
            ["route"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.ttft = pc.Histogram(
            "ringleader:gateway_time_to_first_token_seconds",
            "From an HTTP generation request's arrival to its first token's bytes written",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.in_progress = pc.Gauge(
            "ringleader:gateway_requests_in_progress",
            "Generation requests being answered, by route",
            ["route"],
            registry=r,
        )
        self.disconnects = pc.Counter(
            "ringleader:gateway_client_disconnects",
            "Generation requests whose HTTP client went away before the answer ended (each aborted upstream)",
            registry=r,
        )
        self.upstream_errors = pc.Counter(
            "ringleader:gateway_upstream_errors",
            "Generation requests the ringleader server ended with an error, by its code",
            ["code"],
            registry=r,
        )
        self.prompt_tokens = pc.Counter(
            "ringleader:gateway_prompt_tokens", "Prompt tokens of completed requests", registry=r
        )
        self.generation_tokens = pc.Counter(
            "ringleader:gateway_generation_tokens", "Tokens generated for completed requests", registry=r
        )

    def exposition(self) -> tuple[bytes, str]:
        pc = load_prometheus_client()
        return pc.generate_latest(self.registry), pc.CONTENT_TYPE_LATEST
