"""The OpenAI-compatible HTTP gateway: aiohttp in front of a ringleader server, reached over the
product's own protocol through AsyncClient.

Why aiohttp: one well-kept library gives the server and the HTTP client the benchmark drives
other servers with; its StreamResponse writes each SSE event with backpressure; and with
handler cancellation a client that disconnects cancels its handler, which closes the upstream
stream and so aborts the request on the server (its slot goes to someone else within a step).
No ASGI layer or model classes sit between a token frame and its bytes: a token costs one
json.dumps of its text (responses.ResponseWriter).  A request is checked here
(openai_api.check_request, the model, the key) and answered by answer.py.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE when `stream`), GET /v1/models,
GET /v1/models/{id}, GET /health (the upstream answers and its engine lives), GET /metrics (the
gateway's own series, and under `serve --http` the engine's after them), and vLLM's POST
/tokenize, POST /detokenize, GET /tokenizer_info (tokenize_api.py: the server's tokenizer ops).
Every failure is an OpenAI-shaped error: 400 naming the field, 401, 404 for another model, 429 for
`overloaded`, 503 for `engine_dead`/`shutdown`/no upstream, 504 for `timeout`; after a stream has
started, an error is one `data: {"error": ...}` event before `[DONE]`.

Until it is ready (`serve --http` binds its port before the model loads; `ringleader gateway`
serves while it asks the upstream for its model) every route but /metrics answers at once with a
503 that says so, as llama-server does: /health `{"status": "loading", "error": {...}}`, the others
"the model is loading" (type service_unavailable, code loading); nothing waits on the port.  Once
ready, an upstream whose connection is known to be down (upstream.connection_up: the client's
socket monitor says so, past a short grace after it started) is a 503 at once, not after the
connect timeout.
Every request leaves one log line (request_log.py) and its X-Request-Id in the response.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import os
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

from ringleader.hostctl.gateway.answer import SSE_HEADERS, AnswerSummary, answer_request
from ringleader.hostctl.gateway.errors import unavailable
from ringleader.hostctl.gateway.metrics import GatewayCollector, GatewayMetrics
from ringleader.hostctl.gateway.openai_api import (
    APIError,
    ServedModel,
    authorize,
    check_request,
    model_not_found,
    model_object,
    models_list,
)
from ringleader.hostctl.gateway.request_log import REQUEST_ID_HEADER, log_request, request_id_of
from ringleader.hostctl.gateway.tokenize_api import (
    ANSWER_WAIT_S,
    asked,
    detokenize_call,
    tokenize_answer,
    tokenize_call,
    tokenizer_info_answer,
)
from ringleader.hostctl.gateway.upstream import check_upstream_address, connection_up
from ringleader.ipc.client import AsyncClient
from ringleader.ipc.client.core import DEFAULT_ADDRESS
from ringleader.ipc.curve import ClientCurve

log = logging.getLogger("ringleader.gateway")

MAX_BODY_BYTES = 8 << 20
UNMATCHED_ROUTE = "unmatched"  # the `route` label of every request no route took (404, 405)
LOADING = "the model is loading"
# a client not connected this long after it started (ZeroMQ reconnects every 0.1 s) has an
# upstream that is down: a request is answered 503 at once rather than after connect_timeout_s
CONNECT_GRACE_S = 1.0
CLOSE_TIMEOUT_S = 10.0  # the upstream client's close; past it, `ringleader gateway` exits anyway
# the request being answered, for its handler: its X-Request-Id and what its log line tells
_EXCHANGE: contextvars.ContextVar[tuple[str, AnswerSummary]] = contextvars.ContextVar("rl_gateway_exchange")


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
    vocab_size: int | None = None
    max_tokens_cap: int | None = None  # the server's (None: max_model_len)
    startup_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0  # no upstream connection this long: requests end with 503
    process_metrics: bool = True  # off when the server's process exports them already
    # a listening socket bound already (`serve --http` binds before the model loads); host and
    # port are then its own
    sock: socket.socket | None = None
    # start() only serves, answering 503 "loading" until ready() is called (`serve --http`)
    loading: bool = False
    # a prometheus_client registry whose series GET /metrics serves after the gateway's own
    engine_registry: Any = None


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
        self.model = ServedModel(config.served_model_name or "")
        self.url = ""
        self.created = int(time.time())
        self._client: AsyncClient | None = None
        self._client_started = 0.0
        self._was_up = False  # its connection was seen up (so its being down is news, not a start)
        self._runner: web.AppRunner | None = None
        self._loading: str | None = LOADING  # why every request is a 503 now; None once ready

    @property
    def model_name(self) -> str:
        return self.model.name

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> str:
        """Binds the HTTP port and serves; then, unless config.loading, connects to the upstream
        (asking it for the model's name and limits unless they were given) and is ready.
        Returns the gateway's URL."""
        if not self.config.loading:
            check_upstream_address(self.config.upstream)  # before anything is bound
            self._loading = f"waiting for the ringleader server at {self.config.upstream} to answer"
        await self._serve_http()
        if not self.config.loading:
            await self.ready()
        return self.url

    async def ready(self, **changes: Any) -> None:
        """Connects to the upstream and ends the loading state; `changes` replace fields of the
        config first (`serve --http`: the server's address, its model's name and limits)."""
        config = self.config = dataclasses.replace(self.config, **changes)
        check_upstream_address(config.upstream)
        self.model = ServedModel(
            config.served_model_name or "",
            config.max_model_len,
            bool(config.has_tokenizer),
            config.vocab_size,
            config.max_tokens_cap,
        )
        self._client = AsyncClient(
            config.upstream, curve=config.curve, connect_timeout=config.connect_timeout_s
        )
        self._client_started, self._was_up = time.monotonic(), False
        await self._client.__aenter__()  # its socket connects from now on, not at the first request
        if not self.model.name or config.max_model_len is None or config.has_tokenizer is None:
            await self._learn_upstream()
        self._loading = None

    async def _serve_http(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._front])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model_id:.+}", self._model)  # ids may hold a "/"
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/tokenizer_info", self._tokenizer_info)
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

    async def close(self) -> bool:
        """Closes the HTTP side (open streams are cancelled, which aborts them upstream), then
        the upstream client; False if that client did not close within CLOSE_TIMEOUT_S."""
        if self._runner is not None:
            await self._runner.cleanup()
        elif self.config.sock is not None:
            self.config.sock.close()
        if self._client is not None:
            try:
                await asyncio.wait_for(self._client.aclose(), CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:  # TimeoutError from Python 3.11
                log.warning("the upstream client did not close within %.0f s", CLOSE_TIMEOUT_S)
                return False
        return True

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
        learned = ServedModel.from_stats(stats, self.model.name or None)
        config, model = self.config, self.model
        self.model = ServedModel(
            learned.name,
            learned.max_model_len if config.max_model_len is None else model.max_model_len,
            learned.has_tokenizer if config.has_tokenizer is None else model.has_tokenizer,
            model.vocab_size or learned.vocab_size,
            model.max_tokens_cap or learned.max_tokens_cap,
        )

    def _upstream_down(self) -> str | None:
        """Why the upstream cannot be reached now, known without waiting: its connection is
        down, and was up before or is not up CONNECT_GRACE_S after the client started; None
        when it is up, or the client does not say."""
        up = connection_up(self._client) if self._client is not None else None
        if up is not False:
            self._was_up = self._was_up or bool(up)
            return None
        if not self._was_up and time.monotonic() - self._client_started < CONNECT_GRACE_S:
            return None
        return f"no connection to the ringleader server at {self.config.upstream}"

    # ---- routes ---------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, chat=True)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        self._check_ready()
        self._authorize(request)
        return web.json_response(models_list(self.model.name, self.created, self.model.max_model_len))

    async def _model(self, request: web.Request) -> web.StreamResponse:
        self._check_ready()
        self._authorize(request)
        asked = request.match_info["model_id"]
        if asked != self.model.name:
            raise model_not_found(asked, self.model.name)
        return web.json_response(model_object(self.model.name, self.created, self.model.max_model_len))

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        client = self._upstream_for(request)
        call = tokenize_call(await request.read(), self.model)
        return web.json_response(tokenize_answer(await asked(client.tokenize(**call, timeout=ANSWER_WAIT_S))))

    async def _detokenize(self, request: web.Request) -> web.StreamResponse:
        client = self._upstream_for(request)
        ids = detokenize_call(await request.read(), self.model)
        return web.json_response({"prompt": await asked(client.detokenize(ids, timeout=ANSWER_WAIT_S))})

    async def _tokenizer_info(self, request: web.Request) -> web.StreamResponse:
        client = self._upstream_for(request)
        return web.json_response(
            tokenizer_info_answer(await asked(client.tokenizer_info(timeout=ANSWER_WAIT_S)))
        )

    def _upstream_for(self, request: web.Request) -> AsyncClient:
        """The client of a request that asks the upstream (ready, authorized, a connection up)."""
        self._check_ready()
        self._authorize(request)
        down = self._upstream_down()
        if down is not None:
            raise unavailable(down, "disconnected")
        assert self._client is not None
        return self._client

    async def _health(self, request: web.Request) -> web.StreamResponse:
        """200 when the upstream answers within 2 s and its engine lives, else 503 saying why
        (at once while loading, or while its connection is known to be down)."""
        if self._loading is not None:
            body = unavailable(self._loading, "loading").body()
            return web.json_response({"status": "loading", **body}, status=503)
        assert self._client is not None
        down = self._upstream_down()
        if down is not None:
            raise unavailable(f"upstream {self.config.upstream} does not answer: {down}", "disconnected")
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
            {"status": "ok", "model": self.model.name, "in_flight": stats.get("in_flight")}
        )

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        body, content_type = self._metrics_collector.exposition()
        engine = self.config.engine_registry
        if engine is not None:  # read off the event loop: a scrape reads the server's snapshot
            body += await asyncio.to_thread(self._metrics_collector.exposition_of, engine)
        return web.Response(body=body, headers={"Content-Type": content_type})

    @web.middleware
    async def _front(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every error leaves in OpenAI's shape, counted by route and status; every response
        carries the request's X-Request-Id, and every request leaves its log line."""
        arrived = time.perf_counter()
        route = route_label(request)
        request_id = request_id_of(request.headers.get(REQUEST_ID_HEADER))
        summary = AnswerSummary()
        exchange = _EXCHANGE.set((request_id, summary))
        status: int | None = None
        reason: str | None = None
        try:
            try:
                response = await handler(request)
            except APIError as err:
                response, reason = web.json_response(err.body(), status=err.status), err.message
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                reason = exc.reason or "error"
                shaped = APIError(exc.status, reason, type="invalid_request_error")
                response = web.json_response(shaped.body(), status=exc.status)
            if not response.prepared:
                response.headers[REQUEST_ID_HEADER] = request_id
            status = response.status
            self.metrics.answered(route, status)
            return response
        except web.HTTPException as exc:  # below 400: a redirect
            status = exc.status
            raise
        except ConnectionResetError:  # as a cancelled handler: the client went away (status None)
            raise
        except Exception as exc:  # aiohttp answers it with a 500
            status, reason = 500, f"internal error: {exc!r}"
            raise
        finally:
            _EXCHANGE.reset(exchange)
            seconds = time.perf_counter() - arrived
            log_request(route, request.method, request.raw_path, status, request_id, reason, summary, seconds)

    def _authorize(self, request: web.Request) -> None:
        authorize(request.headers.get("Authorization", ""), self.config.api_key)

    def _check_ready(self) -> None:
        if self._loading is not None:
            raise unavailable(self._loading, "loading")

    # ---- generation -----------------------------------------------------------------------
    async def _generation(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        arrived = time.perf_counter()
        route = route_label(request)
        self.metrics.generation_started(route)
        try:
            self._check_ready()
            self._authorize(request)
            req = check_request(await request.read(), chat=chat, model=self.model)
            down = self._upstream_down()
            if down is not None:
                self.metrics.upstream_error("disconnected")
                raise unavailable(down, "disconnected")
            assert self._client is not None
            request_id, summary = _EXCHANGE.get()
            answer = await answer_request(self._client, self.metrics, req, self.model.name, arrived, summary)
            if isinstance(answer, dict):
                return web.json_response(answer)
            try:
                headers = {**SSE_HEADERS, REQUEST_ID_HEADER: request_id}
                response = web.StreamResponse(headers=headers)
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

    `with BackgroundGateway(upstream) as gw:` returns once the HTTP port is bound; `gw.url`.
    With loading=True, start() returns once it answers 503 "loading", and ready(**changes)
    (changes to the config: the upstream, the model's name and limits) ends that."""

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

    def ready(self, timeout: float | None = None, **changes: Any) -> BackgroundGateway:
        """Ends the loading state of a gateway started with loading=True (see Gateway.ready)."""
        assert self._loop is not None, "start() first"
        limit = timeout if timeout is not None else self.gateway.config.startup_timeout_s + 10
        asyncio.run_coroutine_threadsafe(self.gateway.ready(**changes), self._loop).result(limit)
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
    """`ringleader gateway`: serve until SIGINT or SIGTERM.  A start that fails ends the
    process with one line, within the startup timeout, whatever the upstream does."""

    async def main() -> None:
        gateway = Gateway(config)
        try:
            # start() is bounded by the startup timeout itself (each stats ask by 2 s); this
            # bound is the last word
            url = await asyncio.wait_for(gateway.start(), config.startup_timeout_s + 5)
        except asyncio.TimeoutError:  # TimeoutError from Python 3.11
            await _close_or_exit(gateway)
            raise RuntimeError(
                f"no ringleader server answered at {config.upstream} within {config.startup_timeout_s:.0f} s"
            ) from None
        except BaseException:
            await _close_or_exit(gateway)
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
            await _close_or_exit(gateway)

    try:
        asyncio.run(main())
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"ringleader gateway: {exc}", file=sys.stderr)
        return 2
    return 0


async def _close_or_exit(gateway: Gateway) -> None:
    """Closes the gateway; if its upstream client would not close (a thread stuck in ZeroMQ's
    Context.term, which asyncio.run would then wait for forever), the process exits now."""
    if not await gateway.close():
        print(
            "ringleader gateway: the upstream connection would not close; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)
