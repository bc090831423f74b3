"""Client library for the ringleader wire protocol (sync `Client`, asyncio `AsyncClient`).

One DEALER socket per client. Replies are demultiplexed by request id into per-request
queues; `stats`/`pong` replies carry no id and are matched to callers in FIFO order
(the server answers one connection's frames in order).

Neither client hangs on a dead server: with work outstanding, a client that has no connection
for `connect_timeout` seconds, or hears nothing (not even the pong to its keep-alive ping) for
`reply_timeout` seconds, ends that work locally with code `disconnected`.  A stream that is
dropped unfinished (garbage-collected, closed, or its consuming task cancelled) aborts its
request on the server, so nobody pays for tokens no one reads.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import socket
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from ipc import protocol as P
from ipc.curve import HANDSHAKE_FAILED_EVENTS, ClientCurve, describe_handshake_failure, secure_client_socket

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
# Client-local error codes for a Done the server never sent (the request's fate is unknown).
ERR_DISCONNECTED = "disconnected"
ERR_CLIENT_CLOSED = "client_closed"
ERR_BAD_REPLY = "bad_reply"
_CLOSE_LINGER_MS = 200  # time to flush the aborts close() sends for requests still in flight
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_REPLY_TIMEOUT_S = 30.0
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS


@dataclass(slots=True)
class TokenChunk:
    token_ids: list[int]
    text: str | None = None


@dataclass(slots=True)
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error_code: str | None = None
    error_message: str | None = None
    timing: dict | None = None  # the server's view: queue_ms, ttft_ms, e2e_ms (when it sends them)

    @property
    def ok(self) -> bool:
        return self.finish_reason != P.FINISH_ERROR


# ---------------------------------------------------------------- shared helpers


def _check_request_id(request_id: Any) -> None:
    """Ids are checked locally: the server answers a bad id with an id-less error we could not route."""
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise TypeError(f"request_id must be a str or an int, got {type(request_id).__name__}")
    if isinstance(request_id, str) and not 1 <= len(request_id) <= P.Limits().max_id_len:
        raise ValueError(f"request_id must be 1..{P.Limits().max_id_len} characters")
    if isinstance(request_id, int) and not P.INT64_MIN <= request_id <= P.INT64_MAX:
        raise ValueError("request_id int must fit in int64")


def _generate_fields(
    prompt,
    prompt_ids,
    max_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    stop_token_ids,
    ignore_eos,
    priority,
    timeout_ms,
) -> dict:
    """Request fields as given: values are judged by the server, only shaped here so they encode."""
    msg: dict[str, Any] = {}
    if prompt is not None:
        msg["prompt"] = prompt
    if prompt_ids is not None:
        msg["prompt_ids"] = prompt_ids if isinstance(prompt_ids, list) else list(prompt_ids)
    msg.update(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop_token_ids=stop_token_ids if isinstance(stop_token_ids, list) else list(stop_token_ids),
        ignore_eos=ignore_eos,
        priority=priority,
    )
    if timeout_ms is not None:
        msg["timeout_ms"] = timeout_ms
    return msg


def _event_from_reply(obj: dict) -> TokenChunk | Done | None:
    """A token/done reply map -> TokenChunk/Done; None for a malformed token, an error Done for a malformed done."""
    try:
        if obj["op"] == P.OP_TOKEN:
            token_ids = obj.get("token_ids", [])
            text = obj.get("text")
            if not isinstance(token_ids, list) or (text is not None and not isinstance(text, str)):
                return None
            return TokenChunk(token_ids, text)
        usage = obj.get("usage") or {}
        error = obj.get("error") or {}
        return Done(
            finish_reason=obj.get("finish_reason", P.FINISH_ERROR),
            prompt_tokens=usage.get("prompt_tokens", 0),
            completion_tokens=usage.get("completion_tokens", 0),
            error_code=error.get("code"),
            error_message=error.get("message"),
            timing=obj.get("timing") if isinstance(obj.get("timing"), dict) else None,
        )
    except (AttributeError, KeyError, TypeError):
        pass
    if obj.get("op") == P.OP_DONE:
        return Done(P.FINISH_ERROR, 0, 0, ERR_BAD_REPLY, "malformed done message from the server")
    return None


def _routable_id(obj: dict) -> Any:
    rid = obj.get("id")
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


class _StreamState:
    """Accumulation shared by the sync and async streams."""

    def __init__(self, request_id: P.RequestId, timeout: float | None):
        self.id = request_id
        self.timeout = timeout
        self.done: Done | None = None
        self.token_ids: list[int] = []
        self._texts: list[str] = []

    @property
    def text(self) -> str | None:
        """Concatenated text of all chunks, None when the server sent no text (no tokenizer)."""
        return "".join(self._texts) if self._texts else None

    def _absorb(self, item: TokenChunk) -> TokenChunk:
        self.token_ids.extend(item.token_ids)
        if item.text is not None:
            self._texts.append(item.text)
        return item

    def _timeout_error(self, timeout: float | None) -> TimeoutError:
        return TimeoutError(f"request {self.id!r}: no reply from the server within {timeout} s")


def _local_done(code: str, message: str, stream: _StreamState) -> Done:
    return Done(P.FINISH_ERROR, 0, len(stream.token_ids), code, message)


class _Liveness:
    """When a client with work outstanding pings the server, and when it gives up on it.

    Shared by both clients; driven by their I/O loop with monotonic times.  Idle clients are never
    woken by it: `poll_interval` is None while nothing is outstanding.
    """

    def __init__(self, address: str, connect_timeout: float | None, reply_timeout: float | None):
        self.address = address
        self.connect_timeout = connect_timeout
        self.reply_timeout = reply_timeout
        self.connected = False
        self._quiet_since = time.monotonic()  # start of the current wait with nothing heard
        self._pinged = False
        self._busy = False

    def heard(self, now: float) -> None:
        self._quiet_since, self._pinged = now, False

    def on_connected(self, now: float) -> None:
        self.connected = True
        self.heard(now)

    def on_disconnected(self, now: float) -> None:
        self.connected = False
        self.heard(now)

    def poll_interval(self, busy: bool) -> float | None:
        limits = [t for t in (self.connect_timeout, self.reply_timeout) if t is not None]
        if not busy or not limits:
            return None
        return min(1.0, max(0.05, min(limits) / 4))

    def check(self, now: float, busy: bool) -> str | None:
        """ "ping" when a keep-alive ping is due, a failure message when the server is given up, else None."""
        if busy and not self._busy:
            self.heard(now)  # the clock starts when work starts, not at the last reply of long ago
        self._busy = busy
        if not busy:
            return None
        quiet = now - self._quiet_since
        if not self.connected:
            if self.connect_timeout is not None and quiet > self.connect_timeout:
                self.heard(now)
                return f"no connection to the server at {self.address} within {self.connect_timeout:g} s"
            return None
        if self.reply_timeout is None:
            return None
        if quiet > self.reply_timeout:
            self.heard(now)
            return f"no reply from the server at {self.address} within {self.reply_timeout:g} s"
        if quiet > self.reply_timeout / 3 and not self._pinged:
            self._pinged = True
            return "ping"
        return None


def _monitor_failure(event: dict, liveness: _Liveness) -> str | None:
    """Feeds a monitor event to the liveness clock; returns the message that ends outstanding
    work, or None."""
    kind = event["event"]
    if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        liveness.on_connected(time.monotonic())
        return None
    if kind == zmq.EVENT_DISCONNECTED:
        return "connection to the server was lost"
    if kind & HANDSHAKE_FAILED_EVENTS:
        return describe_handshake_failure(kind, event["value"])
    return None


# ---------------------------------------------------------------- sync client


class Stream(_StreamState):
    """Sync iterator of TokenChunk for one request; `done` is set when iteration ends.

    Dropping an unfinished stream (close(), leaving a `with` block, or garbage collection) aborts
    the request on the server."""

    def __init__(self, client: Client, request_id: P.RequestId, timeout: float | None):
        super().__init__(request_id, timeout)
        self._client = client
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

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
            self.done = item
            raise StopIteration
        return self._absorb(item)

    def __next__(self) -> TokenChunk:
        return self._next(self.timeout)

    def wait(self, timeout: float | None = None) -> Done:
        """Consume the rest of the stream; `timeout` bounds the whole wait (default: the per-chunk timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.done is None:
            remaining = self.timeout if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._next(remaining)
            except StopIteration:
                break
            except TimeoutError:
                raise self._timeout_error(timeout if timeout is not None else self.timeout) from None
        return self.done

    def abort(self) -> None:
        """Ask the server to stop; the stream still ends with a `done` (normally finish_reason "abort")."""
        if self.done is None:
            self._client._send_msg(P.abort_msg(self.id))

    def close(self) -> None:
        """Stop reading: an unfinished request is aborted and its later replies are dropped."""
        if self.done is None:
            self._client._abandon(self.id, None)
            self.done = _local_done(ERR_CLIENT_CLOSED, "stream closed before its end", self)


class _Waiter:
    """One pending stats/ping reply."""

    __slots__ = ("error", "event", "value")

    def __init__(self):
        self.event = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error
        self.event.set()


class Client:
    """Thread-safe sync client; only the background I/O thread touches the ZeroMQ socket.

    timeout: default wait of one call (a chunk, stats, ping), None waits on the liveness checks.
    connect_timeout / reply_timeout: see the module docstring; None turns either check off.
    curve: CURVE keys for a server started with --curve-secret-key (ipc.curve.ClientCurve).
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
        self.max_frame_bytes = max_frame_bytes
        self.last_error: dict | None = None  # latest id-less `error` op from the server
        self._lock = threading.Lock()
        self._streams: dict[P.RequestId, weakref.ref[Stream]] = {}
        self._abandoned: collections.deque[tuple[P.RequestId, Any]] = collections.deque()
        self._stats_waiters: collections.deque[_Waiter] = collections.deque()
        # (waiter, sent); waiter None is the client's own keep-alive ping
        self._ping_waiters: collections.deque[tuple[_Waiter | None, float]] = collections.deque()
        self._outgoing: collections.deque[bytes] = collections.deque()
        self._ids = itertools.count(1)
        self._closed = False
        self._stopping = False
        self._liveness = _Liveness(address, connect_timeout, reply_timeout)

        self._ctx = zmq.Context()  # private context: close() can terminate it
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # a ROUTER drops replies to a full pipe: never let ours fill
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(
            zmq.IMMEDIATE, 1
        )  # frames wait in our queue, not for a server that is not there
        if curve is not None:
            secure_client_socket(self._sock, curve)
        self._monitor = self._sock.get_monitor_socket(_MONITOR_EVENTS)
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
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        priority: int = 0,
        timeout_ms: int | None = None,
        request_id: P.RequestId | None = None,
        timeout: float | None = None,
    ) -> Stream:
        """Send a generate request and return its Stream (timeout: per chunk, default the client's;
        timeout_ms: the server ends the request with code `timeout` after this long)."""
        fields = _generate_fields(
            prompt,
            prompt_ids,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            stop_token_ids,
            ignore_eos,
            priority,
            timeout_ms,
        )
        if request_id is not None:
            _check_request_id(request_id)
        with self._lock:
            self._check_open()
            if request_id is None:
                request_id = next(self._ids)
                while request_id in self._streams:
                    request_id = next(self._ids)
            elif request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight on this client")
            frame = self._encode({"op": P.OP_GENERATE, "id": request_id, **fields})
            stream = Stream(self, request_id, self.timeout if timeout is None else timeout)
            self._streams[request_id] = weakref.ref(stream, self._on_stream_collected(request_id))
            self._outgoing.append(frame)
        self._wake()
        return stream

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Stream:
        """generate() and wait for the end; returns the finished Stream."""
        stream = self.generate(prompt, **kwargs)
        stream.wait()
        return stream

    def stats(self, timeout: float | None = None) -> dict:
        waiter = _Waiter()
        with self._lock:
            self._check_open()
            self._stats_waiters.append(waiter)
            self._outgoing.append(P.encode(P.stats_request_msg()))
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
            self._ping_waiters.append((waiter, sent))
            self._outgoing.append(P.encode(P.ping_msg()))
        self._wake()
        return self._wait(waiter, timeout, "ping") - sent

    def close(self) -> None:
        """Abort requests still in flight, stop the I/O thread, end every open stream locally."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for rid in self._streams:
                self._outgoing.append(P.encode(P.abort_msg(rid)))
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

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    # -- internals (any thread)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("client is closed")
        if not self._thread.is_alive():
            raise RuntimeError(
                "client I/O thread has stopped (see the logged exception); create a new Client"
            )

    def _encode(self, msg: dict) -> bytes:
        frame = P.encode(msg)
        if self.max_frame_bytes is not None and len(frame) > self.max_frame_bytes:
            raise ValueError(f"request encodes to {len(frame)} bytes; frame limit is {self.max_frame_bytes}")
        return frame

    def _send_msg(self, msg: dict) -> None:
        frame = P.encode(msg)
        with self._lock:
            if self._closed:
                return
            self._outgoing.append(frame)
        self._wake()

    def _on_stream_collected(self, request_id: P.RequestId):
        # Runs wherever the garbage collector runs, maybe under our lock: only a deque append and a wake.
        def collected(ref: weakref.ref) -> None:
            self._abandoned.append((request_id, ref))
            self._wake()

        return collected

    def _abandon(self, request_id: P.RequestId, ref: Any) -> None:
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

    def _busy(self) -> bool:
        return bool(self._streams or self._stats_waiters or any(w for w, _ in self._ping_waiters))

    def _fail_pending(self, code: str, message: str, waiter_error: BaseException) -> None:
        with self._lock:
            streams = [ref() for ref in self._streams.values()]
            self._streams.clear()
            waiters = list(self._stats_waiters) + [w for w, _ in self._ping_waiters if w is not None]
            self._stats_waiters.clear()
            self._ping_waiters.clear()
            self._outgoing.clear()  # requests for a server that is gone must not reach its successor
        for stream in streams:
            if stream is not None:
                stream._queue.put(_local_done(code, message, stream))
        for waiter in waiters:
            waiter.resolve(error=waiter_error)

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
                interval = self._liveness.poll_interval(self._busy())
                events = dict(poller.poll(None if interval is None else interval * 1000))
                if wake_fd in events:
                    self._drain_wake()
                if self._abandoned:
                    self._send_aborts_for_abandoned()
                blocked = self._flush_outgoing()
                if blocked != want_out:
                    want_out = blocked
                    poller.modify(sock, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
                if events.get(sock, 0) & zmq.POLLIN:
                    self._drain_socket()
                if self._monitor in events:
                    self._drain_monitor()
                self._check_liveness()
                if self._stopping:
                    break
        except Exception:
            log.exception("ringleader client I/O thread failed")
            self._fail_pending(
                ERR_DISCONNECTED, "client I/O thread failed", ConnectionError("client I/O failed")
            )
        finally:
            sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            sock.close()

    def _check_liveness(self) -> None:
        with self._lock:
            verdict = self._liveness.check(time.monotonic(), self._busy())
            if verdict == "ping":
                self._ping_waiters.append((None, time.monotonic()))
                self._outgoing.append(P.encode(P.ping_msg()))
        if verdict == "ping":
            self._flush_outgoing()
        elif verdict is not None:
            self._fail_pending(ERR_DISCONNECTED, verdict, ConnectionError(verdict))

    def _send_aborts_for_abandoned(self) -> None:
        with self._lock:
            while self._abandoned:
                rid, ref = self._abandoned.popleft()
                current = self._streams.get(rid)
                if current is None or (ref is not None and current is not ref):
                    continue  # finished already, or the id now belongs to a newer stream
                del self._streams[rid]
                self._outgoing.append(P.encode(P.abort_msg(rid)))

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
            self._liveness.heard(time.monotonic())
            self._dispatch(frame)

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            failure = _monitor_failure(event, self._liveness)
            if failure is not None:
                self._drain_socket()  # what arrived before the connection went is still news
                self._liveness.on_disconnected(time.monotonic())
                self._fail_pending(ERR_DISCONNECTED, failure, ConnectionError(failure))

    def _dispatch(self, frame: bytes) -> None:
        try:
            obj = P.decode_reply(frame)
        except P.FrameError:
            log.warning("ignoring a malformed frame from the server (%d bytes)", len(frame))
            return
        op = obj["op"]
        if op in (P.OP_TOKEN, P.OP_DONE):
            rid = _routable_id(obj)
            event = _event_from_reply(obj)
            with self._lock:
                ref = self._streams.pop(rid, None) if op == P.OP_DONE else self._streams.get(rid)
            stream = ref() if ref is not None else None
            if stream is not None and event is not None:
                stream._queue.put(event)
        elif op == P.OP_STATS:
            with self._lock:
                waiter = self._stats_waiters.popleft() if self._stats_waiters else None
            if waiter is not None:
                waiter.resolve(obj)
        elif op == P.OP_PONG:
            now = time.monotonic()
            with self._lock:
                entry = self._ping_waiters.popleft() if self._ping_waiters else None
            if entry is not None and entry[0] is not None:
                entry[0].resolve(now)
        elif op == P.OP_ERROR:
            self.last_error = obj
            log.warning("server rejected a frame: %s: %s", obj.get("code"), obj.get("message"))


# ---------------------------------------------------------------- asyncio client


class AsyncStream(_StreamState):
    """`async for chunk in stream`; `await stream.wait()` returns the Done.

    Cancelling the task that awaits it, `aclose()`, leaving an `async with` block, or garbage
    collection of an unfinished stream aborts the request on the server."""

    def __init__(self, client: AsyncClient, request_id: P.RequestId, timeout: float | None):
        super().__init__(request_id, timeout)
        self._client = client
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> AsyncStream:
        return self

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _next(self, timeout: float | None) -> TokenChunk:
        if self.done is not None:
            raise StopAsyncIteration
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:  # a distinct class before Python 3.11
            raise self._timeout_error(timeout) from None
        except asyncio.CancelledError:
            self._client._abandon(self.id, None)  # whoever wanted these tokens is gone
            raise
        if isinstance(item, Done):
            self.done = item
            raise StopAsyncIteration
        return self._absorb(item)

    async def __anext__(self) -> TokenChunk:
        return await self._next(self.timeout)

    async def wait(self, timeout: float | None = None) -> Done:
        """Consume the rest of the stream; `timeout` bounds the whole wait (default: the per-chunk timeout)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.done is None:
            remaining = self.timeout if deadline is None else max(0.0, deadline - loop.time())
            try:
                await self._next(remaining)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise self._timeout_error(timeout if timeout is not None else self.timeout) from None
        return self.done

    async def abort(self) -> None:
        if self.done is None and not self._client._closed:
            await self._client._send_frame(P.encode(P.abort_msg(self.id)))

    async def aclose(self) -> None:
        """Stop reading: an unfinished request is aborted and its later replies are dropped."""
        if self.done is None:
            self._client._abandon(self.id, None)
            self.done = _local_done(ERR_CLIENT_CLOSED, "stream closed before its end", self)


class AsyncClient:
    """asyncio client (zmq.asyncio); use from one event loop. The socket is created on first use.

    The options mean what they mean for `Client`."""

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
        self.max_frame_bytes = max_frame_bytes
        self.last_error: dict | None = None
        self._curve = curve
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._streams: dict[P.RequestId, weakref.ref[AsyncStream]] = {}
        self._stats_waiters: collections.deque[asyncio.Future] = collections.deque()
        # futures; None is the client's own keep-alive ping
        self._ping_waiters: collections.deque[asyncio.Future | None] = collections.deque()
        self._liveness = _Liveness(address, connect_timeout, reply_timeout)
        self._kick = asyncio.Event()  # wakes the liveness task when work starts
        self._ids = itertools.count(1)
        self._closed = False

    # -- public API

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Iterable[int] | None = None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        priority: int = 0,
        timeout_ms: int | None = None,
        request_id: P.RequestId | None = None,
        timeout: float | None = None,
    ) -> AsyncStream:
        self._ensure_started()
        fields = _generate_fields(
            prompt,
            prompt_ids,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            stop_token_ids,
            ignore_eos,
            priority,
            timeout_ms,
        )
        if request_id is None:
            request_id = next(self._ids)
            while request_id in self._streams:
                request_id = next(self._ids)
        else:
            _check_request_id(request_id)
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight on this client")
        frame = P.encode({"op": P.OP_GENERATE, "id": request_id, **fields})
        if self.max_frame_bytes is not None and len(frame) > self.max_frame_bytes:
            raise ValueError(f"request encodes to {len(frame)} bytes; frame limit is {self.max_frame_bytes}")
        stream = AsyncStream(self, request_id, self.timeout if timeout is None else timeout)
        # registered before sending so no reply can miss it
        self._streams[request_id] = weakref.ref(stream, self._on_stream_collected(request_id))
        self._kick.set()
        await self._send_frame(frame)
        return stream

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> AsyncStream:
        stream = await self.generate(prompt, **kwargs)
        await stream.wait()
        return stream

    async def stats(self, timeout: float | None = None) -> dict:
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        self._kick.set()
        await self._send_frame(P.encode(P.stats_request_msg()))
        reply = await self._wait(fut, timeout, "stats")
        reply.pop("op", None)
        return reply

    async def ping(self, timeout: float | None = None) -> float:
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        self._ping_waiters.append(fut)
        self._kick.set()
        sent = time.monotonic()
        await self._send_frame(P.encode(P.ping_msg()))
        return await self._wait(fut, timeout, "ping") - sent

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            for rid in list(self._streams):
                try:
                    await self._sock.send(P.encode(P.abort_msg(rid)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._fail_pending(ERR_CLIENT_CLOSED, "client closed", RuntimeError("client closed"))
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=_CLOSE_LINGER_MS)
        await asyncio.to_thread(self._ctx.term)  # term() blocks while the aborts flush

    async def __aenter__(self) -> AsyncClient:
        self._ensure_started()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    # -- internals

    def _ensure_started(self) -> None:
        if self._closed:
            raise RuntimeError("client is closed")
        if self._sock is not None:
            return
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 0)  # a ROUTER drops replies to a full pipe: never let ours fill
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            secure_client_socket(sock, self._curve)
        self._monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        sock.connect(self.address)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._tasks = [
            self._loop.create_task(self._recv_loop()),
            self._loop.create_task(self._monitor_loop()),
            self._loop.create_task(self._liveness_loop()),
        ]

    async def _send_frame(self, frame: bytes) -> None:
        if self._closed:
            raise RuntimeError("client is closed")
        await self._sock.send(frame)

    async def _wait(self, fut: asyncio.Future, timeout: float | None, what: str) -> Any:
        timeout = self.timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what}: no reply from the server within {timeout} s") from None

    def _on_stream_collected(self, request_id: P.RequestId):
        # The garbage collector may run on any thread: hand the abort to the client's loop.
        def collected(ref: weakref.ref) -> None:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._abandon, request_id, ref)
                except RuntimeError:
                    pass  # the loop closed in between: the server sees the disconnect instead

        return collected

    def _abandon(self, request_id: P.RequestId, ref: Any) -> None:
        """Forget a stream nobody reads and abort its request (ref None: whatever stream has the id)."""
        current = self._streams.get(request_id)
        if current is None or (ref is not None and current is not ref):
            return  # finished already, or the id now belongs to a newer stream
        del self._streams[request_id]
        if self._sock is not None and not self._closed:
            try:
                self._sock.send(P.encode(P.abort_msg(request_id)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # no connection: the server ends its requests when it sees the disconnect

    def _busy(self) -> bool:
        return bool(self._streams or self._stats_waiters or any(f is not None for f in self._ping_waiters))

    def _fail_pending(self, code: str, message: str, waiter_error: BaseException) -> None:
        streams = [ref() for ref in self._streams.values()]
        self._streams.clear()
        waiters = list(self._stats_waiters) + [f for f in self._ping_waiters if f is not None]
        self._stats_waiters.clear()
        self._ping_waiters.clear()
        for stream in streams:
            if stream is not None:
                stream._queue.put_nowait(_local_done(code, message, stream))
        for fut in waiters:
            if not fut.done():
                fut.set_exception(waiter_error)

    async def _recv_loop(self) -> None:
        while True:
            frame = await self._sock.recv()
            self._liveness.heard(time.monotonic())
            self._dispatch(frame)

    async def _monitor_loop(self) -> None:
        while True:
            event = await recv_monitor_message(self._monitor)
            failure = _monitor_failure(event, self._liveness)
            if failure is not None:
                # what arrived before the connection went is still news: let _recv_loop read it
                for _ in range(1000):
                    if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    await asyncio.sleep(0)
                self._liveness.on_disconnected(time.monotonic())
                self._fail_pending(ERR_DISCONNECTED, failure, ConnectionError(failure))

    async def _liveness_loop(self) -> None:
        while True:
            interval = self._liveness.poll_interval(self._busy())
            if interval is None:  # idle: sleep until work starts
                self._kick.clear()
                await self._kick.wait()
                continue
            await asyncio.sleep(interval)
            verdict = self._liveness.check(time.monotonic(), self._busy())
            if verdict == "ping":
                self._ping_waiters.append(None)
                try:
                    self._sock.send(P.encode(P.ping_msg()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    self._ping_waiters.pop()
            elif verdict is not None:
                self._fail_pending(ERR_DISCONNECTED, verdict, ConnectionError(verdict))

    def _dispatch(self, frame: bytes) -> None:
        try:
            obj = P.decode_reply(frame)
        except P.FrameError:
            log.warning("ignoring a malformed frame from the server (%d bytes)", len(frame))
            return
        op = obj["op"]
        if op in (P.OP_TOKEN, P.OP_DONE):
            rid = _routable_id(obj)
            event = _event_from_reply(obj)
            ref = self._streams.pop(rid, None) if op == P.OP_DONE else self._streams.get(rid)
            stream = ref() if ref is not None else None
            if stream is not None and event is not None:
                stream._queue.put_nowait(event)
        elif op == P.OP_STATS:
            fut = self._stats_waiters.popleft() if self._stats_waiters else None
            if fut is not None and not fut.done():  # a timed-out waiter still consumes its reply
                fut.set_result(obj)
        elif op == P.OP_PONG:
            fut = self._ping_waiters.popleft() if self._ping_waiters else None
            if fut is not None and not fut.done():
                fut.set_result(time.monotonic())
        elif op == P.OP_ERROR:
            self.last_error = obj
            log.warning("server rejected a frame: %s: %s", obj.get("code"), obj.get("message"))
