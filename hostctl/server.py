"""The host process: a ROUTER frontend, admission into the rings, completion routing, shutdown.

Threads: the frontend thread owns the ROUTER socket and the SQ (decode, validate, tokenize,
admit, send); the completion thread owns the CQ (see completions.py); the backend runs the
scheduler.  Every accepted generate gets exactly one `done`: from the device (stop, length,
abort), from the watchdog (engine_dead), or from the host for requests the device never saw.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import defaultdict, deque

import numpy as np
import zmq

from hostctl.admission import Admission
from hostctl.completions import CompletionRouter, Outbox, done_frame
from hostctl.inflight import InFlight, RequestTable
from hostctl.metrics import ServerMetrics, thread_cpu_seconds
from ipc import protocol
from ipc.backend import Backend

log = logging.getLogger("ringleader.server")

RECV_BATCH = 256           # frames taken per wake-up before admitting them together
HARD_FRAME_LIMIT = 64 << 20  # zmq drops a connection that sends more than this in one frame
MAX_BACKLOG_FRAMES = 65536   # per client; beyond it the client is treated as gone


class Server:
    def __init__(self, backend: Backend, bind: str = "tcp://127.0.0.1:5555", *,
                 max_queued: int = 4096, max_frame_bytes: int = 1 << 20,
                 max_tokens_cap: int | None = None, watchdog_s: float | None = None,
                 drain_timeout_s: float = 5.0):
        self.backend = backend
        model = backend.model
        self.limits = protocol.Limits(
            max_frame_bytes=max_frame_bytes, vocab_size=model.vocab_size,
            max_context=model.max_context,
            max_tokens_cap=max_tokens_cap or model.max_context)
        self.table = RequestTable()
        self.metrics = ServerMetrics()
        self.admission = Admission(backend.rings, max_queued=max_queued)
        self._drain_timeout_s = drain_timeout_s
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.LINGER, 1000)
        self._router.setsockopt(zmq.SNDHWM, 100_000)
        self._router.setsockopt(zmq.RCVHWM, 100_000)
        self._router.setsockopt(zmq.MAXMSGSIZE, max(HARD_FRAME_LIMIT, 4 * max_frame_bytes))
        self._router.bind(bind)
        self.address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        wake_addr = f"inproc://rl-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(wake_addr)
        self._wake_lock = threading.Lock()
        self._wake_pending = False
        self.outbox = Outbox(self._notify_frontend)
        if watchdog_s is None:  # a CPU step of a big model can take seconds; a GPU step cannot
            watchdog_s = 60.0 if backend.description.get("device") == "cpu" else 2.0
        self.completions = CompletionRouter(backend, self.table, self.outbox, self.metrics,
                                            watchdog_s)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._backlog: dict[bytes, deque] = defaultdict(deque)
        self._stop_requested = threading.Event()
        self._frontend_tid: int | None = None
        self._accepting = True

    # ---- lifecycle -------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Runs the frontend on the calling thread until request_stop(); then shuts down."""
        self._frontend_tid = threading.get_native_id()
        self.backend.start()
        self.completions.start()
        log.info("serving %s on %s", self.backend.model.name, self.address)
        try:
            while not self._stop_requested.is_set():
                self._frontend_iteration(timeout_ms=self._poll_timeout_ms())
        finally:
            self._shutdown()

    def request_stop(self) -> None:
        """Safe from any thread and from signal handlers (the frontend polls at least every 100 ms)."""
        self._stop_requested.set()

    def _poll_timeout_ms(self) -> int:
        return 1 if (self.admission.queued or self._backlog) else 100

    def _notify_frontend(self) -> None:
        with self._wake_lock:
            if self._wake_pending:
                return
            self._wake_pending = True
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    # ---- the frontend loop -----------------------------------------------------------------
    def _frontend_iteration(self, timeout_ms: int) -> None:
        ready = dict(self._poller.poll(timeout_ms))
        if self._wake_rx in ready:
            with self._wake_lock:
                self._wake_pending = False
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
        if self._router in ready:
            for _ in range(RECV_BATCH):
                try:
                    parts = self._router.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                self._handle_parts(parts)
        self.admission.pump()
        if self.admission.publish():
            self.backend.wake()
        self._send_all(self.outbox.take_all())
        self._retry_backlog()

    def _handle_parts(self, parts: list[bytes]) -> None:
        client = parts[0]
        if len(parts) != 2:
            self.metrics.bad_frames += 1
            self._send(client, protocol.encode(protocol.error_msg(
                protocol.ERR_BAD_REQUEST, f"expected one frame per message, got {len(parts) - 1}")))
            return
        try:
            request = protocol.decode_request(parts[1], self.limits)
        except protocol.FrameError as exc:
            self.metrics.bad_frames += 1
            self._send(client, protocol.encode(protocol.error_msg(protocol.ERR_BAD_REQUEST, str(exc))))
            return
        except protocol.BadRequest as exc:
            self.metrics.rejected_bad_request += 1
            self._send(client, protocol.encode(protocol.done_msg(
                exc.id, protocol.FINISH_ERROR, 0, 0, error_code=protocol.ERR_BAD_REQUEST,
                error_message=str(exc))))
            return
        if isinstance(request, protocol.GenerateRequest):
            self._on_generate(client, request)
        elif isinstance(request, protocol.AbortRequest):
            req = self.table.find(client, request.id)
            if req is not None:
                self._abort(req)
        elif isinstance(request, protocol.StatsRequest):
            self._send(client, protocol.encode(protocol.stats_msg(self.stats())))
        elif isinstance(request, protocol.PingRequest):
            self._send(client, protocol.encode(protocol.pong_msg()))

    def _reject(self, client: bytes, request_id, code: str, message: str) -> None:
        """A `done` for a generate that is never accepted (usage is zero by the protocol)."""
        self._send(client, protocol.encode(protocol.done_msg(
            request_id, protocol.FINISH_ERROR, 0, 0, error_code=code, error_message=message)))

    def _on_generate(self, client: bytes, r: protocol.GenerateRequest) -> None:
        if self.table.contains(client, r.id):
            self.metrics.rejected_bad_request += 1
            self._reject(client, r.id, protocol.ERR_DUPLICATE_ID,
                         f"id: {r.id!r} is already in flight for this client")
            return
        if not self._accepting or self.completions.dead_reason is not None:
            code = protocol.ERR_SHUTDOWN if not self._accepting else protocol.ERR_ENGINE_DEAD
            self._reject(client, r.id, code, "server is not accepting requests: " +
                         ("shutting down" if not self._accepting else self.completions.dead_reason))
            return
        model = self.backend.model
        if r.prompt_ids is not None:
            prompt_ids = r.prompt_ids
        elif model.tokenizer is None:
            self.metrics.rejected_bad_request += 1
            self._reject(client, r.id, protocol.ERR_BAD_REQUEST,
                         "prompt: this model has no tokenizer; send prompt_ids")
            return
        else:
            prompt_ids = model.tokenizer.encode(r.prompt)
        try:
            protocol.check_context(len(prompt_ids), r.max_tokens, self.limits, request_id=r.id)
        except protocol.BadRequest as exc:
            self.metrics.rejected_bad_request += 1
            self._reject(client, r.id, protocol.ERR_BAD_REQUEST, str(exc))
            return
        if not self.admission.can_accept(len(prompt_ids)):
            self.metrics.rejected_overloaded += 1
            self._reject(client, r.id, protocol.ERR_OVERLOADED,
                         f"overloaded: {self.admission.queued} requests already wait for a slot")
            return
        seed = r.seed if r.seed is not None else int.from_bytes(os.urandom(8), "little")
        req = self.table.add(
            client, r.id, prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            max_tokens=r.max_tokens, temperature=float(r.temperature), top_p=float(r.top_p),
            top_k=int(r.top_k), seed=seed, stop_ids=tuple(r.stop_token_ids),
            ignore_eos=bool(r.ignore_eos), priority=int(r.priority),
            detokenizer=model.new_detokenizer() if model.new_detokenizer else None)
        self.admission.submit(req)  # can_accept was checked just above
        self.metrics.accepted += 1

    def _abort(self, req: InFlight, code: str | None = None, message: str | None = None) -> None:
        if code is not None:
            self.completions.abort_as[req.handle] = (code, message)
        if self.admission.abort(req) and self.table.finish(req.handle) is req:
            # never reached the device: end it here
            reason = protocol.FINISH_ERROR if code else protocol.FINISH_ABORT
            self._send(req.client, done_frame(req, reason, code, message)[1])
            self.metrics.finished(req, reason)

    # ---- sending -----------------------------------------------------------------------------
    def _send_all(self, frames) -> None:
        for client, frame in frames:
            self._send(client, frame)

    def _send(self, client: bytes, frame: bytes) -> None:
        backlog = self._backlog.get(client)
        if backlog:  # keep per-client order behind frames that are already waiting
            backlog.append(frame)
            if len(backlog) > MAX_BACKLOG_FRAMES:
                self._client_gone(client, "client does not read its replies")
            return
        try:
            self._router.send_multipart([client, frame], zmq.NOBLOCK)
        except zmq.Again:
            self._backlog[client].append(frame)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                self._client_gone(client, "client disconnected")
            else:
                raise

    def _retry_backlog(self) -> None:
        for client in list(self._backlog):
            q = self._backlog[client]
            while q:
                try:
                    self._router.send_multipart([client, q[0]], zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    q.clear()
                    self._client_gone(client, "client disconnected")
                    break
                q.popleft()
            if not q:
                self._backlog.pop(client, None)

    def _client_gone(self, client: bytes, why: str) -> None:
        """Aborts everything the client has in flight, so its slots go to others."""
        self._backlog.pop(client, None)
        for req in self.table.of_client(client):
            log.info("aborting %r: %s", req.id, why)
            self._abort(req)

    # ---- stats and shutdown ------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.metrics.snapshot()
        s.update(in_flight=len(self.table), host_queue=self.admission.queued,
                 arena_used=self.backend.rings.arena.used(), model=self.backend.model.name,
                 backend=dict(self.backend.description), device=self.backend.stats())
        threads = {"frontend": thread_cpu_seconds(self._frontend_tid),
                   "completions": thread_cpu_seconds(self.completions.native_id)}
        for name, tid in s["device"].pop("threads", {}).items():
            threads[name] = thread_cpu_seconds(tid)
        s["thread_cpu_s"] = {k: v for k, v in threads.items() if v is not None}
        return s

    def _shutdown(self) -> None:
        """Stop accepting, let in-flight requests finish for a while, then end the rest."""
        self._accepting = False
        deadline = time.monotonic() + self._drain_timeout_s
        while len(self.table) and time.monotonic() < deadline:
            self._frontend_iteration(timeout_ms=10)
        for req in self.admission.drop_queued():
            if self.table.finish(req.handle) is req:
                self._send(req.client, done_frame(req, protocol.FINISH_ERROR, protocol.ERR_SHUTDOWN,
                                                  "server shut down before the request started")[1])
        for req in self.table.all():
            self._abort(req, protocol.ERR_SHUTDOWN, "server shut down")
        deadline = time.monotonic() + 2.0
        while len(self.table) and time.monotonic() < deadline and self.completions.dead_reason is None:
            self._frontend_iteration(timeout_ms=10)
        for req in self.table.all():  # the device did not answer: end them on the host
            if self.table.finish(req.handle) is req:
                self._send(req.client, done_frame(req, protocol.FINISH_ERROR, protocol.ERR_SHUTDOWN,
                                                  "server shut down")[1])
        self._send_all(self.outbox.take_all())
        self._retry_backlog()
        self.completions.stop()
        try:
            self.backend.stop()  # raises EngineDead if the device did not stop: never silent
        finally:
            self._router.close(linger=1000)
            self._wake_rx.close(0)
            self._wake_tx.close(0)
        log.info("server stopped")


class BackgroundServer:
    """Runs a Server on a thread: for tests and for embedding the runtime in a program."""

    def __init__(self, server: Server):
        self.server = server
        self.error: BaseException | None = None  # what ended serve_forever, if not a clean stop
        self._thread = threading.Thread(target=self._serve, name="rl-frontend", daemon=True)

    def _serve(self) -> None:
        try:
            self.server.serve_forever()
        except BaseException as exc:  # kept for stop() to raise on the caller's thread
            self.error = exc
            log.error("server ended with an error: %r", exc)

    @property
    def address(self) -> str:
        return self.server.address

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the server; re-raises what ended it badly (EngineDead from a device that did not
        stop), and raises TimeoutError if it is still running after `timeout` seconds."""
        self.server.request_stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the server did not stop within {timeout} s")
        if self.error is not None:
            raise self.error
