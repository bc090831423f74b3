"""The sans-I/O core shared by the sync `Client` (ringleader.ipc.client) and the `AsyncClient` (ringleader.ipc.client.async_client).

`ClientCore` keeps a client's bookkeeping: request ids, the registry of open streams (weak
references: a stream nobody holds any more is aborted), the stats/ping callers waiting for an
id-less reply, and the liveness clock.  It takes what the I/O shell observed (a reply frame, a
monitor event, a clock reading, a stream that was dropped) and answers with `Actions`: what to
deliver to which stream or waiter, and which frames to send.  It owns no socket, no thread and
no event loop, and it is not thread-safe: the sync shell calls it under its lock, the async shell
from its one event loop.
"""

from __future__ import annotations

import collections
import itertools
import logging
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import zmq  # event constants only: the core never touches a socket

from ringleader.ipc import protocol as P
from ringleader.ipc.batch_frames import BadBatch, expand_batch
from ringleader.ipc.client.connection import check_transport
from ringleader.ipc.client.liveness import Liveness
from ringleader.ipc.client.op_waiters import OpWaiters
from ringleader.ipc.client.prompt_tokens import PromptTokens, TokenLogprob, logprob_entry, prompt_tokens_of
from ringleader.ipc.client.request_args import check_request_id
from ringleader.ipc.curve import HANDSHAKE_FAILED_EVENTS, describe_handshake_failure
from ringleader.ipc.sampling_params import SamplingParams
from ringleader.ipc.structured import StructuredSpec
from ringleader.ipc.tokenize_ops import TOKENIZE_REPLY_OPS, check_op

log = logging.getLogger("ringleader.ipc.client")

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
# Client-local error codes for a Done the server never sent (the request's fate is unknown).
ERR_DISCONNECTED = "disconnected"
ERR_CLIENT_CLOSED = "client_closed"
ERR_BAD_REPLY = "bad_reply"
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_REPLY_TIMEOUT_S = 30.0


@dataclass(slots=True)
class TokenChunk:
    token_ids: list[int]
    text: str | None = None
    index: int = 0  # the choice it belongs to (a request with n > 1)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked
    finish_reason: str | None = None  # set on the last chunk of a choice of a request with n > 1
    prompt: PromptTokens | None = None  # on the first chunk of a request with prompt_logprobs (1.10)


@dataclass(slots=True)
class ChoiceEnd:
    index: int
    finish_reason: str
    completion_tokens: int


@dataclass(slots=True)
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int  # every choice's together
    error_code: str | None = None
    error_message: str | None = None
    timing: dict | None = None  # the server's view: queue_ms, ttft_ms, e2e_ms (when it sends them)
    choices: list[ChoiceEnd] | None = None  # a request with n > 1: how each choice ended
    prompt: PromptTokens | None = None  # a request with prompt_logprobs that generated no token (1.10)

    @property
    def ok(self) -> bool:
        return self.finish_reason != P.FINISH_ERROR


# ---------------------------------------------------------------- requests


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= P.MAX_CHOICE_INDEX


def _token_chunk(obj: dict) -> TokenChunk | None:
    token_ids = obj.get("token_ids", [])
    text = obj.get("text")
    index = obj.get("index", 0)
    finish = obj.get("finish_reason")
    if (
        not isinstance(token_ids, list)
        or (text is not None and not isinstance(text, str))
        or not _is_index(index)
        or (finish is not None and finish not in P.FINISH_REASONS)
    ):
        return None
    logprobs = obj.get("logprobs")
    entries = None
    if logprobs is not None:
        if not isinstance(logprobs, list) or len(logprobs) != len(token_ids):
            return None
        entries = [logprob_entry(e) for e in logprobs]
    return TokenChunk(token_ids, text, index, entries, finish, prompt_tokens_of(obj))


def _choice_ends(value: Any) -> list[ChoiceEnd] | None:
    if value is None:
        return None
    return [ChoiceEnd(int(c["index"]), str(c["finish_reason"]), int(c["completion_tokens"])) for c in value]


