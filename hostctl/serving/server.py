"""The host process: a ROUTER frontend, admission into the rings, completion routing, shutdown.

Threads: the frontend thread owns the ROUTER socket, the SQ and the abort ring (decode, validate,
tokenize, admit, abort, time out, send); the completion thread owns the CQ (see completions.py);
the backend runs the scheduler.  Every accepted generate gets exactly one `done`, made by
Finisher.end (finisher.py): from the device (stop, length, abort, or an abort the host turned into
an error such as timeout), from the watchdog (engine_dead), or from the host for requests the
device never saw.  A generate that is never accepted gets reject_frame's `done` instead.

Per-frame work is O(1) in the number of requests in flight: the request table indexes requests
by client, a client found gone is handled once (its later frames are dropped, not re-examined),
and deadlines sit in a heap.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from ringleader.hostctl.serving.admission import Admission
from ringleader.hostctl.serving.completions import CompletionRouter, Outbox
from ringleader.hostctl.serving.config import ServerConfig
from ringleader.hostctl.serving.deadlines import Deadlines
from ringleader.hostctl.serving.finisher import Finisher, Frame, reject_frame
from ringleader.hostctl.serving.frontend_socket import FrontendSocket
from ringleader.hostctl.serving.inflight import Ending, Family, InFlight, RequestTable
from ringleader.hostctl.serving.metrics import ServerMetrics, thread_cpu_seconds
from ringleader.hostctl.serving.snapshot import ServerSnapshot, read_snapshot
from ringleader.ipc import protocol
from ringleader.ipc.backend import Backend
from ringleader.ipc.client.core import DEFAULT_ADDRESS
from ringleader.ipc.sampling_params import UINT64_MAX, SamplingParams

log = logging.getLogger("ringleader.server")

RECV_BATCH = 256  # frames taken per wake-up before admitting them together
MAX_BACKLOG_FRAMES = 65536  # per client; beyond it the client is treated as gone
GONE_SWEEP_S = 1.0  # how often clients marked gone with nothing left in flight are forgotten
ABORT_WAIT_S = 1.5  # at shutdown: how long the device gets to end what was aborted


def _random_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")


class Server:
    """The host process's server over one backend, shaped by a ServerConfig (hostctl/serving/config.py:
    limits, admission, time-outs, the stop), given as `config` or as its fields by name.
    bind: the ROUTER's address, or a FrontendSocket bound already (serve binds before the model
    loads).  curve: CURVE keys (ringleader.ipc.curve.ServerCurve); then only clients whose public
    key is authorized get through.  A request's own timeout_ms bounds its whole life, the config's
    max_queue_ms its wait for a first token.  Shutdown takes at most drain_timeout_s + 5 s,
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
        )
        self.table = RequestTable()
        self.metrics = ServerMetrics()
        self.finisher = Finisher(self.table, self.metrics, backend.rings.arena)
        self.admission = Admission(
            backend.rings,
            self.table,
            max_queued=config.max_queued,
            max_queued_tokens=config.max_queued_tokens,
        )
        self._deadlines = Deadlines(self.table, config.max_queue_ms)
        self.timed_out = 0  # frontend thread only
        self._ctx = frontend.context
        self._socket = frontend.socket  # the frontend thread's alone
        self.address = frontend.address
        wake_addr = f"inproc://rl-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(wake_addr)
        self._wake_lock = threading.Lock()
        self._wake_pending = False  # under _wake_lock (both threads)
        self.outbox = Outbox(self._notify_frontend)  # completion thread -> frontend thread
        assert config.watchdog_s is not None  # resolved() filled it in
        self.router = CompletionRouter(
            backend, self.table, self.finisher, self.outbox, self.metrics, config.watchdog_s
        )
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        # the rest is the frontend thread's alone
        self._backlog: dict[bytes, deque[bytes]] = defaultdict(deque)  # frames zmq had no room for
        self._gone: set[bytes] = set()  # clients found disconnected: frames to them are dropped
        self._next_gone_sweep = 0.0
        self._stop_requested = threading.Event()
        # families whose later choices may now enter the queue (Family.gate; any thread appends)
        self._gates_open: deque[Family] = deque()
        cfg = backend.rings.config
        # a prompt longer than a page shares its full pages' KV through the prefix cache (the
        # page of its last token runs again: its row samples)
        self._shared_prefill_len = cfg.page_size if cfg.prefix_caching else 0
        self.serving = threading.Event()  # the backend and the completion thread have started
        self._frontend_tid: int | None = None
        self._accepting = True

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
        if self.admission.waits_for_ring_space() or self._backlog:
            return 1
        next_ns = self._deadlines.next_ns()
        if next_ns is not None:
            until = (next_ns - time.perf_counter_ns()) // 1_000_000
            return int(min(100, max(1, until + 1)))
        return 100

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
        # 1. poll the socket and the wake-up pipe; drain the wake-ups
        ready = dict(self._poller.poll(timeout_ms))
        if self._wake_rx in ready:
            with self._wake_lock:
                self._wake_pending = False
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
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
        # 4. admission pump: choices whose first one's prompt is now cached join the queue;
        #    held-back aborts, then queued requests into the SQ
        while self._gates_open:
            for member in self._gates_open.popleft().members[1:]:
                self.admission.release_gated(member)
        self.admission.pump()
        # 5. publish what was written to the rings, and wake the device if anything was
        if self.admission.publish():
            self.backend.wake()
        # 6. send what the completion thread put in the outbox
        self._send_all(self.outbox.take_all())
        # 7. retry frames zmq had no room for
        self._retry_backlog()
        # 8. forget gone clients with nothing left in flight
        self._sweep_gone()

    def _handle_parts(self, parts: list[bytes]) -> None:
        client = parts[0]
        self._gone.discard(client)  # it is back (a client may reconnect under its identity)
        if len(parts) != 2:
            self.metrics.bad_frames += 1
            self._send(
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
            self._send(client, protocol.encode(protocol.error_msg(protocol.ERR_BAD_REQUEST, str(exc))))
            return
        except protocol.BadRequest as exc:
            self._reject(client, exc.id, protocol.ERR_BAD_REQUEST, exc.message)
            return
        if isinstance(request, protocol.GenerateRequest):
            self._on_generate(client, request)
        elif isinstance(request, protocol.AbortRequest):
            for req in self.table.find(client, request.id):
                if request.index is None or request.index == req.index:
                    self._abort(req, finish_reason=request.finish_reason)
        elif isinstance(request, protocol.StatsRequest):
            self._send(client, protocol.encode(protocol.stats_msg(self.stats(request.timeline_after_seq))))
        elif isinstance(request, protocol.PingRequest):
            self._send(client, protocol.encode(protocol.pong_msg()))

    def _reject(self, client: bytes, request_id: protocol.RequestId | None, code: str, message: str) -> None:
        """Answers a generate that is never accepted (it has no table entry): counts it, sends
        reject_frame's `done`."""
        self.metrics.rejected(code)
        self._send(client, reject_frame(request_id, code, message))

    def _on_generate(self, client: bytes, r: protocol.GenerateRequest) -> None:
        if self.table.contains(client, r.id):
            self._reject(
                client, r.id, protocol.ERR_DUPLICATE_ID, f"id: {r.id!r} is already in flight for this client"
            )
            return
        dead_reason = self.router.dead_reason
        if not self._accepting:
            self._reject(
                client, r.id, protocol.ERR_SHUTDOWN, "server is not accepting requests: shutting down"
            )
            return
        if dead_reason is not None:
            message = f"server is not accepting requests: {dead_reason}"
            self._reject(client, r.id, protocol.ERR_ENGINE_DEAD, message)
            return
        cap = self.config.max_inflight_per_client
        if cap and self.table.count_of(client) >= cap:
            self._reject(
                client,
                r.id,
                protocol.ERR_OVERLOADED,
                f"overloaded: this client already has {cap} requests in flight "
                f"(the server's --max-inflight-per-client)",
            )
            return
        try:
            prompt_ids, field = self._prompt_ids(r)
            # None (the rest of the context) becomes an int here: the ring holds one
            max_tokens = protocol.resolve_max_tokens(
                len(prompt_ids), r.sampling.max_tokens, self.limits, request_id=r.id, field=field
            )
        except protocol.BadRequest as exc:
            self._reject(client, r.id, protocol.ERR_BAD_REQUEST, exc.message)
            return
        n = r.sampling.n
        if not self.admission.can_accept(len(prompt_ids), n):
            self._reject(
                client,
                r.id,
                protocol.ERR_OVERLOADED,
                f"overloaded: {self.admission.queued} requests already wait for a slot",
            )
            return
        sampling = r.sampling
        if sampling.max_tokens != max_tokens:
            sampling = sampling.with_max_tokens(max_tokens)
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        if n == 1:
            if sampling.seed is None:
                sampling = sampling.with_seed(_random_seed())
            req = self.table.add(
                client,
                r.id,
                prompt_ids=prompt,
                sampling=sampling,
                priority=r.priority,
                detokenizer=self._new_detokenizer(),
            )
            self._deadlines.arm(req, r.timeout_ms)
            self.admission.submit(req)  # can_accept was checked just above
        else:
            self._submit_choices(client, r, prompt, sampling)
        self.metrics.accepted += n  # a request of n choices counts as n, as each ends on its own

    def _submit_choices(
        self, client: bytes, r: protocol.GenerateRequest, prompt: np.ndarray, sampling: SamplingParams
    ) -> None:
        """A request with n > 1: n choices, choice i with seed + i (each its own random seed
        when none was given), under the request's id.  Where the prefix cache can share the
        prompt, choices 1..n-1 wait until the first one's prompt is cached, then prefill only
        what the cache does not hold (the last partial page)."""
        base = sampling.seed
        seeds = [_random_seed() if base is None else (base + i) & UINT64_MAX for i in range(sampling.n)]
        family = self.table.add_family(
            client,
            r.id,
            [sampling.with_seed(seed) for seed in seeds],
            prompt_ids=prompt,
            priority=r.priority,
        )
        shared = 0 < self._shared_prefill_len < len(prompt)
        if shared:
            family.gate = self._open_gate
        for member in family.members:
            member.detokenizer = self._new_detokenizer()
            self._deadlines.arm(member, r.timeout_ms)
            if member.index == 0 or not shared:
                self.admission.submit(member)  # can_accept counted all n
            else:
                self.admission.hold_gated(member)

    def _open_gate(self, family: Family) -> None:
        """Family.gate, from any thread: the frontend queues the family's later choices."""
        self._gates_open.append(family)
        self._notify_frontend()

    def _new_detokenizer(self):
        factory = self.backend.model.new_detokenizer
        return factory() if factory is not None else None

    def _prompt_ids(self, r: protocol.GenerateRequest) -> tuple[list[int], str]:
        """(prompt token ids, the field they came from); BadRequest naming that field when the
        model cannot turn it into tokens."""
        model = self.backend.model
        if r.prompt_ids is not None:
            return r.prompt_ids, "prompt_ids"
        if r.messages is not None:
            if model.encode_chat is None:
                raise protocol.BadRequest(
                    r.id, "messages", "this model has no chat template; send prompt or prompt_ids"
                )
            try:
                return model.encode_chat(r.messages), "messages"
            except ValueError as exc:  # the template refused the conversation
                raise protocol.BadRequest(r.id, "messages", str(exc)) from None
        if model.tokenizer is None:
            raise protocol.BadRequest(r.id, "prompt", "this model has no tokenizer; send prompt_ids")
        assert r.prompt is not None  # the protocol accepts a generate with exactly one of the three
        return model.tokenizer.encode(r.prompt), "prompt"

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
        self._send_all(self.finisher.end(req, reason, code, message))

    def _expire_deadlines(self) -> None:
        for req, message in self._deadlines.expired():
            self.timed_out += 1
            self._abort(req, (protocol.ERR_TIMEOUT, message))

    # ---- sending -----------------------------------------------------------------------------
    def _send_all(self, frames: list[Frame]) -> None:
        for client, frame in frames:
            self._send(client, frame)

    def _send(self, client: bytes, frame: bytes) -> None:
        if client in self._gone:
            return  # nobody is there to read it; its requests were aborted when it went
        backlog = self._backlog.get(client)
        if backlog:  # keep per-client order behind frames that are already waiting
            backlog.append(frame)
            if len(backlog) > MAX_BACKLOG_FRAMES:
                self._client_gone(client, "client does not read its replies")
            return
        try:
            self._socket.send_multipart([client, frame], zmq.NOBLOCK)
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
                    self._socket.send_multipart([client, q[0]], zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    self._client_gone(client, "client disconnected")
                    break
                q.popleft()
            if not q:
                self._backlog.pop(client, None)

    def _client_gone(self, client: bytes, why: str) -> None:
        """Aborts everything the client has in flight, once, so its slots go to others."""
        self._backlog.pop(client, None)
        self._gone.add(client)
        reqs = self.table.of_client(client)
        if reqs:
            log.info("client %s: %s; aborting its %d requests", client.hex(), why, len(reqs))
        for req in reqs:
            self._abort(req)

    def _sweep_gone(self) -> None:
        """Forgets gone clients whose requests have all ended (bounds the set)."""
        if self._gone and not len(self.table):
            self._gone.clear()  # nothing in flight, so no frame is left to drop for any of them
            return
        now = time.monotonic()
        if now < self._next_gone_sweep or not self._gone:
            return
        self._next_gone_sweep = now + GONE_SWEEP_S
        self._gone = {c for c in self._gone if self.table.count_of(c)}

    # ---- stats, the exporter's snapshot and shutdown -----------------------------------------
    def stats(self, timeline_after_seq: int = 0) -> dict:
        """timeline_after_seq: the backend's device timeline covers the steps after it (1.6)."""
        s = self.metrics.snapshot()
        s.update(
            in_flight=len(self.table),
            host_queue=self.admission.queued,
            in_device=self.table.in_sq,  # wire name; requests in the SQ or on the device
            device_window=self.admission.device_window,
            timed_out=self.timed_out,
            arena_used=self.backend.rings.arena.used(),
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
        self._accepting = False
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
        self._send_all(self.outbox.take_all())
        self._retry_backlog()
        self.router.stop()
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
        self._accepting = False
        try:
            self.backend.stop()
        except Exception:
            log.exception("the backend did not stop after its start failed")
        finally:
            self._close_sockets(linger_ms=0)

    def _close_sockets(self, linger_ms: int) -> None:
        self._wake_rx.close(0)
        self._wake_tx.close(0)
        self._frontend.close(linger_ms)
