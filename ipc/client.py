"""Client library for the ringleader wire protocol (sync `Client`, asyncio `AsyncClient`).

One DEALER socket per client. Replies are demultiplexed by request id into per-request
queues; `stats`/`pong` replies carry no id and are matched to callers in FIFO order
(the server answers one connection's frames in order).
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
from dataclasses import dataclass
from typing import Any, Iterable

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from ipc import protocol as P

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
# Client-local error codes for a Done the server never sent (the request's fate is unknown).
ERR_DISCONNECTED = "disconnected"
ERR_CLIENT_CLOSED = "client_closed"
ERR_BAD_REPLY = "bad_reply"
_CLOSE_LINGER_MS = 200  # time to flush the aborts close() sends for requests still in flight


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
    prompt, prompt_ids, max_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos, priority
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


# ---------------------------------------------------------------- sync client


class Stream(_StreamState):
    """Sync iterator of TokenChunk for one request; `done` is set when iteration ends."""

    def __init__(self, client: "Client", request_id: P.RequestId, timeout: float | None):
        super().__init__(request_id, timeout)
        self._client = client
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def __iter__(self) -> "Stream":
        return self

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


class _Waiter:
    """One pending stats/ping reply."""

    __slots__ = ("event", "value", "error")

    def __init__(self):
        self.event = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error
        self.event.set()


class Client:
    """Thread-safe sync client; only the background I/O thread touches the ZeroMQ socket."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float | None = None,
        max_frame_bytes: int | None = P.DEFAULT_MAX_FRAME_BYTES,
    ):
        self.address = address
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes
        self.last_error: dict | None = None  # latest id-less `error` op from the server
        self._lock = threading.Lock()
        self._streams: dict[P.RequestId, Stream] = {}
        self._stats_waiters: collections.deque[_Waiter] = collections.deque()
        self._ping_waiters: collections.deque[tuple[_Waiter, float]] = collections.deque()
        self._outgoing: collections.deque[bytes] = collections.deque()
        self._ids = itertools.count(1)
        self._closed = False
        self._stopping = False

        self._ctx = zmq.Context()  # private context: close() can terminate it
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # a ROUTER drops replies to a full pipe: never let ours fill
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            self._sock.connect(address)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        # A socketpair wakes the I/O thread from any thread; zmq.Poller polls plain fds too.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._io_loop, name=f"ringleader-client {address}", daemon=True)
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
        request_id: P.RequestId | None = None,
        timeout: float | None = None,
    ) -> Stream:
        """Send a generate request and return its Stream (timeout: per chunk, default the client's)."""
        fields = _generate_fields(
            prompt, prompt_ids, max_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos, priority
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
            self._streams[request_id] = stream
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

    def __enter__(self) -> "Client":
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
            raise RuntimeError("client I/O thread has stopped (see the logged exception); create a new Client")

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

    def _fail_pending(self, code: str, message: str, waiter_error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            waiters = list(self._stats_waiters) + [w for w, _ in self._ping_waiters]
            self._stats_waiters.clear()
            self._ping_waiters.clear()
        for stream in streams:
            stream._queue.put(_local_done(code, message, stream))
        for waiter in waiters:
            waiter.resolve(error=waiter_error)

    # -- internals (I/O thread only)

    def _io_loop(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        want_out = False
        try:
            while True:
                events = dict(poller.poll())
                if self._wake_r in events:
                    self._drain_wake()
                blocked = self._flush_outgoing()
                if blocked != want_out:
                    want_out = blocked
                    poller.modify(sock, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
                if events.get(sock, 0) & zmq.POLLIN:
                    self._drain_socket()
                if self._monitor in events:
                    self._drain_monitor()
                if self._stopping:
                    break
        except Exception:  # noqa: BLE001 - keep the reason; close() still runs its cleanup
            log.exception("ringleader client I/O thread failed")
            self._fail_pending(ERR_DISCONNECTED, "client I/O thread failed", ConnectionError("client I/O failed"))
        finally:
            sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            sock.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _flush_outgoing(self) -> bool:
        """Send queued frames; True if the socket pushed back (HWM) and frames remain."""
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
            self._dispatch(frame)

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._fail_pending(
                    ERR_DISCONNECTED, "connection to the server was lost", ConnectionError("connection lost")
                )

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
                stream = self._streams.pop(rid, None) if op == P.OP_DONE else self._streams.get(rid)
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
            if entry is not None:
                entry[0].resolve(now)
        elif op == P.OP_ERROR:
            self.last_error = obj
            log.warning("server rejected a frame: %s: %s", obj.get("code"), obj.get("message"))


# ---------------------------------------------------------------- asyncio client


class AsyncStream(_StreamState):
    """`async for chunk in stream`; `await stream.wait()` returns the Done."""

    def __init__(self, client: "AsyncClient", request_id: P.RequestId, timeout: float | None):
        super().__init__(request_id, timeout)
        self._client = client
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> "AsyncStream":
        return self

    async def _next(self, timeout: float | None) -> TokenChunk:
        if self.done is not None:
            raise StopAsyncIteration
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:  # a distinct class before Python 3.11
            raise self._timeout_error(timeout) from None
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


class AsyncClient:
    """asyncio client (zmq.asyncio); use from one event loop. The socket is created on first use."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float | None = None,
        max_frame_bytes: int | None = P.DEFAULT_MAX_FRAME_BYTES,
    ):
        self.address = address
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes
        self.last_error: dict | None = None
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._streams: dict[P.RequestId, AsyncStream] = {}
        self._stats_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._ping_waiters: collections.deque[asyncio.Future] = collections.deque()
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
        request_id: P.RequestId | None = None,
        timeout: float | None = None,
    ) -> AsyncStream:
        self._ensure_started()
        fields = _generate_fields(
            prompt, prompt_ids, max_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos, priority
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
        self._streams[request_id] = stream  # registered before sending so no reply can miss it
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
        await self._send_frame(P.encode(P.stats_request_msg()))
        reply = await self._wait(fut, timeout, "stats")
        reply.pop("op", None)
        return reply

    async def ping(self, timeout: float | None = None) -> float:
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        self._ping_waiters.append(fut)
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
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - tasks are being torn down
                pass
        self._fail_pending(ERR_CLIENT_CLOSED, "client closed", RuntimeError("client closed"))
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=_CLOSE_LINGER_MS)
        await asyncio.to_thread(self._ctx.term)  # term() blocks while the aborts flush

    async def __aenter__(self) -> "AsyncClient":
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
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._recv_loop()), loop.create_task(self._monitor_loop())]

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

    def _fail_pending(self, code: str, message: str, waiter_error: BaseException) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        waiters = list(self._stats_waiters) + list(self._ping_waiters)
        self._stats_waiters.clear()
        self._ping_waiters.clear()
        for stream in streams:
            stream._queue.put_nowait(_local_done(code, message, stream))
        for fut in waiters:
            if not fut.done():
                fut.set_exception(waiter_error)

    async def _recv_loop(self) -> None:
        while True:
            frame = await self._sock.recv()
            self._dispatch(frame)

    async def _monitor_loop(self) -> None:
        while True:
            event = await recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._fail_pending(ERR_DISCONNECTED, "connection to the server was lost", ConnectionError("connection lost"))

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
            stream = self._streams.pop(rid, None) if op == P.OP_DONE else self._streams.get(rid)
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
