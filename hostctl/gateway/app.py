"""The OpenAI-compatible HTTP gateway: aiohttp in front of a ringleader server, reached over the
product's own protocol through AsyncClient.

Why aiohttp: one well-kept library gives the server and the HTTP client the benchmark drives
other servers with; its StreamResponse writes each SSE event with backpressure; and with
handler cancellation a client that disconnects cancels its handler, which closes the upstream
stream and so aborts the request on the server (its slot goes to someone else within a step).
No ASGI layer or model classes sit between a token frame and its bytes: a token costs one
json.dumps of its text (responses.ResponseWriter).  A request is checked here
(openai_api.parse_request, the model, the key) and answered by answer.py.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE when `stream`), GET /v1/models,
GET /health (the upstream answers and its engine lives), GET /metrics (the gateway's own).
Every failure is an OpenAI-shaped error: 400 naming the field, 401, 404 for another model, 429
for `overloaded`, 503 for `engine_dead`/`shutdown`/no upstream, 504 for `timeout`; after a
stream has started, an error is one `data: {"error": ...}` event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

try:
    from aiohttp import web
except ImportError:
    from ringleader.hostctl.serving.prometheus import INSTALL_HINT

    raise ImportError(f"the HTTP gateway needs aiohttp: {INSTALL_HINT}") from None

from ringleader.hostctl.gateway.answer import SSE_HEADERS, answer_request
from ringleader.hostctl.gateway.metrics import GatewayCollector, GatewayMetrics
from ringleader.hostctl.gateway.openai_api import (
    APIError,
    ServedModel,
    authorize,
    check_request,
    models_list,
)
from ringleader.ipc.client import AsyncClient
from ringleader.ipc.client.core import DEFAULT_ADDRESS
from ringleader.ipc.curve import ClientCurve

log = logging.getLogger("ringleader.gateway")

MAX_BODY_BYTES = 8 << 20
UNMATCHED_ROUTE = "unmatched"  # the `route` label of every request no route took (404, 405)


@dataclass
class GatewayConfig:
    upstream: str = DEFAULT_ADDRESS
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the name the upstream server reports
    api_key: str | None = None  # when set, generation routes need "Authorization: Bearer KEY"
    curve: ClientCurve | None = None  # CURVE keys for the upstream, as for any client
    # known when the gateway runs beside its server; else asked from the upstream's stats
    max_model_len: int | None = None
    has_tokenizer: bool | None = None
    startup_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0  # no upstream connection this long: requests end with 503
    process_metrics: bool = True  # off when the server's process exports them already
    # a listening socket bound already (`serve --http` binds before the model loads); host and
    # port are then its own
    sock: socket.socket | None = None


def route_label(request: web.Request) -> str:
    """The `route` label of a request: its route's path as registered, or UNMATCHED_ROUTE, so
    the series stay as many as the routes whatever paths clients send."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED_ROUTE


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.metrics = GatewayMetrics()
        self._metrics_collector = GatewayCollector(self.metrics, process=config.process_metrics)
        self.model_name = config.served_model_name or ""
        self.max_model_len = config.max_model_len
        self.has_tokenizer = config.has_tokenizer
        self.url = ""
        self.created = int(time.time())
        self._client: AsyncClient | None = None
        self._runner: web.AppRunner | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> str:
        """Connects to the upstream (asking it for the model's name and limits unless they were
        given), binds the HTTP port and returns the gateway's URL."""
        self._client = AsyncClient(
            self.config.upstream, curve=self.config.curve, connect_timeout=self.config.connect_timeout_s
        )
        if not self.model_name or self.max_model_len is None or self.has_tokenizer is None:
            await self._learn_upstream()
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors_as_json])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site: web.BaseSite
        if self.config.sock is not None:
            site = web.SockSite(self._runner, self.config.sock)
        else:
            site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        return self.url

    async def close(self) -> None:
        """Closes the HTTP side (open streams are cancelled, which aborts them upstream), then
        the upstream client."""
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.aclose()

    async def _learn_upstream(self) -> None:
        assert self._client is not None
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            try:
                stats = await self._client.stats(timeout=2.0)
                break
            except (TimeoutError, ConnectionError) as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"no ringleader server answered at {self.config.upstream} within "
                        f"{self.config.startup_timeout_s:.0f} s ({exc})"
                    ) from None
        learned = ServedModel.from_stats(stats, self.model_name or None)
        self.model_name = learned.name
        if self.max_model_len is None:
            self.max_model_len = learned.max_model_len
        if self.has_tokenizer is None:
            self.has_tokenizer = learned.has_tokenizer

    # ---- routes ---------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, chat=True)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        self._authorize(request)
        return web.json_response(models_list(self.model_name, self.created, self.max_model_len))

    async def _health(self, request: web.Request) -> web.StreamResponse:
        """200 when the upstream answers within 2 s and its engine lives, else 503 saying why."""
        assert self._client is not None
        try:
            stats = await self._client.stats(timeout=2.0)
        except (TimeoutError, ConnectionError) as exc:
            raise APIError(
                503, f"upstream {self.config.upstream} does not answer: {exc}", type="service_unavailable"
            ) from None
        dead = stats.get("engine_dead")
        if dead:
            raise APIError(503, f"engine dead: {dead}", type="service_unavailable", code="engine_dead")
        return web.json_response(
            {"status": "ok", "model": self.model_name, "in_flight": stats.get("in_flight")}
        )

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        body, content_type = self._metrics_collector.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    @web.middleware
    async def _errors_as_json(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every error leaves in OpenAI's shape, counted by route and status."""
        route = route_label(request)
        try:
            response = await handler(request)
        except APIError as err:
            response = web.json_response(err.body(), status=err.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            shaped = APIError(exc.status, exc.reason or "error", type="invalid_request_error")
            response = web.json_response(shaped.body(), status=exc.status)
        self.metrics.answered(route, response.status)
        return response

    def _authorize(self, request: web.Request) -> None:
        authorize(request.headers.get("Authorization", ""), self.config.api_key)

    # ---- generation -----------------------------------------------------------------------
    async def _generation(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        arrived = time.perf_counter()
        route = route_label(request)
        self.metrics.generation_started(route)
        try:
            self._authorize(request)
            model = ServedModel(self.model_name, self.max_model_len, bool(self.has_tokenizer))
            req = check_request(await request.read(), chat=chat, model=model)
            assert self._client is not None
            answer = await answer_request(self._client, self.metrics, req, self.model_name, arrived)
            if isinstance(answer, dict):
                return web.json_response(answer)
            try:
                response = web.StreamResponse(headers=SSE_HEADERS)
                await response.prepare(request)
                async for chunk in answer:
                    await response.write(chunk)
                await response.write_eof()
            finally:
                await answer.aclose()
            return response
        except (ConnectionResetError, asyncio.CancelledError):
            self.metrics.client_disconnected()
            raise
        finally:
            self.metrics.generation_ended(route, time.perf_counter() - arrived)


class BackgroundGateway:
    """A Gateway on a thread with its own event loop: for `serve --http`, tests and embedding.

    `with BackgroundGateway(upstream) as gw:` returns once the HTTP port is bound; `gw.url`."""

    def __init__(
        self, upstream: str = DEFAULT_ADDRESS, host: str = "127.0.0.1", port: int = 0, **options: Any
    ):
        self.gateway = Gateway(GatewayConfig(upstream=upstream, host=host, port=port, **options))
        self._thread = threading.Thread(target=self._main, name="rl-gateway", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return self.gateway.url

    def start(self, timeout: float | None = None) -> BackgroundGateway:
        self._thread.start()
        limit = timeout if timeout is not None else self.gateway.config.startup_timeout_s + 10
        if not self._ready.wait(limit):
            raise TimeoutError(f"the gateway did not start within {limit:.0f} s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 15.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass  # the loop ended already
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def __enter__(self) -> BackgroundGateway:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await self.gateway.start()
        except BaseException as exc:  # handed to start() on the caller's thread
            self._error = exc
            self._ready.set()
            await self.gateway.close()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await self.gateway.close()


def run_gateway(config: GatewayConfig) -> int:
    """`ringleader gateway`: serve until SIGINT or SIGTERM."""

    async def main() -> None:
        gateway = Gateway(config)
        try:
            url = await gateway.start()
        except BaseException:
            await gateway.close()
            raise
        print(
            f"ringleader: openai gateway at {url} for {gateway.model_name!r} on {config.upstream}",
            file=sys.stderr,
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await gateway.close()

    try:
        asyncio.run(main())
    except RuntimeError as exc:
        print(f"ringleader gateway: {exc}", file=sys.stderr)
        return 2
    return 0
