"""EngineReplica: one Ray Serve replica = one ringleader engine (EngineProcess) and the gateway's
answering code in front of it (hostctl/gateway/answer.py), reached by the ingress through a
deployment handle.

`generate` is a streaming method: its first item is a Reply (status, and the whole JSON body,
or `streamed` and the SSE bytes follow as items), so the ingress knows the HTTP status before
it writes anything.  An engine that is gone answers 503 with a `retry` mark before anything ran,
and the ingress sends the request to another replica.  The health check fails once the engine
exited, stopped answering or declared itself dead, and Ray replaces the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from ringleader.hostctl.gateway.answer import answer_request
from ringleader.hostctl.gateway.openai_api import APIError, GenerationRequest, ServedModel
from ringleader.hostctl.ray_serve.args import RayServeArgs
from ringleader.hostctl.ray_serve.engine_process import EngineProcess
from ringleader.hostctl.ray_serve.metrics import ReplicaAnswerMetrics, ReplicaMetrics, engine_load
from ringleader.ipc import protocol as P
from ringleader.ipc.client import AsyncClient

log = logging.getLogger("ringleader.ray_serve")

STATS_POLL_S = 2.0  # the metrics' refresh
HEALTH_STATS_TIMEOUT_S = 5.0
# an engine silent this long (it answers pings from its frontend thread, whatever the model
# does) ends the replica's streams with `disconnected`, so a stalled engine's requests end
# before Ray's graceful stop of the replica waits on them
ENGINE_REPLY_TIMEOUT_S = 10.0
# upstream error codes that mean "this replica's engine cannot take it": nothing ran, so the
# ingress may send the request to another replica
RETRYABLE_CODES = frozenset({P.ERR_ENGINE_DEAD, P.ERR_SHUTDOWN, "disconnected"})


@dataclass(frozen=True)
class Reply:
    """The first item of `generate`: the HTTP status and the whole body, or `streamed` (the SSE
    bytes follow); `retry`: nothing ran on this replica's engine, another replica may take it."""

    status: int
    body: dict[str, Any] | None
    replica: str
    streamed: bool = False
    retry: bool = False

    @classmethod
    def error(cls, err: APIError, replica: str) -> Reply:
        return cls(err.status, err.body(), replica, retry=err.code in RETRYABLE_CODES)


class EngineReplica:
    # Ray awaits an async constructor (the engine loads before the replica takes requests)
    async def __init__(self, args: RayServeArgs):  # type: ignore[misc]
        self.args = args
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine: EngineProcess | None = None
        address = args.engine_address
        if address is None:
            self.engine = EngineProcess(args.engine_argv(), tag=self.replica_id)
            address = self.engine.address
            try:
                stats = await self.engine.wait_serving(args.engine_start_timeout_s)
            except BaseException:
                await self.engine.stop()
                raise
        self.client = AsyncClient(address, reply_timeout=ENGINE_REPLY_TIMEOUT_S)
        if self.engine is None:
            stats = await self.client.stats(timeout=args.engine_start_timeout_s)
        self.model = ServedModel.from_stats(stats, args.served_model_name)
        self.load = engine_load(stats)
        self.answer_metrics = ReplicaAnswerMetrics(self.model.name)
        self.metrics = ReplicaMetrics(self.model.name)
        self.metrics.update(stats)
        self._poller = asyncio.get_running_loop().create_task(self._poll_stats())
        log.info("replica %s serves %s on %s", self.replica_id, self.model.name, address)

    # ---- the ingress's calls --------------------------------------------------------------
    async def generate(
        self, req: GenerationRequest, refused_by: tuple[str, ...] = ()
    ) -> AsyncIterator[Reply | bytes]:
        """`req` answered: a Reply, then (streamed) the SSE bytes.  `refused_by` is for the
        request router: the replicas that could not take `req` before (prefix_router.py)."""
        arrived = time.perf_counter()
        gone = self.engine.exit_reason() if self.engine is not None else None
        if gone is not None:
            yield Reply.error(
                APIError(503, gone, type="service_unavailable", code=P.ERR_ENGINE_DEAD), self.replica_id
            )
            return
        try:
            answer = await answer_request(self.client, self.answer_metrics, req, self.model.name, arrived)
        except APIError as err:
            yield Reply.error(err, self.replica_id)
            return
        if isinstance(answer, dict):
            yield Reply(200, answer, self.replica_id)
            return
        try:
            yield Reply(200, None, self.replica_id, streamed=True)
            async for chunk in answer:
                yield chunk
        finally:  # also when the ingress cancels (its client went away): aborts upstream
            await answer.aclose()

    async def info(self) -> ServedModel:
        return self.model

    async def health(self) -> dict[str, Any]:
        """The gateway's /health answer for this replica's engine; raises APIError(503) if dead."""
        stats = await self._engine_stats()
        return {
            "status": "ok",
            "model": self.model.name,
            "replica": self.replica_id,
            "in_flight": stats.get("in_flight"),
        }

    # ---- Ray's calls ----------------------------------------------------------------------
    async def check_health(self) -> None:
        """Ray's health check: raising marks the replica unhealthy and Ray replaces it."""
        try:
            await self._engine_stats()
        except APIError as err:
            raise RuntimeError(f"replica {self.replica_id}: {err.message}") from None

    def record_routing_stats(self) -> dict[str, float]:
        """What request routers read of this replica (RunningReplica.routing_stats)."""
        return dict(self.load)

    async def __del__(self) -> None:
        self._poller.cancel()
        with contextlib.suppress(Exception):
            await self.client.aclose()
        if self.engine is not None:
            await self.engine.stop()

    # ---- the engine -----------------------------------------------------------------------
    async def _engine_stats(self) -> dict[str, Any]:
        gone = self.engine.exit_reason() if self.engine is not None else None
        if gone is not None:
            raise APIError(503, gone, type="service_unavailable", code=P.ERR_ENGINE_DEAD)
        try:
            stats = await self.client.stats(timeout=HEALTH_STATS_TIMEOUT_S)
        except (TimeoutError, ConnectionError) as exc:
            raise APIError(503, f"the engine does not answer: {exc}", type="service_unavailable") from None
        if stats.get("engine_dead"):
            raise APIError(
                503,
                f"engine dead: {stats['engine_dead']}",
                type="service_unavailable",
                code=P.ERR_ENGINE_DEAD,
            )
        return stats

    async def _poll_stats(self) -> None:
        while True:
            await asyncio.sleep(STATS_POLL_S)
            try:
                stats: dict[str, Any] | None = await self._engine_stats()
            except APIError:
                stats = None
            except Exception:  # the metrics never end the replica
                log.exception("reading the engine's stats failed")
                continue
            if stats is not None:
                self.load = engine_load(stats)
            self.metrics.update(stats)
