"""The completion thread: reads CQ events, turns them into wire frames per request, and hands
the frames to the frontend thread (the only one that touches the ROUTER socket).

Tokens of one request that arrive in one batch of events are coalesced into one `token` frame.
A request's DONE removes it from the table; a request that is no longer in the table (ended by
the watchdog, say) has its late events ignored, so no request ever gets two `done` frames.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from hostctl.inflight import InFlight, RequestTable
from ipc import layout, protocol
from ipc.backend import Backend

FINISH_NAMES = {
    layout.Finish.STOP: protocol.FINISH_STOP,
    layout.Finish.LENGTH: protocol.FINISH_LENGTH,
    layout.Finish.ABORT: protocol.FINISH_ABORT,
}


class Outbox:
    """Frames waiting for the frontend thread; `notify` wakes it."""

    def __init__(self, notify: Callable[[], None]):
        self._frames: deque[tuple[bytes, bytes]] = deque()
        self._notify = notify

    def put_many(self, frames: list[tuple[bytes, bytes]]) -> None:
        if frames:
            self._frames.extend(frames)
            self._notify()

    def take_all(self) -> list[tuple[bytes, bytes]]:
        out = []
        while self._frames:
            out.append(self._frames.popleft())
        return out


def server_timing(req: InFlight, device_queued_us: int | None) -> dict:
    """Where the request's time went, as the server saw it (an extra field of `done`):
    queue = waiting on the host for ring space + waiting on the device for a slot."""
    now = time.perf_counter_ns()
    out = {"e2e_ms": (now - req.arrival_ns) / 1e6}
    if req.first_token_ns:
        out["ttft_ms"] = (req.first_token_ns - req.arrival_ns) / 1e6
    if req.submit_ns and device_queued_us is not None:
        out["queue_ms"] = (req.submit_ns - req.arrival_ns) / 1e6 + device_queued_us / 1e3
    return out


def done_frame(
    req: InFlight,
    finish_reason: str,
    code: str | None = None,
    message: str | None = None,
    device_queued_us: int | None = None,
) -> tuple[bytes, bytes]:
    # a request that timed out before its first token is billed nothing, like a rejected one
    unstarted_timeout = code == protocol.ERR_TIMEOUT and req.completion_tokens == 0
    msg = protocol.done_msg(
        req.id,
        finish_reason,
        0 if unstarted_timeout else req.prompt_len,
        req.completion_tokens,
        error_code=code,
        error_message=message,
    )
    msg["timing"] = server_timing(req, device_queued_us)
    return req.client, protocol.encode(msg)


class CompletionRouter:
    def __init__(self, backend: Backend, table: RequestTable, outbox: Outbox, metrics, watchdog_s: float):
        self._backend = backend
        self._rings = backend.rings
        self._table = table
        self._outbox = outbox
        self._metrics = metrics
        self._watchdog_s = watchdog_s
        self._stop = threading.Event()
        self.dead_reason: str | None = None
        self._thread = threading.Thread(target=self._run, name="rl-completions", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    def _run(self) -> None:
        last_progress = time.monotonic()
        last_heartbeat = None
        while not self._stop.is_set():
            self._backend.wait_for_events(0.05)
            events = self._rings.completions.take()
            if len(events):
                self._route(events)
            if self.dead_reason is not None:
                continue
            failure = self._backend.failure()
            heartbeat = int(self._rings.control[0]["heartbeat_ns"])
            now = time.monotonic()
            if heartbeat != last_heartbeat or len(events):
                last_heartbeat, last_progress = heartbeat, now
            elif now - last_progress > self._watchdog_s:
                failure = failure or f"device heartbeat stalled for {now - last_progress:.1f} s"
            if failure is not None:
                self.fail_all(failure)

    def fail_all(self, reason: str) -> None:
        """Engine dead: every in-flight request ends now with engine_dead."""
        self.dead_reason = reason
        frames = []
        for req in self._table.all():
            if self._table.finish(req.handle) is req:
                frames.append(
                    done_frame(req, protocol.FINISH_ERROR, protocol.ERR_ENGINE_DEAD, f"engine dead: {reason}")
                )
                self._metrics.finished(req, protocol.FINISH_ERROR)
        self._outbox.put_many(frames)

    def _route(self, events) -> None:
        frames: list[tuple[bytes, bytes]] = []
        tokens: dict[int, list[int]] = {}
        order: list[int] = []  # handles in first-event order, so frames keep event order
        dones: dict[int, int] = {}
        now = time.perf_counter_ns()
        queued: dict[int, int] = {}
        for handle, kind, reason, token, waited in zip(
            events["handle"].tolist(),
            events["kind"].tolist(),
            events["finish_reason"].tolist(),
            events["token"].tolist(),
            events["queued_us"].tolist(),
        ):
            if handle not in tokens and handle not in dones:
                order.append(handle)
            if kind == layout.EventKind.TOKEN:
                tokens.setdefault(handle, []).append(token)
            else:
                dones[handle] = reason
                queued[handle] = waited
        for handle in order:
            req = self._table.get(handle)
            if req is None:
                continue  # already ended (engine_dead or shutdown): its late events are moot
            ids = tokens.get(handle)
            if ids:
                if req.completion_tokens == 0:
                    req.first_token_ns = now
                    self._rings.arena.release(req.arena_offset)  # prefill is over
                req.completion_tokens += len(ids)
                text = req.detokenizer.push(ids) if req.detokenizer is not None else None
                frames.append((req.client, protocol.encode(protocol.token_msg(req.id, ids, text))))
                self._metrics.tokens(len(ids))
            if handle in dones and self._table.finish(handle) is req:
                if req.completion_tokens == 0 and req.arena_offset is not None:
                    self._rings.arena.release(req.arena_offset)
                if req.detokenizer is not None:
                    tail = req.detokenizer.flush()
                    if tail:
                        frames.append((req.client, protocol.encode(protocol.token_msg(req.id, [], tail))))
                reason = FINISH_NAMES.get(dones[handle], protocol.FINISH_ERROR)
                code = message = None
                if reason == protocol.FINISH_ABORT and req.end_as is not None:
                    reason, (code, message) = protocol.FINISH_ERROR, req.end_as
                frames.append(done_frame(req, reason, code, message, queued[handle]))
                self._metrics.finished(req, reason)
        self._outbox.put_many(frames)
