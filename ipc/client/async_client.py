"""The asyncio client: an I/O shell (zmq.asyncio, three tasks) around ringleader.ipc.client.core.ClientCore.

Import it from ringleader.ipc.client, which re-exports `AsyncClient` and `AsyncStream` beside the sync client.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from ringleader.ipc import protocol as P
from ringleader.ipc.client.connection import CLOSE_LINGER_MS, has_input, setup_dealer
from ringleader.ipc.client.core import (
    DEFAULT_ADDRESS,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_REPLY_TIMEOUT_S,
    ERR_CLIENT_CLOSED,
    Actions,
    ClientCore,
    CoreView,
    Done,
    StreamState,
    TokenChunk,
)
from ringleader.ipc.client.request_args import (
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

RECV_BATCH = 256  # frames taken per wake-up of the receive task without awaiting


class AsyncStream(StreamState):
    """`async for chunk in stream`; `await stream.wait()` returns the Done.

    Cancelling the task that awaits it, `aclose()`, leaving an `async with` block, or garbage
    collection of an unfinished stream aborts the request on the server."""

    def __init__(self, client: AsyncClient, request_id: P.RequestId, timeout: float | None):
        super().__init__(request_id, timeout)
        self._client = client
        self._queue: asyncio.Queue[TokenChunk | Done] = asyncio.Queue()

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
            task = asyncio.current_task()
            if task is not None and getattr(task, "cancelling", lambda: 0)():
                # Python 3.11's wait_for returns an item that arrived with the cancel and drops
                # the cancel (fixed in 3.12): the task was cancelled all the same
                raise asyncio.CancelledError
        except asyncio.TimeoutError:  # a distinct class before Python 3.11
            raise self._timeout_error(timeout) from None
        except asyncio.CancelledError:
            self._client._abandon(self.id, None)  # whoever wanted these tokens is gone
            raise
        if isinstance(item, Done):
            self._finish(item)
            raise StopAsyncIteration
        return self._absorb(item)

    async def __anext__(self) -> TokenChunk:
        return await self._next(self.timeout)

    async def wait(self, timeout: float | None = None) -> Done:
        """Consume the rest of the stream; `timeout` bounds the whole wait (default: the per-chunk timeout)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            done = self.done
            if done is not None:
                return done
            remaining = self.timeout if deadline is None else max(0.0, deadline - loop.time())
            try:
                await self._next(remaining)
            except StopAsyncIteration:
                pass  # the Done is in self.done now
            except TimeoutError:
                raise self._timeout_error(timeout if timeout is not None else self.timeout) from None

    async def abort(self, finish_reason: str = P.FINISH_ABORT, index: int | None = None) -> None:
        """See Stream.abort."""
        frame = self._abort_frame(finish_reason, index)
        if self.done is None and not self._client._closed:
            await self._client._send_frame(frame)

    async def aclose(self) -> None:
        """Stop reading: an unfinished request is aborted and its later replies are dropped."""
        if self.done is None:
            self._client._abandon(self.id, None)
            self._close_locally()


def _send_nowait(sock: zmq.asyncio.Socket, frame: bytes) -> bool:
    """Send without waiting; False when the frame could not be queued.

    zmq.asyncio reports a failed non-blocking send in the future it returns, not by raising."""
    try:
        sent = sock.send(frame, zmq.NOBLOCK)
    except zmq.ZMQError:
        return False
    if not isinstance(sent, asyncio.Future):
        return True
    if sent.done():
        return sent.exception() is None
    sent.add_done_callback(_retrieve)
    return True


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a send's error as seen: nobody awaits a non-blocking send, nothing more can be done."""
    if not fut.cancelled():
        fut.exception()


