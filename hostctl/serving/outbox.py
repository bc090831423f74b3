"""The outbox: every frame on its way to a client, and what the server knows of clients that
stopped reading.

Two threads put frames in, one sends them.  The completion thread hands its frames over with
put_many (a deque: its append and popleft are safe across threads) and wakes the frontend; the
frontend thread sends those (send_routed) and its own (send), and alone touches the ROUTER socket,
the per-client backlog and the set of gone clients.  Which connections asked for `batch` frames
(`hello`, protocol 1.7) is kept here too: the frontend writes that set, the completion thread
reads it.

A frame ZeroMQ has no room for waits in its client's backlog, and every later frame to that
client waits behind it, so a client's frames keep their order.  A client whose backlog outgrows
MAX_BACKLOG_FRAMES, or that ZeroMQ reports unreachable, is gone: its requests are aborted once, so
their slots go to others, and frames to it are dropped until it is heard from again.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable

import zmq

from ringleader.hostctl.serving.finisher import Frame, Reply
from ringleader.hostctl.serving.inflight import InFlight, RequestTable
from ringleader.ipc import protocol

log = logging.getLogger("ringleader.server")

MAX_BACKLOG_FRAMES = 65536  # per client; beyond it the client is treated as gone
MAX_BATCHED_CLIENTS = 65536  # connections remembered as wanting `batch` frames (protocol 1.7)
GONE_SWEEP_S = 1.0  # how often clients marked gone with nothing left in flight are forgotten


class Outbox:
    """socket: the ROUTER socket; notify: wakes the frontend thread (WakePipe.notify); abort:
    ends one request of a gone client (the server's abort, which may send through this outbox:
    frames to a gone client are dropped, so that never recurses further)."""

    def __init__(
        self,
        socket: zmq.Socket,
        table: RequestTable,
        notify: Callable[[], None],
        abort: Callable[[InFlight], None],
    ):
        self._routed: deque[Frame] = deque()  # completion thread -> frontend thread
        self._notify = notify
        # the rest is the frontend thread's alone
        self._socket = socket
        self._table = table
        self._abort = abort
        self._backlog: dict[bytes, deque[bytes]] = defaultdict(deque)  # frames zmq had no room for
        self._gone: set[bytes] = set()  # clients found disconnected: frames to them are dropped
        self._next_gone_sweep = 0.0
        # connections that asked for `batch` frames: written by the frontend thread, read (one
        # membership test per connection per CQ batch) by the completion thread
        self._batched: set[bytes] = set()

    # ---- the completion thread -----------------------------------------------------------------
    def put_many(self, frames: list[Frame]) -> None:
        """Hands frames to the frontend thread and wakes it.  Completion thread."""
        if frames:
            self._routed.extend(frames)
            self._notify()

    def wants_batch(self, client: bytes) -> bool:
        """The connection asked for `batch` frames.  Any thread."""
        return client in self._batched

    # ---- the frontend thread -------------------------------------------------------------------
    def set_batched(self, client: bytes, batch: bool) -> bool:
        """A `hello`: whether the connection gets `batch` frames from now on (the answer's)."""
        if not batch:
            self._batched.discard(client)
            return False
        if client not in self._batched and len(self._batched) >= MAX_BATCHED_CLIENTS:
            # forget the connections with nothing in flight (they get plain frames until they
            # say hello again); a new set, so the completion thread never sees one change size
            self._batched = {c for c in self._batched if self._table.count_of(c)}
            if len(self._batched) >= MAX_BATCHED_CLIENTS:
                return False
        self._batched.add(client)
        return True

    @property
    def batched_clients(self) -> int:
        return len(self._batched)

    def send_replies(self, replies: list[Reply]) -> None:
        """Sends message maps (the Finisher's), each as its own frame."""
        for client, msg in replies:
            self.send(client, protocol.encode(msg))

    @property
    def has_backlog(self) -> bool:
        """Frames wait for room in ZeroMQ (the frontend then polls every millisecond)."""
        return bool(self._backlog)

    @property
    def gone_clients(self) -> int:
        """Clients marked gone and not forgotten yet."""
        return len(self._gone)

    def send_routed(self) -> None:
        """Sends what the completion thread put in, in its order."""
        routed = []
        while self._routed:
            routed.append(self._routed.popleft())
        self.send_all(routed)

    def send_all(self, frames: list[Frame]) -> None:
        for client, frame in frames:
            self.send(client, frame)

    def send(self, client: bytes, frame: bytes) -> None:
        if client in self._gone:
            return  # nobody is there to read it; its requests were aborted when it went
        backlog = self._backlog.get(client)
        if backlog:  # keep per-client order behind frames that are already waiting
            backlog.append(frame)
            if len(backlog) > MAX_BACKLOG_FRAMES:
                self.client_gone(client, "client does not read its replies")
            return
        try:
            self._send_pair(client, frame)
        except zmq.Again:
            self._backlog[client].append(frame)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                self.client_gone(client, "client disconnected")
            else:
                raise

    def _send_pair(self, client: bytes, frame: bytes) -> None:
        """[client, frame] as one message: what send_multipart does, without its per-call
        checks (a third of a frame's cost on this thread; the ROUTER refuses or routes a message
        at its first part, so the second cannot fail alone)."""
        self._socket.send(client, zmq.SNDMORE | zmq.NOBLOCK)
        self._socket.send(frame, zmq.NOBLOCK)

    def retry_backlog(self) -> None:
        """Sends the frames ZeroMQ had no room for, each client's in order, while it has room."""
        for client in list(self._backlog):
            q = self._backlog[client]
            while q:
                try:
                    self._send_pair(client, q[0])
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    self.client_gone(client, "client disconnected")
                    break
                q.popleft()
            if not q:
                self._backlog.pop(client, None)

    def heard_from(self, client: bytes) -> None:
        """A frame came from the client: it is back, if it was gone (a client may reconnect
        under its identity)."""
        self._gone.discard(client)

    def client_gone(self, client: bytes, why: str) -> None:
        """Aborts everything the client has in flight, once, so its slots go to others."""
        self._backlog.pop(client, None)
        self._gone.add(client)
        self._batched.discard(client)  # a client back under its identity says hello again
        reqs = self._table.of_client(client)
        if reqs:
            log.info("client %s: %s; aborting its %d requests", client.hex(), why, len(reqs))
        for req in reqs:
            self._abort(req)

    def sweep_gone(self) -> None:
        """Forgets gone clients whose requests have all ended (bounds the set)."""
        if self._gone and not len(self._table):
            self._gone.clear()  # nothing in flight, so no frame is left to drop for any of them
            return
        now = time.monotonic()
        if now < self._next_gone_sweep or not self._gone:
            return
        self._next_gone_sweep = now + GONE_SWEEP_S
        self._gone = {c for c in self._gone if self._table.count_of(c)}