def event_from_reply(obj: dict) -> TokenChunk | Done | None:
    """A token/done reply map -> TokenChunk/Done; None for a malformed token, an error Done for a malformed done."""
    try:
        if obj["op"] == P.OP_TOKEN:
            return _token_chunk(obj)
        usage = obj.get("usage") or {}
        error = obj.get("error") or {}
        return Done(
            finish_reason=obj.get("finish_reason", P.FINISH_ERROR),
            prompt_tokens=usage.get("prompt_tokens", 0),
            completion_tokens=usage.get("completion_tokens", 0),
            error_code=error.get("code"),
            error_message=error.get("message"),
            timing=obj.get("timing") if isinstance(obj.get("timing"), dict) else None,
            choices=_choice_ends(obj.get("choices")),
            prompt=prompt_tokens_of(obj),
        )
    except (AttributeError, KeyError, TypeError, ValueError):
        pass
    if obj.get("op") == P.OP_DONE:
        return Done(P.FINISH_ERROR, 0, 0, ERR_BAD_REPLY, "malformed done message from the server")
    return None


def routable_id(obj: dict) -> P.RequestId | None:
    rid = obj.get("id")
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


def decode_reply(frame: bytes) -> dict | None:
    """A server frame -> its reply map; None (logged) for a malformed frame."""
    try:
        return P.decode_reply(frame)
    except P.FrameError:
        log.warning("ignoring a malformed frame from the server (%d bytes)", len(frame))
        return None


# ---------------------------------------------------------------- streams


class Choice:
    """What one choice of a request received so far (a request has n of them, index 0..n-1)."""

    def __init__(self, index: int):
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked
        self.finish_reason: str | None = None  # set when its last chunk came (n > 1) or at the done
        self._texts: list[str] = []

    @property
    def text(self) -> str | None:
        """Concatenated text of its chunks, None when the server sent no text (no tokenizer)."""
        return "".join(self._texts) if self._texts else None

    def absorb(self, item: TokenChunk) -> None:
        self.token_ids.extend(item.token_ids)
        if item.text is not None:
            self._texts.append(item.text)
        if item.logprobs is not None:
            self.logprobs = (self.logprobs or []) + item.logprobs
        if item.finish_reason is not None:
            self.finish_reason = item.finish_reason


class StreamState:
    """Accumulation shared by the sync and async streams: per choice (`choices`); `token_ids`,
    `text` and `logprobs` are the first choice's (the only one unless the request asked n > 1)."""

    def __init__(self, request_id: P.RequestId, timeout: float | None):
        self.id = request_id
        self.timeout = timeout
        self.done: Done | None = None
        self.prompt: PromptTokens | None = None  # the prompt as the server tokenized it (1.10)
        self._choices: dict[int, Choice] = {0: Choice(0)}

    def choice(self, index: int) -> Choice:
        """Choice `index` (an empty one if nothing of it came yet)."""
        if index not in self._choices:
            self._choices[index] = Choice(index)
        return self._choices[index]

    @property
    def choices(self) -> list[Choice]:
        """Every choice heard of so far (all n of them once the stream ended), by index."""
        return [self._choices[i] for i in sorted(self._choices)]

    @property
    def token_ids(self) -> list[int]:
        return self._choices[0].token_ids

    @property
    def text(self) -> str | None:
        """Concatenated text of the first choice's chunks, None when the server sent no text."""
        return self._choices[0].text

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self._choices[0].logprobs

    def _absorb(self, item: TokenChunk) -> TokenChunk:
        if item.prompt is not None:
            self.prompt = item.prompt
        self.choice(item.index).absorb(item)
        return item

    def _finish(self, done: Done) -> None:
        """The stream's done: each choice learns how it ended."""
        self.done = done
        if done.prompt is not None:
            self.prompt = done.prompt
        if done.choices is not None:
            for end in done.choices:
                if _is_index(end.index):
                    self.choice(end.index).finish_reason = end.finish_reason
        else:
            self._choices[0].finish_reason = done.finish_reason

    def _timeout_error(self, timeout: float | None) -> TimeoutError:
        return TimeoutError(f"request {self.id!r}: no reply from the server within {timeout} s")

    def _close_locally(self) -> None:
        self.done = local_done(ERR_CLIENT_CLOSED, "stream closed before its end", self)

    def _abort_frame(self, finish_reason: str, index: int | None = None) -> bytes:
        """The abort of this request; finish_reason is what its `done` is to say: "abort", or
        "stop" when the caller found its own stop (protocol 1.3; an older server says "abort").
        index: only that choice of a request with n > 1 (1.5)."""
        if not isinstance(finish_reason, str) or finish_reason not in P.ABORT_FINISH_REASONS:
            raise ValueError(f'finish_reason: must be "abort" or "stop", got {finish_reason!r}')
        if index is not None and not _is_index(index):
            raise ValueError(f"index: must be a choice index in [0, {P.MAX_CHOICE_INDEX}], got {index!r}")
        return P.encode(P.abort_msg(self.id, finish_reason, index))


