"""The host process: a ROUTER frontend, admission into the rings, completion routing, shutdown.

Threads: the frontend thread runs Server's loop and owns the ROUTER socket, the SQ and the abort
ring (decode, validate, tokenize, admit, abort, time out, send); the completion thread owns the CQ
(completions.py); the backend runs the scheduler.  Server.__init__ names the collaborators, each
in its own file with the thread that uses it: WakePipe (wake.py), Outbox (outbox.py: per-client
backlog, gone clients), Intake (intake.py: accept or refuse), Tokenization (tokenization.py),
Families (families.py: n choices, prefix gating), Admission (admission.py), Deadlines
(deadlines.py), the RequestTable (inflight.py) and CompletionRouter (completions.py).

Every generate gets exactly one terminal `done`.  An accepted one gets it from Finisher.end
(finisher.py), the one place an accepted request ends: from the device (stop, length, abort, or
an abort the host turned into an error such as timeout), from the watchdog (engine_dead), or from
the host for requests the device never saw.  A generate that is never accepted gets its `done`
from Intake.reject (reject_frame) instead.

Per-frame work is O(1) in the number of requests in flight: the request table indexes requests
by client, a client found gone is handled once (its later frames are dropped, not re-examined),
and deadlines sit in a heap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ringleader.hostctl.serving.admission import Admission
from ringleader.hostctl.serving.completions import CompletionRouter
from ringleader.hostctl.serving.config import ServerConfig
from ringleader.hostctl.serving.constraints import Constraints
from ringleader.hostctl.serving.deadlines import Deadlines
from ringleader.hostctl.serving.families import Families
from ringleader.hostctl.serving.finisher import Finisher
from ringleader.hostctl.serving.frontend_socket import FrontendSocket
from ringleader.hostctl.serving.inflight import Ending, InFlight, RequestTable
from ringleader.hostctl.serving.intake import Intake
from ringleader.hostctl.serving.metrics import ServerMetrics, thread_cpu_seconds
from ringleader.hostctl.serving.outbox import Outbox
from ringleader.hostctl.serving.snapshot import ServerSnapshot, read_snapshot
from ringleader.hostctl.serving.tokenization import Tokenization
from ringleader.hostctl.serving.tokenize_service import TokenizeService
from ringleader.hostctl.serving.wake import WakePipe
from ringleader.ipc import protocol
from ringleader.ipc.backend import Backend
from ringleader.ipc.client.core import DEFAULT_ADDRESS

log = logging.getLogger("ringleader.server")

RECV_BATCH = 256  # frames taken per wake-up before admitting them together
ABORT_WAIT_S = 1.5  # at shutdown: how long the device gets to end what was aborted


class Server:
    """The host process's server over one backend, shaped by a ServerConfig (hostctl/serving/config.py:
    limits, admission, time-outs, the stop), given as `config` or as its fields by name.
    bind: the ROUTER's address, or a FrontendSocket bound already (serve binds before the model
    loads).  curve: CURVE keys (ringleader.ipc.curve.ServerCurve); then only clients whose public
    key is authorized get through.  A request's own timeout_ms bounds its whole life, the config's
    max_queue_ms its wait for a batch slot (a request whose prefill started runs on).  Shutdown takes at most drain_timeout_s + 5 s,
    whatever is in flight."""

    def __init__(
        self,
        backend: Backend,
        bind: str | FrontendSocket = DEFAULT_ADDRESS,
        config: ServerConfig | None = None,
        *,
        curve=None,
        **fields: Any,
    ):
        # a bad field fails in ServerConfig.of, before the backend is read
        self.config = config = ServerConfig.of(config, **fields).resolved(
            backend.description.get("device", "")
        )
        self.backend = backend
        model = backend.model
        if isinstance(bind, str):
            frontend = FrontendSocket(bind, curve=curve, max_frame_bytes=config.max_frame_bytes)
        else:  # bound already; curve and max_frame_bytes were given to it
            frontend = bind
        self._frontend = frontend
        self.limits = protocol.Limits(
            max_frame_bytes=frontend.max_frame_bytes,
            vocab_size=model.vocab_size,
            max_context=model.max_context,
            max_tokens_cap=config.max_tokens_cap or model.max_context,
            default_max_tokens=config.default_max_tokens,
            prompt_logprobs=bool(backend.rings.config.score_rows),
        )
        # shared by both threads: the table and the metrics under their own locks; the finisher
        # through them
        self.table = RequestTable()
        self.metrics = ServerMetrics()
        self.finisher = Finisher(self.table, self.metrics, backend.rings.arena, backend.rings.grammar)
        # the frontend thread's alone, but for the wake pipe's notify, the outbox's put_many and
        # a family's gate, which any thread may call
        self._socket = frontend.socket
        self.address = frontend.address
        self.wake = WakePipe(frontend.context)
        self.outbox = Outbox(self._socket, self.table, self.wake.notify, abort=self._abort)
        self.admission = Admission(
            backend.rings,
            self.table,
            max_queued=config.max_queued,
            max_queued_tokens=config.max_queued_tokens,
        )
        self.deadlines = Deadlines(self.table, config.max_queue_ms)
        self.tokenization = Tokenization(model, self.limits)
        self.tokenize_service = TokenizeService(model, self.tokenization, self.limits)  # 1.10's ops
        cfg = backend.rings.config
        self.families = Families(
            self.table,
            self.admission,
            self.deadlines,
            self.tokenization,
            self.wake.notify,
            shared_prefill_len=cfg.page_size if cfg.prefix_caching else 0,
        )
        self.constraints = Constraints(
            model,
            backend.rings.grammar,
            self.admission,
            self.wake.notify,
            lambda req, message: self._abort(req, (protocol.ERR_BAD_REQUEST, message)),
        )
        # the completion thread's (it starts in serve_forever)
        assert config.watchdog_s is not None  # resolved() filled it in
        self.router = CompletionRouter(
            backend, self.table, self.finisher, self.outbox, self.metrics, config.watchdog_s
        )
        self.intake = Intake(
            self.table,
            self.admission,
            self.deadlines,
            self.tokenization,
            self.families,
            self.constraints,
            self.metrics,
            self.outbox,
            lambda: self.router.dead_reason,
            max_inflight_per_client=config.max_inflight_per_client,
        )
        # the loop's own state (frontend thread), but for the stop and the serving flag
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self.wake.receiver, zmq.POLLIN)
        self._stop_requested = threading.Event()  # any thread, signal handlers included
        self.serving = threading.Event()  # the backend and the completion thread have started
        self._frontend_tid: int | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def serve_forever(self, on_serving: Callable[[], None] | None = None) -> None:
        """Runs the frontend on the calling thread until request_stop(); then shuts down.
        on_serving: called once the backend and the completion thread have started."""
        self._frontend_tid = threading.get_native_id()
        try:
            try:
                self.backend.start()
            except BaseException:
                self._abandon_start()
                raise
            self.router.start()
            self.serving.set()
            log.debug("serving %s on %s", self.backend.model.name, self.address)
            if on_serving is not None:
                on_serving()
            try:
                while not self._stop_requested.is_set():
                    self._frontend_iteration(timeout_ms=self._poll_timeout_ms())
            finally:
                self._shutdown()
        finally:
            self._frontend_tid = None  # the thread goes on as someone else's: stop counting it

    def request_stop(self) -> None:
        """Safe from any thread and from signal handlers (the frontend polls at least every 100 ms)."""
        self._stop_requested.set()

    def _poll_timeout_ms(self) -> int:
        if self.admission.waits_for_ring_space() or self.outbox.has_backlog:
            return 1
        next_ns = self.deadlines.next_ns()
        if next_ns is not None:
            until = (next_ns - time.perf_counter_ns()) // 1_000_000
            return int(min(100, max(1, until + 1)))
        return 100

    # ---- the frontend loop -----------------------------------------------------------------
    def _frontend_iteration(self, timeout_ms: int) -> None:
        # 1. poll the socket and the wake-up pipe; drain the wake-ups
        ready = dict(self._poller.poll(timeout_ms))
        if self.wake.receiver in ready:
            self.wake.drain()
        # 2. receive and decode up to RECV_BATCH frames: admit, abort, reject, answer stats/ping
        if self._socket in ready:
            for _ in range(RECV_BATCH):
                try:
                    parts = self._socket.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                self._handle_parts(parts)
        # 3. deadlines: time out what passed its queue limit or its timeout_ms
        self._expire_deadlines()
        # 4. admission pump: requests whose constraint is now compiled, and choices whose first
        #    one's prompt is now cached, join the queue; held-back aborts, then queued requests
        #    into the SQ
        self.constraints.release_compiled()
        self.families.release_opened()
        self.admission.pump()
        # 5. publish what was written to the rings, and wake the device if anything was
        if self.admission.publish():
            self.backend.wake()
        # 6. send what the completion thread put in the outbox
        self.outbox.send_routed()
        # 7. retry frames zmq had no room for
        self.outbox.retry_backlog()
        # 8. forget gone clients with nothing left in flight
        self.outbox.sweep_gone()

    def _handle_parts(self, parts: list[bytes]) -> None:
        client = parts[0]
        self.outbox.heard_from(client)
        if len(parts) != 2:
            self.metrics.bad_frames += 1
            self.outbox.send(
                client,
                protocol.encode(
                    protocol.error_msg(
                        protocol.ERR_BAD_REQUEST, f"expected one frame per message, got {len(parts) - 1}"
                    )
                ),
            )
            return
        try:
            request = protocol.decode_request(parts[1], self.limits)
        except protocol.FrameError as exc:
            self.metrics.bad_frames += 1
            self.outbox.send(client, protocol.encode(protocol.error_msg(protocol.ERR_BAD_REQUEST, str(exc))))
            return
        except protocol.BadRequest as exc:
            self.intake.reject(client, exc.id, protocol.ERR_BAD_REQUEST, exc.message)
            return
        if isinstance(request, protocol.GenerateRequest):
            self.intake.generate(client, request)
        elif isinstance(request, protocol.AbortRequest):
            for req in self.table.find(client, request.id):
                if request.index is None or request.index == req.index:
                    self._abort(req, finish_reason=request.finish_reason)
        elif isinstance(request, protocol.StatsRequest):
            self.outbox.send(
                client, protocol.encode(protocol.stats_msg(self.stats(request.timeline_after_seq)))
            )
        elif isinstance(request, protocol.PingRequest):
            self.outbox.send(client, protocol.encode(protocol.pong_msg()))
        elif isinstance(request, protocol.HelloRequest):
            batch = self.outbox.set_batched(client, request.batch)
            self.outbox.send(client, protocol.encode(protocol.hello_reply_msg(batch)))
        else:  # tokenize, detokenize, tokenizer_info (1.10): answered at once
            self.outbox.send(client, self.tokenize_service.answer(request))

    # ---- ending requests early ---------------------------------------------------------------
    def _abort(
        self, req: InFlight, error: tuple[str, str] | None = None, finish_reason: str = protocol.FINISH_ABORT
    ) -> None:
        """Ends a request: at once if it is still on the host, else through the abort ring (its
        `done` then comes from the device).  It ends as an error (code, message) when `error` is
        given, else with `finish_reason` ("abort", or "stop" for a client's own stop); unless an
        earlier abort of it was already sent: that one's outcome stands."""
        ending = Ending(protocol.FINISH_ERROR, *error) if error is not None else Ending(finish_reason)
        if req.end_as is None and not req.abort_sent:
            req.end_as = ending  # before the abort enters the ring (InFlight.end_as's rule)
        if self.admission.abort(req):
            self._end_on_host(req, ending.finish_reason, ending.code, ending.message)

    def _end_on_host(
        self, req: InFlight, reason: str, code: str | None = None, message: str | None = None
    ) -> None:
        """Sends the `done` of a request the device does not hold (or no longer answers for),
        unless the completion thread ended it first."""
        self.outbox.send_replies(self.finisher.end(req, reason, code, message))

    def _expire_deadlines(self) -> None:
        for req, message, queue_limit in self.deadlines.expired():
            if not queue_limit:
                self._abort(req, (protocol.ERR_TIMEOUT, message))
            elif self.admission.is_gated(req):
                self.deadlines.rearm_queue(req)  # not yet waiting for a slot
            elif req.end_as is None and not req.abort_sent and req.queue_end_as is None:
                # it ends only if still waiting for a slot: the device decides, where the slots are
                req.queue_end_as = Ending(protocol.FINISH_ERROR, protocol.ERR_TIMEOUT, message)
                if self.admission.abort(req, if_queued=True):
                    self._end_on_host(req, protocol.FINISH_ERROR, protocol.ERR_TIMEOUT, message)

    # ---- stats, the exporter's snapshot and shutdown -----------------------------------------
    def stats(self, timeline_after_seq: int = 0) -> dict:
        """timeline_after_seq: the backend's device timeline covers the steps after it (1.6)."""
        s = self.metrics.snapshot()
        s.update(
            in_flight=len(self.table),
            host_queue=self.admission.queued,
            in_device=self.table.in_sq,  # wire name; requests in the SQ or on the device
            device_window=self.admission.device_window,
            timed_out=s["errors_by_code"].get(protocol.ERR_TIMEOUT, 0),  # requests ended by a timeout
            completion_batches=self.router.batches,  # CQ batches routed (per step: device.steps)
            batched_connections=self.outbox.batched_clients,
            arena_used=self.backend.rings.arena.used(),
            structured=self.constraints.stats(),
            model=self.backend.model.name,
            model_info=self._model_info(),
            engine_dead=self.router.dead_reason,  # None while the engine lives
            protocol=f"{protocol.PROTOCOL_VERSION}.{protocol.PROTOCOL_REVISION}",
            backend=dict(self.backend.description),
            device=self.backend.stats(timeline_after_seq=timeline_after_seq),
        )
        s["device"].pop("threads", None)  # named in thread_cpu_s instead
        s["thread_cpu_s"] = self.thread_cpu_seconds()
        return s

    def snapshot(self) -> ServerSnapshot:
        """The figures the Prometheus exporter exports, read now; safe from any thread."""
        return read_snapshot(self)

    def _model_info(self) -> dict:
        """What a client needs to know of the model to build requests (the gateway asks)."""
        model = self.backend.model
        return {
            "max_context": model.max_context,
            "max_tokens_cap": self.limits.max_tokens_cap,  # max_tokens' range is [1, this]
            "vocab_size": model.vocab_size,
            "tokenizer": model.tokenizer is not None,
            "chat_template": model.encode_chat is not None,
        }

    def thread_cpu_seconds(self) -> dict[str, float]:
        """CPU seconds of each of the host's own threads that runs now, by name: frontend,
        completions and the backend's (engine on the CPU).  Safe from any thread."""
        tids: dict[str, int | None] = {
            "frontend": self._frontend_tid,
            "completions": self.router.native_id,
            **self.backend.thread_ids(),
        }
        threads = {name: thread_cpu_seconds(tid) for name, tid in tids.items()}
        return {k: v for k, v in threads.items() if v is not None}

    def _shutdown(self) -> None:
        """Stop accepting, let in-flight requests finish for drain_timeout_s, then end the rest:
        those on the host at once, those on the device through the abort ring, and whatever the
        device has not ended ABORT_WAIT_S later on the host.  Every step is bounded."""
        self.intake.stop_accepting()
        started = time.monotonic()
        deadline = started + self.config.drain_timeout_s
        if len(self.table):
            log.info(
                "stopping: draining %d requests in flight (up to %g s, the --drain-timeout)",
                len(self.table),
                self.config.drain_timeout_s,
            )
        else:
            log.info("stopping: nothing in flight")
        while len(self.table) and time.monotonic() < deadline:
            self._frontend_iteration(timeout_ms=10)
        if len(self.table) or self.admission.queued:
            log.info("drain ended with %d requests in flight: ending them as shutdown", len(self.table))
        for req in self.admission.drop_queued():
            self._end_on_host(
                req,
                protocol.FINISH_ERROR,
                protocol.ERR_SHUTDOWN,
                "server shut down before the request started",
            )
        for req in self.table.all():
            self._abort(req, (protocol.ERR_SHUTDOWN, "server shut down"))
        deadline = time.monotonic() + ABORT_WAIT_S
        while len(self.table) and time.monotonic() < deadline and self.router.dead_reason is None:
            self._frontend_iteration(timeout_ms=10)
        for req in self.table.all():  # the device did not answer: end them on the host
            self._end_on_host(req, protocol.FINISH_ERROR, protocol.ERR_SHUTDOWN, "server shut down")
        self.outbox.send_routed()
        self.outbox.retry_backlog()
        self.router.stop()
        self.constraints.close()
        try:
            self.backend.stop()  # raises EngineDead if the device did not stop: never silent
        finally:
            self._close_sockets(linger_ms=1000)
        log.info(
            "stopped (shutdown took %.1f s); %d requests accepted since start",
            time.monotonic() - started,
            self.metrics.accepted,
        )

    def _abandon_start(self) -> None:
        """backend.start() raised: whatever it had started (a kernel, a launch, an engine thread)
        is told to stop, bounded, so the process can exit; nothing was accepted yet.  A failure
        to stop is logged, and the start's own error is the one that propagates."""
        self.intake.stop_accepting()
        try:
            self.backend.stop()
        except Exception:
            log.exception("the backend did not stop after its start failed")
        finally:
            self._close_sockets(linger_ms=0)

    def _close_sockets(self, linger_ms: int) -> None:
        self.wake.close()
        self._frontend.close(linger_ms)
