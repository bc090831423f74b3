"""The HTTP fronts of `serve`: the OpenAI gateway (`--http`) and the Prometheus endpoint
(`--metrics`).  Their addresses are parsed, their packages imported and their ports bound before
the model loads, so a typo, a missing package or a busy port fails in a second.  The gateway
serves its port from then on, in its loading state: every route answers at once (/health 503
`{"status": "loading", ...}`, the others 503 "the model is loading"), as llama-server does,
rather than leaving connections unanswered for the length of the load; it is ready, and the
metrics endpoint starts, once the server is built.  The gateway's /metrics carries the engine's
series after its own, and when --http and --metrics name one address the gateway's port is the
one endpoint for both.  aiohttp and prometheus_client are imported only when asked for: a plain
install serves without them."""

from __future__ import annotations

import errno
import logging
import socket
import sys
from typing import Any

log = logging.getLogger("ringleader.gateway")


def parse_listen(text: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host or int(port) > 65535:
        raise ValueError(
            f"expected HOST:PORT, got {text!r} (e.g. 127.0.0.1:8000; 0.0.0.0:8000 for every interface)"
        )
    return host.strip("[]"), int(port)


def bind_listen(flag: str, text: str) -> socket.socket:
    """A TCP socket bound and listening at `text` (HOST:PORT); errors name the flag."""
    try:
        host, port = parse_listen(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=512)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = "the port is in use (another server there?); choose another port"
        elif isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            why = "no interface of this machine has that address"
        else:
            why = exc.strerror or str(exc)
        raise OSError(exc.errno, f"{flag} {text}: cannot bind: {why}") from None


def same_address(first: str, second: str) -> bool:
    """Two HOST:PORT texts that name one listening address (port 0 names a new one each time)."""
    try:
        a, b = parse_listen(first), parse_listen(second)
    except ValueError:
        return False
    return a == b and a[1] != 0


class HttpFronts:
    """Built before the model loads (checks, imports, binds, and the gateway answering 503
    "loading"); start() once the server exists; close() stops what started and releases what
    was bound, safe to call twice."""

    def __init__(self, http: str | None, metrics: str | None, *, curve: bool = False):
        if http and curve:
            raise ValueError("--http with CURVE keys: run `ringleader gateway` with a client's keys instead")
        if metrics:
            from ringleader.hostctl.serving.prometheus import load_prometheus_client

            load_prometheus_client()  # ImportError naming what to install
        if http:
            import ringleader.hostctl.gateway.app  # noqa: F401  (ImportError naming what to install)
        self._sockets: dict[str, socket.socket] = {}
        self._closers: list[Any] = []
        self._gateway: Any = None  # a BackgroundGateway, loading until start()
        self._shared = bool(http and metrics and same_address(http, metrics))  # one port for both
        try:
            if metrics and not self._shared:
                self._sockets["metrics"] = bind_listen("--metrics", metrics)
            if http:
                self._serve_loading(bind_listen("--http", http))
        except BaseException:
            self.close()
            raise

    def _serve_loading(self, sock: socket.socket) -> None:
        from ringleader.hostctl.gateway.app import BackgroundGateway

        try:
            gateway = BackgroundGateway(sock=sock, loading=True).start()
        except BaseException:
            sock.close()
            raise
        self._gateway = gateway
        self._closers.append(gateway.stop)
        log.info("the HTTP API's port %s answers 503 (loading) until the model is loaded", gateway.url)

    def start(self, server, *, served_model_name: str | None, api_key: str | None) -> None:
        """Serves metrics for `server` and makes the gateway in front of it ready; prints where."""
        if not self._sockets and self._gateway is None:
            return
        from ringleader.hostctl.serving.prometheus import MetricsExporter, ServerCollector, engine_registry

        collector = ServerCollector(server)  # one for every endpoint: its lock serialises their scrapes
        sock = self._sockets.pop("metrics", None)
        if sock is not None:
            exporter = MetricsExporter(server, sock=sock, collector=collector).start()
            self._closers.append(exporter.close)
            print(f"ringleader: metrics at {exporter.url}", file=sys.stderr, flush=True)
        gateway = self._gateway
        if gateway is not None:
            model = server.backend.model
            gateway.ready(
                upstream=server.address,
                served_model_name=served_model_name or model.name,
                max_model_len=model.max_context,
                has_tokenizer=model.tokenizer is not None,
                vocab_size=model.vocab_size,
                max_tokens_cap=server.limits.max_tokens_cap,
                api_key=api_key,
                # the engine's series after the gateway's own, which export the process already
                engine_registry=engine_registry(collector, process=False),
            )
            print(f"ringleader: openai gateway at {gateway.url}", file=sys.stderr, flush=True)
            if self._shared:
                print(f"ringleader: metrics at {gateway.url}/metrics", file=sys.stderr, flush=True)

    def close(self) -> None:
        for close in reversed(self._closers):
            close()
        self._closers.clear()
        self._gateway = None
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
