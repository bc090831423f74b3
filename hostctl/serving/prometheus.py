"""Prometheus metrics of a Server over HTTP: `ringleader serve --metrics HOST:PORT`.

    exporter = MetricsExporter(server, "127.0.0.1", 9400).start()   # before serve_forever()
    server.serve_forever()
    exporter.close()

The exporter has a CollectorRegistry of its own (never prometheus_client's global one) holding
the process, platform and GC collectors and one ServerCollector, whose collect() reads one
Server.snapshot() (hostctl/serving/snapshot.py) when Prometheus scrapes: ServerMetrics' counters
and latency histograms (from one consistent snapshot), the request table and host queue, the
control block's counters and the backend's step histograms.  Nothing here runs per token or per
step: the hot paths fill hostctl/serving/metrics.py's plain histograms, and MetricFamilies turns
them into metric families at scrape time (the gateway's exporter, hostctl/gateway/metrics.py,
builds its families the same way).  A scrape works before the backend has started (the control block is zero) and
after it has stopped (counters keep their last values).  docs/metrics.md lists every series.

The same registry (engine_registry) also serves at the OpenAI gateway's GET /metrics under `serve
--http`, after the gateway's own series, with one ServerCollector shared by both endpoints (its
lock serialises their scrapes); when --http and --metrics name one address, the gateway's port
is the only endpoint.

The HTTP server runs on daemon threads (`rl-metrics`, and one per scrape) and serves
/metrics only.  prometheus_client is imported when an exporter is made, so importing this
module (or ringleader.hostctl.serving.server) does not need it.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from collections.abc import Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ringleader.hostctl.serving.snapshot import ServerSnapshot
from ringleader.ipc import counters, protocol
from ringleader.ipc.install_hint import install_hint

log = logging.getLogger("ringleader.metrics")

PREFIX = "ringleader:"
INSTALL_HINT = install_hint("http")
# label values present from the first scrape (at 0), so rate() and dashboards see every series
FINISH_REASONS = (protocol.FINISH_STOP, protocol.FINISH_LENGTH, protocol.FINISH_ABORT, protocol.FINISH_ERROR)
ERROR_CODES = (protocol.ERR_ENGINE_DEAD, protocol.ERR_SHUTDOWN, protocol.ERR_TIMEOUT)
REJECT_CODES = (
    protocol.ERR_BAD_REQUEST,
    protocol.ERR_OVERLOADED,
    protocol.ERR_DUPLICATE_ID,
    protocol.ERR_SHUTDOWN,
    protocol.ERR_ENGINE_DEAD,
)


def load_prometheus_client() -> Any:
    """prometheus_client, imported on first use; an ImportError that says what to install."""
    try:
        import prometheus_client
        import prometheus_client.core
        import prometheus_client.utils
    except ImportError as exc:
        raise ImportError(f"the metrics endpoint needs prometheus_client: {INSTALL_HINT}") from exc
    return prometheus_client


# The server's and the gateway's idiom: plain figures become families at scrape time, off every request's path
class MetricFamilies:
    """The metric families of one scrape, built from plain figures: each name gets PREFIX, each
    series the constant labels given (the server's model_name; none for the gateway).  A labelled
    family takes {label values (a tuple, or one str): value}."""

    def __init__(self, prom: Any, **constant_labels: str):
        self._prom = prom
        self._names = list(constant_labels)
        self._values = list(constant_labels.values())
        self.families: list = []

    def gauge(self, name: str, doc: str, value: Any, labels: Sequence[str] = ()) -> None:
        self._add(self._prom.core.GaugeMetricFamily, name, doc, value, labels)

    def counter(self, name: str, doc: str, value: Any, labels: Sequence[str] = ()) -> None:
        self._add(self._prom.core.CounterMetricFamily, name, doc, value, labels)

    def histogram(self, name: str, doc: str, value: Any, labels: Sequence[str] = ()) -> None:
        """value: a HistogramSnapshot, or {label values: HistogramSnapshot} with labels."""
        family = self._prom.core.HistogramMetricFamily(PREFIX + name, doc, labels=[*self._names, *labels])
        for key, snap in value.items() if labels else [((), value)]:
            buckets = [(self._prom.utils.floatToGoString(le), n) for le, n in snap.cumulative()]
            family.add_metric([*self._values, *_label_values(key)], buckets, snap.sum)
        self.families.append(family)

    def _add(self, kind: Any, name: str, doc: str, value: Any, labels: Sequence[str]) -> None:
        family = kind(PREFIX + name, doc, labels=[*self._names, *labels])
        for key, v in value.items() if labels else [((), value)]:
            family.add_metric([*self._values, *_label_values(key)], v)
        self.families.append(family)


def _label_values(key: str | tuple[str, ...]) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else key


class ServerCollector:
    """A prometheus_client collector: every `ringleader:` series of one Server, from one
    Server.snapshot() per scrape.  Scrapes are serialised (one lock), which also serialises the
    backend's incremental timeline feed."""

    def __init__(self, server):
        self._prom = load_prometheus_client()
        self._server = server
        self._lock = threading.Lock()
        self._thread_cpu: dict[str, float] = {}  # under _lock: the last reading of each thread

    def collect(self) -> list:
        with self._lock:
            snap = self._server.snapshot()
            # a thread that has ended keeps its last reading
            for name, seconds in snap.thread_cpu_s.items():
                self._thread_cpu[name] = max(seconds, self._thread_cpu.get(name, 0.0))
            return self._families(snap)

    def _families(self, s: ServerSnapshot) -> list:
        out = MetricFamilies(self._prom, model_name=s.model_name)

        # requests
        out.gauge("num_requests_running", "Requests holding a batch slot on the device.", s.running)
        out.gauge(
            "num_requests_waiting",
            "Accepted requests not in a slot: host queue + SQ not yet drained + device pending queue.",
            s.waiting,
        )
        out.gauge(
            "batch_slots",
            "Batch slots on the device (each holds one request; its KV cache is in pages from the pool).",
            s.batch_slots,
        )
        out.gauge("num_requests_in_flight", "Accepted requests whose done has not been sent.", s.in_flight)
        out.counter("requests_accepted", "Generate requests accepted (each gets one done).", s.accepted)
        out.counter(
            "prompt_tokens",
            "Prompt tokens of requests whose prefill finished (counted at their first token).",
            s.prompt_tokens,
        )
        out.counter("generation_tokens", "Output tokens sent to clients.", s.generation_tokens)
        out.counter(
            "request_success",
            "Accepted requests ended, by finish reason (every accepted request's one done).",
            {**dict.fromkeys(FINISH_REASONS, 0), **s.finished},
            labels=["finished_reason"],
        )
        out.counter(
            "request_errors",
            "Accepted requests ended with an error, by error code.",
            {**dict.fromkeys(ERROR_CODES, 0), **s.errors},
            labels=["code"],
        )
        out.counter(
            "requests_rejected",
            "Generate requests never accepted, by error code.",
            {**dict.fromkeys(REJECT_CODES, 0), **s.rejected},
            labels=["code"],
        )
        out.counter(
            "bad_frames", "Frames that were not a request at all (answered with an error).", s.bad_frames
        )

        # request latencies and sizes
        hist = s.latencies
        out.histogram(
            "time_to_first_token_seconds", "Arrival at the server to the first token frame.", hist["ttft_s"]
        )
        out.histogram(
            "inter_token_latency_seconds",
            "Gap between a request's token frames, shared evenly by the tokens of the later frame.",
            hist["inter_token_s"],
        )
        out.histogram(
            "request_time_per_output_token_seconds",
            "Per request with >= 2 tokens: (last token - first token) / (tokens - 1).",
            hist["time_per_output_token_s"],
        )
        out.histogram("e2e_request_latency_seconds", "Arrival to done.", hist["e2e_s"])
        out.histogram(
            "request_queue_time_seconds",
            "Waiting on the host for ring space + on the device for a slot (the done's queue_ms).",
            hist["queue_s"],
        )
        out.histogram(
            "request_prompt_tokens", "Prompt tokens per ended request.", hist["request_prompt_tokens"]
        )
        out.histogram(
            "request_generation_tokens", "Output tokens per ended request.", hist["request_generation_tokens"]
        )

        # the host's CPU, per thread
        out.counter(
            "host_cpu_seconds",
            "CPU seconds of the host's own threads (the whole process: process_cpu_seconds_total).",
            dict(self._thread_cpu),
            labels=["thread"],
        )

        # the scheduler's steps
        steps = s.step_histograms
        phases = {
            phase: steps[key]
            for phase, key in (("critical", "sched_critical_s"), ("overlapped", "sched_overlapped_s"))
            if key in steps
        }
        if phases:
            out.histogram(
                "scheduler_step_seconds",
                "The scheduler's phases per built step (host timer on the CPU, device timeline on CUDA).",
                phases,
                labels=["phase"],
            )
        if "bubble_s" in steps:
            out.histogram(
                "step_bubble_seconds",
                "GPU idle between two chained steps (device timeline; absent on the CPU backend).",
                steps["bubble_s"],
            )
        if "tokens_per_step" in steps:
            out.histogram("tokens_per_step", "Rows computed per step.", steps["tokens_per_step"])
        # the control block's counters that have a series, as ipc/counters.py declares them
        for counter, series in counters.EXPORTED:
            family = out.counter if series.type == "counter" else out.gauge
            family(series.name, series.help, s.device_counters[counter.name])
        # the KV page pool, as vllm names it (routers such as llm-d read kv_cache_usage_perc)
        out.gauge(
            "kv_cache_usage_perc",
            "Share of the KV cache's pages held by requests (0 to 1).",
            s.kv_cache_usage,
        )
        out.gauge("kv_cache_pages", "KV pages in the pool.", s.kv_pages)

        # what runs, and whether it lives
        d = s.description
        out.gauge(
            "launch_mode_info",
            "Where the scheduler runs and how steps are launched (value 1).",
            {(*(str(d.get(k, "")) for k in ("device", "scheduler", "launch", "dtype")), s.model_name): 1},
            labels=["device", "scheduler", "launch", "dtype", "model"],
        )
        out.gauge(
            "engine_dead",
            "1 once the engine is declared dead (every request then ends).",
            s.engine_dead is not None,
        )
        return out.families


def engine_registry(collector: ServerCollector, *, process: bool = True) -> Any:
    """A CollectorRegistry of its own holding what a server's endpoint exports: the process
    (unless another registry of the same endpoint has it), platform and GC collectors and
    `collector`, the server's series."""
    prom = load_prometheus_client()
    registry = prom.CollectorRegistry(auto_describe=False)
    if process:
        prom.ProcessCollector(registry=registry)
    prom.PlatformCollector(registry=registry)
    prom.GCCollector(registry=registry)
    registry.register(collector)
    return registry


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not worth a log line
        pass


def _http_server_class(family: socket.AddressFamily) -> type[WSGIServer]:
    class MetricsHTTPServer(socketserver.ThreadingMixIn, WSGIServer):
        address_family = family
        daemon_threads = True

        def server_bind(self) -> None:
            # HTTPServer.server_bind looks up the host's FQDN (DNS, possibly slow); not needed
            socketserver.TCPServer.server_bind(self)
            _adopt_bound_socket(self)

    return MetricsHTTPServer


def _adopt_bound_socket(httpd: WSGIServer) -> None:
    """What server_bind sets up, for a socket bound before (or by) the server."""
    httpd.server_address = httpd.socket.getsockname()
    host, port = httpd.server_address[:2]
    httpd.server_name, httpd.server_port = str(host), int(port)
    httpd.setup_environ()


class MetricsExporter:
    """Serves GET /metrics for `server` on host:port (port 0: a free one) from a daemon thread.

    start() binds (OSError if it cannot) and returns self; url is valid after it; close() stops
    serving and is safe to call twice or without start().  Constructing one raises ImportError
    naming the install command when prometheus_client is missing."""

    def __init__(
        self,
        server,
        host: str = "127.0.0.1",
        port: int = 9400,
        *,
        sock: socket.socket | None = None,
        collector: ServerCollector | None = None,
    ):
        """sock: a listening socket bound already (serve binds it before the model loads);
        host and port are then read from it.  collector: the server's, when another endpoint
        (the gateway's /metrics) shares it."""
        prom = load_prometheus_client()
        self.server = server
        self._sock = sock
        if sock is not None:
            host, port = sock.getsockname()[:2]
        self.host = host
        self.port = port  # the bound port once started
        self.collector = collector if collector is not None else ServerCollector(server)
        self.registry = engine_registry(self.collector)
        self._metrics_app = prom.make_wsgi_app(self.registry)
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsExporter:
        if self._httpd is not None:
            raise RuntimeError("the metrics exporter is already started")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        if self._sock is None:
            httpd = make_server(
                self.host, self.port, self._app, _http_server_class(family), handler_class=_QuietHandler
            )
        else:
            httpd = _http_server_class(family)((self.host, self.port), _QuietHandler, bind_and_activate=False)
            httpd.socket.close()
            httpd.socket = self._sock  # bound and listening already
            _adopt_bound_socket(httpd)
            httpd.set_app(self._app)
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, name="rl-metrics", daemon=True)
        self._thread.start()
        log.info("metrics on %s", self.url)
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()  # returns once serve_forever has
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> MetricsExporter:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _app(self, environ, start_response):
        if environ.get("PATH_INFO", "").rstrip("/") == "/metrics":
            return self._metrics_app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: the metrics are at /metrics\n"]
