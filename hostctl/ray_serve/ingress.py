"""OpenAIIngress: the HTTP side of the Ray Serve app, behind Ray Serve's proxy.  It checks a
request as the gateway does (openai_api.authorize and check_request: the same 400s) and hands
the checked request to an EngineReplica through a deployment handle, so Ray's request router
(prefix affinity, or power of two choices) picks the replica on the request itself.

A request whose replica could not take it before anything ran (the replica's engine is gone,
the replica died, no replica was reachable) is sent again, to whichever replica the router
picks then, up to RETRIES times.  Once a stream has started, a replica that fails ends it with
one `data: {"error": ...}` event before `[DONE]`, as the gateway ends a stream whose server
failed: every request ends exactly once, never hangs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ringleader.hostctl.gateway.answer import SSE_HEADERS
from ringleader.hostctl.gateway.openai_api import (
    APIError,
    GenerationRequest,
    ServedModel,
    authorize,
    check_request,
    models_list,
)
from ringleader.hostctl.gateway.responses import SSE_DONE, ResponseWriter
from ringleader.hostctl.ray_serve.args import RayServeArgs
from ringleader.hostctl.ray_serve.replica import Reply

log = logging.getLogger("ringleader.ray_serve")

RETRIES = 3  # tries of a request no replica took yet
RETRY_PAUSE_S = 0.25  # between them: Ray's health check and router catch up
REPLICA_HEADER = "X-Ringleader-Replica"  # which engine replica answered (tests, debugging)
GENERATION_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat
_REPLICA_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)


def _unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="engine_dead")


class OpenAIIngress:
    def __init__(self, engine: DeploymentHandle, args: RayServeArgs):
        self.engine = engine
        self.streaming = engine.options(stream=True)
        self.api_key = args.api_key
        self.created = int(time.time())
        self._model: ServedModel | None = None

    async def __call__(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        try:
            if path in GENERATION_ROUTES:
                if method != "POST":
                    raise APIError(405, "Method Not Allowed")
                authorize(request.headers.get("authorization", ""), self.api_key)
                model = await self.served_model()
                req = check_request(await request.body(), chat=GENERATION_ROUTES[path], model=model)
                return await self._generate(req)
            if path == "/v1/models" and method == "GET":
                authorize(request.headers.get("authorization", ""), self.api_key)
                model = await self.served_model()
                return JSONResponse(models_list(model.name, self.created, model.max_model_len))
            if path == "/health" and method == "GET":
                return JSONResponse(await self._health())
            raise APIError(404, "Not Found")
        except APIError as err:
            return JSONResponse(err.body(), status_code=err.status)

    async def served_model(self) -> ServedModel:
        """The model the engine replicas serve, asked once (every replica serves the same)."""
        if self._model is None:
            try:
                self._model = await self.engine.info.remote()
            except _REPLICA_GONE as exc:
                raise _unavailable(f"no engine replica answers: {exc}") from None
        assert self._model is not None
        return self._model

    async def _health(self) -> dict[str, Any]:
        try:
            return await self.engine.health.remote()
        except _REPLICA_GONE as exc:
            raise _unavailable(f"no engine replica answers: {exc}") from None
        except Exception as exc:  # the replica's APIError arrives wrapped by Ray
            cause = getattr(exc, "cause", None)
            if isinstance(cause, APIError):
                raise cause from None
            raise _unavailable(str(exc)) from None

    async def _generate(self, req: GenerationRequest) -> Response:
        reply, stream = await self._first_reply(req)
        headers = {REPLICA_HEADER: reply.replica}
        if not reply.streamed:
            assert reply.body is not None
            return JSONResponse(reply.body, status_code=reply.status, headers=headers)
        return StreamingResponse(_rest(stream), headers={**SSE_HEADERS, **headers})

    async def _first_reply(self, req: GenerationRequest) -> tuple[Reply, DeploymentResponseGenerator]:
        """The first Reply of a replica that took the request, retrying those that could not
        (the router then steers away from the replicas that refused it)."""
        refused_by: tuple[str, ...] = ()
        for attempt in range(1, RETRIES + 1):
            stream = cast(
                DeploymentResponseGenerator, self.streaming.generate.remote(req, refused_by=refused_by)
            )
            try:
                reply: Reply = await stream.__anext__()
            except _REPLICA_GONE as exc:
                stream.cancel()
                if attempt == RETRIES:
                    raise _unavailable(f"no engine replica took the request: {exc}") from None
                log.warning("a replica could not take a request (%s): sending it again", exc)
            except StopAsyncIteration:
                raise _unavailable("the engine replica ended the request without an answer") from None
            except asyncio.CancelledError:  # the client went away before its first token
                stream.cancel()
                raise
            else:
                if not reply.retry or attempt == RETRIES:
                    return reply, stream
                stream.cancel()
                refused_by += (reply.replica,)
                log.warning(
                    "replica %s could not take a request (%s): sending it again", reply.replica, reply.body
                )
            await asyncio.sleep(RETRY_PAUSE_S)
        raise AssertionError("unreachable")


async def _rest(stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The SSE bytes after the first Reply; a replica that fails mid-stream ends it with one error
    event.  Leaving early (the client went away) cancels the replica's call, which aborts the
    request on its engine."""
    ended = False
    try:
        async for chunk in stream:
            yield chunk
        ended = True
    except Exception as exc:  # the replica died, or its call failed: one error event ends the stream
        ended = True
        yield ResponseWriter.error_event(_unavailable(f"the replica serving this stream failed: {exc}"))
        yield SSE_DONE
    finally:
        if not ended:
            stream.cancel()
