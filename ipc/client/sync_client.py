"""The sync client of the ringleader wire protocol (`Client`); import it from ringleader.ipc.client.

One DEALER socket per client. Replies are demultiplexed by request id into per-request
queues; `stats`/`pong` replies carry no id and are matched to callers in FIFO order
(the server answers one connection's frames in order).

Neither client hangs on a dead server: with work outstanding, a client that has no connection
for `connect_timeout` seconds, or hears nothing (not even the pong to its keep-alive ping) for
`reply_timeout` seconds, ends that work locally with code `disconnected`.  A stream that is
dropped unfinished (garbage-collected, closed, or its consuming task cancelled) aborts its
request on the server, so nobody pays for tokens no one reads.

Both clients are I/O shells around one sans-I/O core (ringleader.ipc.client.core.ClientCore); this module
holds the sync one, ringleader.ipc.client.async_client the asyncio one.
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ringleader.ipc import protocol as P
from ringleader.ipc.client.connection import CLOSE_LINGER_MS, setup_dealer
from ringleader.ipc.client.core import (
    DEFAULT_ADDRESS,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_REPLY_TIMEOUT_S,
    ERR_CLIENT_CLOSED,
    ERR_DISCONNECTED,
    Actions,
    ClientCore,
    CoreView,
    Done,
    StreamState,
    TokenChunk,
)
from ringleader.ipc.client.request_args import (
    check_request_id,
    resolve_extensions,
    resolve_sampling,
    resolve_structured,
)
from ringleader.ipc.curve import ClientCurve
from ringleader.ipc.sampling_params import SamplingParams
from ringleader.ipc.structured import StructuredSpec
from ringleader.ipc.tokenize_ops import (
    DetokenizeRequest,
    Tokenized,
    detokenize_msg,
    tokenize_call,
    tokenizer_info_msg,
)

__all__ = ["Client", "Stream"]

log = logging.getLogger(__name__)


class Stream(StreamState):
    """Sync iterator of TokenChunk for one request; `done` is set when iteration ends.

    Dropping an unfinished stream (close(), leaving a `with` block, or garbage collection) aborts
    the request on the server."""

    def __init__(self, client: Client, request_id: P.RequestId, timeout: float | None):
        super().__init__(request_id, timeout)
        self._client = client
        self._queue: queue.SimpleQueue[TokenChunk | Done] = queue.SimpleQueue()

    def __iter__(self) -> Stream:
        return self

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _next(self, timeout: float | None) -> TokenChunk:
        if self.done is not None:
            raise StopIteration
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise self._timeout_error(timeout) from None
        if isinstance(item, Done):
            self._finish(item)
            raise StopIteration
        return self._absorb(item)

    def __next__(self) -> TokenChunk:
        return self._next(self.timeout)

    def wait(self, timeout: float | None = None) -> Done:
        """Consume the rest of the stream; `timeout` bounds the whole wait (default: the per-chunk timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            done = self.done
            if done is not None:
                return done
            remaining = self.timeout if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._next(remaining)
            except StopIteration:
                pass  # the Done is in self.done now
            except TimeoutError:
                raise self._timeout_error(timeout if timeout is not None else self.timeout) from None

    def abort(self, finish_reason: str = P.FINISH_ABORT, index: int | None = None) -> None:
        """Ask the server to stop; the stream still ends with a `done`, whose finish_reason is
        normally `finish_reason`: "abort", or "stop" when the caller found its own stop (a request
        that ended anyway keeps its own reason).  index: stop only that choice (n > 1); the
        others go on, and its last chunk carries its finish_reason."""
        frame = self._abort_frame(finish_reason, index)
        if self.done is None:
            self._client._send_frame(frame)

    def close(self) -> None:
        """Stop reading: an unfinished request is aborted and its later replies are dropped."""
        if self.done is None:
            self._client._abandon(self.id, None)
            self._close_locally()


class _Waiter:
    """One pending stats/ping reply."""

    __slots__ = ("error", "event", "value")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error
        self.event.set()


class Client(CoreView):
    """Thread-safe sync client; only the background I/O thread touches the ZeroMQ socket.

    timeout: default wait of one call (a chunk, stats, ping), None waits on the liveness checks.
    connect_timeout / reply_timeout: see the module docstring; None turns either check off.
    curve: CURVE keys for a server started with --curve-secret-key (ringleader.ipc.curve.ClientCurve).

    The core (ringleader.ipc.client.core.ClientCore) is touched only under `_lock`; frames for the server wait
    in `_outgoing` until the I/O thread sends them.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float | None = None,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S,
        reply_timeout: float | None = DEFAULT_REPLY_TIMEOUT_S,
        max_frame_bytes: int | None = P.DEFAULT_MAX_FRAME_BYTES,
        curve: ClientCurve | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self._core: ClientCore[Stream, _Waiter] = ClientCore(
            address,
            connect_timeout=connect_timeout,
            reply_timeout=reply_timeout,
            max_frame_bytes=max_frame_bytes,
            now=time.monotonic(),
        )
        self._lock = threading.Lock()
        # (id, ref) of dropped streams, appended without the lock (the garbage collector may hold it)
        self._abandoned: collections.deque[tuple[P.RequestId, weakref.ref[Stream] | None]] = (
            collections.deque()
        )
        self._outgoing: collections.deque[bytes] = collections.deque()
        self._closed = False
        self._stopping = False

        self._ctx = zmq.Context()  # private context: close() can terminate it
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor = setup_dealer(self._sock, curve, immediate=True)
        try:
            self._sock.connect(address)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        # A socketpair wakes the I/O thread from any thread; zmq.Poller reports it by file descriptor.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(
            target=self._io_loop, name=f"ringleader-client {address}", daemon=True
        )
        self._thread.start()

    # -- public API

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Iterable[int] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        sampling: SamplingParams | None = None,
        priority: int = 0,
        timeout_ms: int | None = None,
        detokenize: bool = True,
        structured: StructuredSpec | Mapping[str, Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        request_id: P.RequestId | None = None,
        timeout: float | None = None,
        **sampling_fields: Any,
    ) -> Stream:
        """Send a generate request and return its Stream (timeout: per chunk, default the client's;
        timeout_ms: the server ends the request with code `timeout` after this long).

        The input is one of `prompt` (text), `prompt_ids` (token ids) or `messages` (chat turns,
        [{"role", "content"}, ...], rendered by the model's chat template on the server). The
        sampling settings are `sampling` or SamplingParams fields as keywords, not both; without
        max_tokens the request runs to the end of the context (at most the server's
        --default-max-tokens). `structured` (protocol 1.8) constrains the output: a StructuredSpec
        or {"json": schema}, {"regex": pattern}, {"choice": [...]} or {"json_object": True}; a
        bad one raises ValueError naming the field, before anything is sent.

        Protocol 1.9 (vLLM's request extensions, sent only where they differ from the defaults):
        with `messages`, chat_template_kwargs (extra template variables, e.g.
        {"enable_thinking": False}), add_generation_prompt (open the assistant's turn) and
        continue_final_message (continue the final, assistant's, message; needs
        add_generation_prompt=False); skip_special_tokens (False: special tokens spelled out in
        the text) and spaces_between_special_tokens (accepted; this server's tokenizers ignore
        it, as transformers' fast ones do). min_tokens is a sampling field (SamplingParams). A bad
        value raises ValueError naming the field; priority and timeout_ms too, outside the
        server's ranges."""
        params = resolve_sampling(sampling, sampling_fields)
        spec = resolve_structured(structured)
        extensions = resolve_extensions(
            messages,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        if request_id is not None:
            check_request_id(request_id)  # the caller's mistake whatever state the client is in
        with self._lock:
            self._check_open()
            rid, frame = self._core.prepare_generate(
                request_id,
                prompt,
                prompt_ids,
                params,
                priority,
                timeout_ms,
                messages,
                detokenize,
                spec,
                extensions,
            )
            stream = Stream(self, rid, self.timeout if timeout is None else timeout)
            self._core.add_stream(stream, self._on_stream_collected)
            self._outgoing.append(frame)
        self._wake()
        return stream

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Stream:
        """generate() and wait for the end; returns the finished Stream."""
        stream = self.generate(prompt, **kwargs)
        stream.wait()
        return stream

    def stats(self, timeout: float | None = None, *, timeline_after_seq: int | None = None) -> dict:
        """The server's stats (docs/protocol.md); timeline_after_seq (1.6): its device timeline's
        figures cover only the steps after that one (the `steps` counter read earlier)."""
        waiter = _Waiter()
        with self._lock:
            self._check_open()
            self._outgoing.append(self._core.add_stats_waiter(waiter, timeline_after_seq))
        self._wake()
        reply = self._wait(waiter, timeout, "stats")
        reply.pop("op", None)
        return reply

    def ping(self, timeout: float | None = None) -> float:
        """Round trip to the server in seconds."""
        waiter = _Waiter()
        with self._lock:
            self._check_open()
            sent = time.monotonic()
            self._outgoing.append(self._core.add_ping_waiter(waiter, sent))
        self._wake()
        return self._wait(waiter, timeout, "ping") - sent

    def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        add_special_tokens: bool | None = None,
        return_token_strs: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        timeout: float | None = None,
    ) -> Tokenized:
        """The token ids a generate of `prompt` (or of `messages`, rendered with the same options
        as generate's) runs on, and the server's max_context (protocol 1.10).  add_special_tokens
        False: a prompt's text alone, without the tokenizer's BOS (None: as generate does);
        return_token_strs: each token's text too.  A refusal raises TokenizeError (a ValueError
        whose message starts with the field), judged before sending where it can be."""
        msg = tokenize_call(
            prompt,
            messages,
            add_special_tokens=add_special_tokens,
            return_token_strs=return_token_strs,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        return self._op(msg, timeout, "tokenize")

    def detokenize(
        self, token_ids: Iterable[int], *, skip_special_tokens: bool = False, timeout: float | None = None
    ) -> str:
        """The text of `token_ids` (1.10), special tokens spelled out unless skip_special_tokens."""
        msg = detokenize_msg(DetokenizeRequest(0, list(token_ids), skip_special_tokens))
        return self._op(msg, timeout, "detokenize")

    def tokenizer_info(self, timeout: float | None = None) -> dict:
        """The model's tokenizer (1.10): its special tokens (bos_token, eos_token, eos_token_ids,
        pad_token, ...), its chat template's source, max_context and vocab_size."""
        return self._op(tokenizer_info_msg(0), timeout, "tokenizer_info")

    def _op(self, msg: dict, timeout: float | None, what: str) -> Any:
        waiter = _Waiter()
        with self._lock:
            self._check_open()
            rid, frame = self._core.add_op_waiter(waiter, msg)
            self._outgoing.append(frame)
        self._wake()
        try:
            return self._wait(waiter, timeout, what)
        finally:
            with self._lock:
                self._core.op_waiters.forget(rid)  # a timed-out caller's reply finds no one

    def close(self) -> None:
        """Abort requests still in flight, stop the I/O thread, end every open stream locally."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._outgoing.extend(self._core.abort_all())
            self._stopping = True
        self._wake()
        self._thread.join()
        self._fail_pending(ERR_CLIENT_CLOSED, "client closed", RuntimeError("client closed"))
        self._wake_r.close()
        self._wake_w.close()
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals (any thread)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("client is closed")
        if not self._thread.is_alive():
            raise RuntimeError(
                "client I/O thread has stopped (see the logged exception); create a new Client"
            )

    def _send_frame(self, frame: bytes) -> None:
        with self._lock:
            if self._closed:
                return
            self._outgoing.append(frame)
        self._wake()

    def _on_stream_collected(self, request_id: P.RequestId, ref: weakref.ref[Stream]) -> None:
        # Runs wherever the garbage collector runs, maybe under our lock: only a deque append and a wake.
        self._abandoned.append((request_id, ref))
        self._wake()

    def _abandon(self, request_id: P.RequestId, ref: weakref.ref[Stream] | None) -> None:
        """Forget a stream nobody reads and abort its request (ref None: whatever stream has the id)."""
        self._abandoned.append((request_id, ref))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe already holds a wake-up byte (or we are closing)

    def _wait(self, waiter: _Waiter, timeout: float | None, what: str) -> Any:
        timeout = self.timeout if timeout is None else timeout
        if not waiter.event.wait(timeout):
            raise TimeoutError(f"{what}: no reply from the server within {timeout} s")
        if waiter.error is not None:
            raise waiter.error
        return waiter.value

    def _step(self, step: Callable[[], Actions[Stream, _Waiter]]) -> Actions[Stream, _Waiter]:
        """Run one core step under the lock, queue its frames, then deliver its results outside the lock."""
        with self._lock:
            actions = step()
            if actions.failed:
                self._outgoing.clear()  # requests for a server that is gone must not reach its successor
            self._outgoing.extend(actions.send)
        for stream, event in actions.events:
            stream._queue.put(event)
        for waiter, value in actions.replies:
            waiter.resolve(value)
        for waiter, error in actions.errors:
            waiter.resolve(error=error)
        return actions

    def _fail_pending(self, code: str, message: str, waiter_error: BaseException) -> None:
        self._step(partial(self._core.fail_pending, code, message, waiter_error))

    # -- internals (I/O thread only)

    def _io_loop(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        wake_fd = self._wake_r.fileno()
        poller.register(wake_fd, zmq.POLLIN)  # plain sockets come back from poll() as their fd
        poller.register(self._monitor, zmq.POLLIN)
        want_out = False
        try:
            while True:
                # 1. sleep until a frame, a wake-up or a monitor event; with work outstanding, at
                #    most until the next liveness check (an idle client sleeps without a timeout)
                with self._lock:
                    interval = self._core.poll_interval()
                events = dict(poller.poll(None if interval is None else round(interval * 1000)))
                # 2. empty the wake-up pipe (the calls that wrote to it left their work in our deques)
                if wake_fd in events:
                    self._drain_wake()
                # 3. dropped streams: forget them, queue their aborts
                if self._abandoned:
                    self._send_aborts_for_abandoned()
                # 4. send what is queued; watch POLLOUT only while the socket pushes back
                blocked = self._flush_outgoing()
                if blocked != want_out:
                    want_out = blocked
                    poller.modify(sock, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
                # 5. read every reply that arrived and hand it to its stream or waiter
                if events.get(sock, 0) & zmq.POLLIN:
                    self._drain_socket()
                # 6. connection events: connected, lost, handshake refused
                if self._monitor in events:
                    self._drain_monitor()
                # 7. liveness: a keep-alive ping, or giving the server up
                self._check_liveness()
                # 8. close() asked us to stop; it may have queued its aborts after step 4 ran, so send them now
                if self._stopping:
                    self._flush_outgoing()
                    break
        except Exception:
            log.exception("ringleader client I/O thread failed")
            self._fail_pending(
                ERR_DISCONNECTED, "client I/O thread failed", ConnectionError("client I/O failed")
            )
        finally:
            sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
            sock.disable_monitor()
            self._monitor.close(linger=0)
            sock.close()

    def _check_liveness(self) -> None:
        actions = self._step(lambda: self._core.tick(time.monotonic()))
        if actions.send:  # the keep-alive ping goes out now, not after the next poll
            self._flush_outgoing()

    def _send_aborts_for_abandoned(self) -> None:
        with self._lock:
            while self._abandoned:
                frame = self._core.abandon(*self._abandoned.popleft())
                if frame is not None:
                    self._outgoing.append(frame)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _flush_outgoing(self) -> bool:
        """Send queued frames; True if the socket pushed back (no connection yet) and frames remain."""
        while self._outgoing:
            frame = self._outgoing.popleft()
            try:
                self._sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                self._outgoing.appendleft(frame)
                return True
        return False

    def _drain_socket(self) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._step(partial(self._core.on_frame, frame, time.monotonic()))

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            with self._lock:
                failure = self._core.on_monitor_event(event["event"], event["value"], time.monotonic())
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:  # each (re)connection says hello
                    self._outgoing.appendleft(self._core.hello_frame())
            if failure is not None:
                self._drain_socket()  # what arrived before the connection went is still news
                self._step(partial(self._core.connection_lost, failure, time.monotonic()))