def local_done(code: str, message: str, stream: StreamState) -> Done:
    return Done(P.FINISH_ERROR, 0, sum(len(c.token_ids) for c in stream.choices), code, message)


# ---------------------------------------------------------------- the core

S = TypeVar("S", bound=StreamState)  # the shell's stream type
W = TypeVar("W")  # the shell's waiter for a stats/pong reply (threading event holder, future)


@dataclass(slots=True)
class Actions(Generic[S, W]):
    """What the I/O shell does after the core took an input."""

    events: list[tuple[S, TokenChunk | Done]] = field(default_factory=list)  # put on the stream's queue
    replies: list[tuple[W, Any]] = field(default_factory=list)  # resolve the waiter with the value
    errors: list[tuple[W, BaseException]] = field(default_factory=list)  # fail the waiter
    send: list[bytes] = field(default_factory=list)  # frames for the server, in order
    failed: bool = False  # all pending work was just ended locally (drop frames queued for the server)


class ClientCore(Generic[S, W]):
    """A client's state, without I/O (see the module docstring).

    Ping waiters are (waiter, sent time); waiter None is the client's own keep-alive ping.
    """

    def __init__(
        self,
        address: str,
        *,
        connect_timeout: float | None,
        reply_timeout: float | None,
        max_frame_bytes: int | None,
        now: float,
    ):
        check_transport(address)  # before a socket is made: ZeroMQ says only "Invalid argument"
        self.address = address
        self.max_frame_bytes = max_frame_bytes
        self.last_error: dict | None = None  # latest id-less `error` op from the server
        self.streams: dict[P.RequestId, weakref.ref[S]] = {}
        self.stats_waiters: collections.deque[W] = collections.deque()
        self.ping_waiters: collections.deque[tuple[W | None, float]] = collections.deque()
        self.op_waiters: OpWaiters[W] = OpWaiters()  # tokenize, detokenize, tokenizer_info (1.10)
        self.liveness = Liveness(address, connect_timeout, reply_timeout, now)
        self._ids = itertools.count(1)
        self._hellos_unanswered = 0  # hellos sent whose answer (hello, or an older server's error) is due
        self.batched = False  # the server said it sends this connection `batch` frames (1.7)

    # -- requests from the caller

    def prepare_generate(
        self,
        request_id: P.RequestId | None,
        prompt: str | None,
        prompt_ids: Iterable[int] | None,
        sampling: SamplingParams,
        priority: int,
        timeout_ms: int | None,
        messages: Sequence[Mapping[str, str]] | None = None,
        detokenize: bool = True,
        structured: StructuredSpec | None = None,
        extensions: Mapping[str, Any] | None = None,
    ) -> tuple[P.RequestId, bytes]:
        """Pick (or check) the id and encode the request; nothing is registered yet (see add_stream).
        `structured` and `extensions` (the 1.9 fields that differ from their defaults) are judged
        already (request_args.resolve_structured, resolve_extensions)."""
        if request_id is None:
            request_id = self._next_id()
        else:
            check_request_id(request_id)
            if request_id in self.streams:
                raise ValueError(f"request id {request_id!r} is already in flight on this client")
        if prompt_ids is not None and not isinstance(prompt_ids, list):
            prompt_ids = list(prompt_ids)
        turns = None if messages is None else [dict(m) for m in messages]
        request = P.GenerateRequest(
            request_id,
            prompt,
            prompt_ids,
            sampling,
            priority,
            timeout_ms,
            turns,
            detokenize,
            structured,
            **(extensions or {}),
        )
        return request_id, self.encode_checked(P.generate_msg(request))

    def _next_id(self) -> int:
        rid = next(self._ids)
        while rid in self.streams or rid in self.op_waiters:
            rid = next(self._ids)
        return rid

    def add_op_waiter(self, waiter: W, msg: dict) -> tuple[P.RequestId, bytes]:
        """A tokenizer op (1.10: tokenize_ops' map, its id set here), judged as the server's
        decoder judges it (TokenizeError naming the field) and encoded; the waiter gets its answer."""
        rid = self._next_id()
        msg = {**msg, "id": rid}
        check_op(msg, P.Limits())
        frame = self.encode_checked(msg)
        self.op_waiters.add(rid, msg["op"], waiter)
        return rid, frame

    def encode_checked(self, msg: dict) -> bytes:
        frame = P.encode(msg)
        if self.max_frame_bytes is not None and len(frame) > self.max_frame_bytes:
            raise ValueError(f"request encodes to {len(frame)} bytes; frame limit is {self.max_frame_bytes}")
        return frame

    def add_stream(self, stream: S, on_collected: Callable[[P.RequestId, weakref.ref[S]], None]) -> None:
        """Register before sending, so no reply can miss it.  `on_collected(id, ref)` runs wherever the
        garbage collector runs once the stream is dropped; the shell hands it to abandon()."""
        rid = stream.id
        self.streams[rid] = weakref.ref(stream, lambda ref: on_collected(rid, ref))

    def abandon(self, request_id: P.RequestId, ref: weakref.ref[S] | None) -> bytes | None:
        """Forget a stream nobody reads; returns its abort frame (ref None: whatever stream has the id)."""
        current = self.streams.get(request_id)
        if current is None or (ref is not None and current is not ref):
            return None  # finished already, or the id now belongs to a newer stream
        del self.streams[request_id]
        return P.encode(P.abort_msg(request_id))

    def abort_all(self) -> list[bytes]:
        """Abort frames for every request in flight (on close)."""
        return [P.encode(P.abort_msg(rid)) for rid in self.streams]

    def add_stats_waiter(self, waiter: W, timeline_after_seq: int | None = None) -> bytes:
        """timeline_after_seq (protocol 1.6) is judged here: the server's refusal, an `error` op,
        would answer no waiter (a 1.5 server ignores the field)."""
        n = timeline_after_seq
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= P.INT64_MAX):
            raise ValueError(f"timeline_after_seq: must be an int in [0, 2^63), got {P.clipped_repr(n)}")
        self.stats_waiters.append(waiter)
        return P.encode(P.stats_request_msg(n))

    def add_ping_waiter(self, waiter: W, sent: float) -> bytes:
        self.ping_waiters.append((waiter, sent))
        return P.encode(P.ping_msg())

    def hello_frame(self) -> bytes:
        """The hello a shell sends on every (re)connection: `batch` frames, please (1.7).  The
        client reads plain frames too, so an older server's refusal changes nothing."""
        self._hellos_unanswered += 1
        return P.encode(P.hello_msg(batch=True))

    def busy(self) -> bool:
        pings = any(w is not None for w, _ in self.ping_waiters)
        return bool(self.streams or self.stats_waiters or self.op_waiters or pings)

    # -- what the shell observed

    def on_frame(self, frame: bytes, now: float) -> Actions[S, W]:
        """A frame from the server, received at `now`."""
        self.liveness.heard(now)
        obj = decode_reply(frame)
        return Actions() if obj is None else self.on_reply(obj, now)

    def on_reply(self, obj: dict, now: float) -> Actions[S, W]:
        """Demultiplex a decoded reply: token/done by id, stats/pong in FIFO order, error to last_error."""
        actions: Actions[S, W] = Actions()
        op = obj["op"]
        if op == P.OP_BATCH:
            try:
                replies = list(expand_batch(obj))
            except BadBatch as exc:
                log.warning("ignoring a malformed batch frame from the server: %s", exc)
                return actions
            for reply in replies:
                actions.events += self.on_reply(reply, now).events
            return actions
        if op in (P.OP_TOKEN, P.OP_DONE):
            rid = routable_id(obj)
            event = event_from_reply(obj)
            if rid is None:
                ref = None
            else:
                ref = self.streams.pop(rid, None) if op == P.OP_DONE else self.streams.get(rid)
            stream = ref() if ref is not None else None
            if stream is not None and event is not None:
                actions.events.append((stream, event))
        elif op == P.OP_STATS:
            if self.stats_waiters:  # a timed-out waiter still consumes its reply
                actions.replies.append((self.stats_waiters.popleft(), obj))
        elif op == P.OP_PONG:
            waiter = self.ping_waiters.popleft()[0] if self.ping_waiters else None
            if waiter is not None:
                actions.replies.append((waiter, now))
        elif op in TOKENIZE_REPLY_OPS:
            told = self.op_waiters.on_reply(obj)
            if told is not None:
                waiter, answer, error = told
                if error is None:
                    actions.replies.append((waiter, answer))
                else:
                    actions.errors.append((waiter, error))
        elif op == P.OP_HELLO:
            self._hellos_unanswered = max(0, self._hellos_unanswered - 1)
            self.batched = obj.get("batch") is True
        elif op == P.OP_ERROR and (refused := self.op_waiters.on_unknown_op(obj)) is not None:
            actions.errors.append(refused)  # a server older than 1.10 (which may say hello first)
        elif op == P.OP_ERROR and self._hellos_unanswered and obj.get("id") is None:
            self._hellos_unanswered -= 1  # a server older than 1.7 refused the hello: plain frames
            self.batched = False
        elif op == P.OP_ERROR:
            self.last_error = obj
            log.warning("server rejected a frame: %s: %s", obj.get("code"), obj.get("message"))
        return actions

    def on_monitor_event(self, kind: int, value: int, now: float) -> str | None:
        """A socket monitor event; returns the message that ends outstanding work, or None.

        On a failure the shell first reads what already arrived, then calls connection_lost()."""
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.liveness.on_connected(now)
            return None
        if kind == zmq.EVENT_DISCONNECTED:
            return "connection to the server was lost"
        if kind & HANDSHAKE_FAILED_EVENTS:
            return describe_handshake_failure(kind, value)
        return None

    def connection_lost(self, message: str, now: float) -> Actions[S, W]:
        self.liveness.on_disconnected(now)
        self._hellos_unanswered, self.batched = 0, False  # the next connection says hello anew
        return self.fail_pending(ERR_DISCONNECTED, message, ConnectionError(message))

    def poll_interval(self) -> float | None:
        """How long the shell may sleep before tick() is due; None: until something happens."""
        return self.liveness.poll_interval(self.busy())

    def tick(self, now: float) -> Actions[S, W]:
        """The liveness check: maybe a keep-alive ping to send, maybe giving the server up."""
        verdict = self.liveness.check(now, self.busy(), self._longest_stream_wait)
        if verdict == "ping":
            self.ping_waiters.append((None, now))
            return Actions(send=[P.encode(P.ping_msg())])
        if verdict is not None:
            return self.fail_pending(ERR_DISCONNECTED, verdict, ConnectionError(verdict))
        return Actions()

    def _longest_stream_wait(self) -> float | None:
        """The longest per-chunk timeout of the open streams (None: none has one)."""
        waits = [s.timeout for s in (ref() for ref in self.streams.values()) if s is not None]
        return max((w for w in waits if w is not None), default=None)

    def keepalive_not_sent(self) -> None:
        """The ping tick() asked for could not be sent: forget its pong."""
        if self.ping_waiters and self.ping_waiters[-1][0] is None:
            self.ping_waiters.pop()

    def fail_pending(self, code: str, message: str, waiter_error: BaseException) -> Actions[S, W]:
        """End every open stream with a local Done and every waiter with `waiter_error`."""
        streams = [ref() for ref in self.streams.values()]
        waiters = list(self.stats_waiters) + [w for w, _ in self.ping_waiters if w is not None]
        failed_ops = self.op_waiters.fail_all(waiter_error)
        self.streams.clear()
        self.stats_waiters.clear()
        self.ping_waiters.clear()
        actions: Actions[S, W] = Actions(failed=True)
        actions.events = [(s, local_done(code, message, s)) for s in streams if s is not None]
        actions.errors = [(w, waiter_error) for w in waiters] + failed_ops
        return actions


class CoreView:
    """What both clients show of their core (`self._core`, a ClientCore)."""

    _core: ClientCore

    @property
    def in_flight(self) -> int:
        return len(self._core.streams)

    @property
    def last_error(self) -> dict | None:
        """The latest id-less `error` op from the server."""
        return self._core.last_error

    @property
    def connected(self) -> bool:
        """The connection to the server is up (its socket monitor's last word: handshake done, or lost)."""
        return self._core.liveness.connected

    @property
    def batched(self) -> bool:
        """The server sends this client's streams as `batch` frames (it answered the hello, 1.7)."""
        return self._core.batched

    @property
    def max_frame_bytes(self) -> int | None:
        return self._core.max_frame_bytes

    @max_frame_bytes.setter
    def max_frame_bytes(self, value: int | None) -> None:
        self._core.max_frame_bytes = value
