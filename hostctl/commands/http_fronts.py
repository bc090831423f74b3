"""The HTTP fronts of `serve`: the OpenAI gateway (`--http`) and the Prometheus endpoint
(`--metrics`).  Their addresses are parsed, their packages imported and their ports bound before
the model loads, so a typo, a missing package or a busy port fails in a second; they start
serving once the server is built.  aiohttp and prometheus_client are imported only when asked
for: a plain install serves without them."""

from __future__ import annotations

import errno
import socket
import sys
from typing import Any


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


class HttpFronts:
    """Built before the model loads (checks, imports, binds); start() once the server exists;
    close() stops what started and releases what was bound, safe to call twice."""

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
        try:
            if metrics:
                self._sockets["metrics"] = bind_listen("--metrics", metrics)
            if http:
                self._sockets["http"] = bind_listen("--http", http)
        except BaseException:
            self.close()
            raise

    def start(self, server, *, served_model_name: str | None, api_key: str | None) -> None:
        """Serves metrics for `server` and the gateway in front of it; prints where."""
        sock = self._sockets.pop("metrics", None)
        if sock is not None:
            from ringleader.hostctl.serving.prometheus import MetricsExporter

            exporter = MetricsExporter(server, sock=sock).start()
            self._closers.append(exporter.close)
            print(f"ringleader: metrics at {exporter.url}", file=sys.stderr, flush=True)
        sock = self._sockets.pop("http", None)
        if sock is not None:
            from ringleader.hostctl.gateway.app import BackgroundGateway

            model = server.backend.model
            gateway = BackgroundGateway(
                server.address,
                sock=sock,
                served_model_name=served_model_name or model.name,
                max_model_len=model.max_context,
                has_tokenizer=model.tokenizer is not None,
                api_key=api_key,
                process_metrics=not self._closers,  # a metrics endpoint exports the process already
            ).start()
            self._closers.append(gateway.stop)
            print(f"ringleader: openai gateway at {gateway.url}", file=sys.stderr, flush=True)

    def close(self) -> None:
        for close in reversed(self._closers):
            close()
        self._closers.clear()
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