class AsyncClient(CoreView):
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
        self._core: ClientCore[AsyncStream, asyncio.Future[Any]] = ClientCore(
            address,
            connect_timeout=connect_timeout,
            reply_timeout=reply_timeout,
            max_frame_bytes=max_frame_bytes,
            now=time.monotonic(),
        )
        self._curve = curve
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._kick = asyncio.Event()  # wakes the liveness task when work starts
        self._closed = False

    # -- public API

    async def generate(
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
    ) -> AsyncStream:
        """See Client.generate."""
        self._ensure_started()
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
        stream = AsyncStream(self, rid, self.timeout if timeout is None else timeout)
        self._core.add_stream(stream, self._on_stream_collected)  # before sending: no reply can miss it
        self._kick.set()
        await self._send_frame(frame)
        return stream

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> AsyncStream:
        stream = await self.generate(prompt, **kwargs)
        await stream.wait()
        return stream

    async def stats(self, timeout: float | None = None, *, timeline_after_seq: int | None = None) -> dict:
        """As Client.stats."""
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        frame = self._core.add_stats_waiter(fut, timeline_after_seq)
        self._kick.set()
        await self._send_frame(frame)
        reply = await self._wait(fut, timeout, "stats")
        reply.pop("op", None)
        return reply

    async def ping(self, timeout: float | None = None) -> float:
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        sent = time.monotonic()
        frame = self._core.add_ping_waiter(fut, sent)
        self._kick.set()
        await self._send_frame(frame)
        return await self._wait(fut, timeout, "ping") - sent

    async def tokenize(
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
        """As Client.tokenize."""
        msg = tokenize_call(
            prompt,
            messages,
            add_special_tokens=add_special_tokens,
            return_token_strs=return_token_strs,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        return await self._op(msg, timeout, "tokenize")

    async def detokenize(
        self, token_ids: Iterable[int], *, skip_special_tokens: bool = False, timeout: float | None = None
    ) -> str:
        """As Client.detokenize."""
        msg = detokenize_msg(DetokenizeRequest(0, list(token_ids), skip_special_tokens))
        return await self._op(msg, timeout, "detokenize")

    async def tokenizer_info(self, timeout: float | None = None) -> dict:
        """As Client.tokenizer_info."""
        return await self._op(tokenizer_info_msg(0), timeout, "tokenizer_info")

    async def _op(self, msg: dict, timeout: float | None, what: str) -> Any:
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        rid, frame = self._core.add_op_waiter(fut, msg)
        self._kick.set()
        try:
            await self._send_frame(frame)
            return await self._wait(fut, timeout, what)
        finally:
            self._core.op_waiters.forget(rid)  # a timed-out or cancelled caller's reply finds no one

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        sock = self._sock
        if sock is not None:
            for frame in self._core.abort_all():
                try:
                    await sock.send(frame, zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._apply(
            self._core.fail_pending(ERR_CLIENT_CLOSED, "client closed", RuntimeError("client closed"))
        )
        if sock is not None:
            sock.disable_monitor()
            if self._monitor is not None:
                self._monitor.close(linger=0)
            sock.close(linger=CLOSE_LINGER_MS)
        await asyncio.to_thread(self._ctx.term)  # term() blocks while the aborts flush

    async def __aenter__(self) -> AsyncClient:
        self._ensure_started()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # -- internals

    def _ensure_started(self) -> zmq.asyncio.Socket:
        if self._closed:
            raise RuntimeError("client is closed")
        if self._sock is not None:
            return self._sock
        sock = self._ctx.socket(zmq.DEALER)
        monitor = setup_dealer(sock, self._curve, immediate=False)
        sock.connect(self.address)
        self._sock, self._monitor = sock, monitor
        self._loop = asyncio.get_running_loop()
        self._tasks = [
            self._loop.create_task(self._recv_loop(sock)),
            self._loop.create_task(self._monitor_loop(sock, monitor)),
            self._loop.create_task(self._liveness_loop(sock)),
        ]
        return sock

    async def _send_frame(self, frame: bytes) -> None:
        await self._ensure_started().send(frame)

    async def _wait(self, fut: asyncio.Future[Any], timeout: float | None, what: str) -> Any:
        timeout = self.timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what}: no reply from the server within {timeout} s") from None

    def _on_stream_collected(self, request_id: P.RequestId, ref: weakref.ref[AsyncStream]) -> None:
        # The garbage collector may run on any thread: hand the abort to the client's loop.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._abandon, request_id, ref)
            except RuntimeError:
                pass  # the loop closed in between: the server sees the disconnect instead

    def _abandon(self, request_id: P.RequestId, ref: weakref.ref[AsyncStream] | None) -> None:
        """Forget a stream nobody reads and abort its request (ref None: whatever stream has the id)."""
        frame = self._core.abandon(request_id, ref)
        if frame is not None and self._sock is not None and not self._closed:
            _send_nowait(
                self._sock, frame
            )  # no connection: the server ends its requests when it sees the disconnect

    def _apply(self, actions: Actions[AsyncStream, asyncio.Future[Any]]) -> None:
        """Deliver what the core decided (a timed-out waiter's future is done already: skipped)."""
        for stream, event in actions.events:
            stream._queue.put_nowait(event)
        for fut, value in actions.replies:
            if not fut.done():
                fut.set_result(value)
        for fut, error in actions.errors:
            if not fut.done():
                fut.set_exception(error)

    def _dispatch(self, frame: bytes) -> None:
        """One frame from the server (a hook: bench/lab/soak.py counts the frames it sees here)."""
        self._apply(self._core.on_frame(frame, time.monotonic()))

    async def _recv_loop(self, sock: zmq.asyncio.Socket) -> None:
        # A synchronous view of the same socket, for frames that have already arrived: taking
        # them costs no future and no trip through the event loop (a gateway with many streams
        # gets one frame per stream per step).  The awaited recv checks the socket before it
        # waits, so frames taken here never leave it waiting on an edge that has passed.
        ready: zmq.Socket = zmq.Socket.shadow(sock.underlying)
        while True:
            # 1. wait for a frame; 2. hand it to the core, deliver to its stream or waiter
            self._dispatch(await sock.recv())
            # 3. the same for up to RECV_BATCH frames that are already there
            for _ in range(RECV_BATCH):
                try:
                    frame = ready.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._dispatch(frame)

    async def _monitor_loop(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        while True:
            # 1. wait for a connection event (connected, lost, handshake refused)
            event = await recv_monitor_message(monitor)
            failure = self._core.on_monitor_event(event["event"], event["value"], time.monotonic())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:  # each (re)connection says hello
                await sock.send(self._core.hello_frame())
            if failure is None:
                continue
            # 2. on a failure, what arrived before the connection went is still news:
            #    let _recv_loop read it first
            for _ in range(1000):
                if not has_input(sock):
                    break
                await asyncio.sleep(0)
            # 3. end everything outstanding with code `disconnected`
            self._apply(self._core.connection_lost(failure, time.monotonic()))

    async def _liveness_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            # 1. idle: sleep until work starts (no timer wakes an idle client)
            interval = self._core.poll_interval()
            if interval is None:
                self._kick.clear()
                await self._kick.wait()
                continue
            # 2. busy: sleep one check interval
            await asyncio.sleep(interval)
            # 3. the check: send a keep-alive ping, or end outstanding work when the server is given up
            actions = self._core.tick(time.monotonic())
            for frame in actions.send:
                if not _send_nowait(sock, frame):
                    self._core.keepalive_not_sent()
            self._apply(actions)
