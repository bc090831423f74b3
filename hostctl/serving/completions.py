"""The completion thread: reads CQ events, turns them into wire frames per request, and hands
the frames to the frontend thread through the Outbox (outbox.py: the frontend alone touches the
ROUTER socket).

Tokens of one request that arrive in one batch of events are coalesced into one `token` frame.
A request's DONE ends it through Finisher.end; a request that is no longer in the table (ended
by the watchdog, say) has its late events ignored, so no request ever gets two `done` frames.
The watchdog lives here too: when the backend reports a failure or the device's heartbeat
stalls, every request in flight ends with engine_dead, and `dead_reason` tells the frontend to
accept no more.
"""

from __future__ import annotations

import threading
import time

from ringleader.hostctl.serving.finisher import Finisher, Frame, no_logprobs
from ringleader.hostctl.serving.inflight import RequestTable
from ringleader.hostctl.serving.metrics import ServerMetrics
from ringleader.hostctl.serving.outbox import Outbox
from ringleader.ipc import layout, protocol
from ringleader.ipc.backend import Backend

FINISH_NAMES: dict[int, str] = {
    layout.Finish.STOP: protocol.FINISH_STOP,
    layout.Finish.LENGTH: protocol.FINISH_LENGTH,
    layout.Finish.ABORT: protocol.FINISH_ABORT,
}


class CompletionRouter:
    """Runs the completion thread, the one reader of the CQ."""

    def __init__(
        self,
        backend: Backend,
        table: RequestTable,
        finisher: Finisher,
        outbox: Outbox,
        metrics: ServerMetrics,
        watchdog_s: float,
    ):
        self._backend = backend
        self._rings = backend.rings
        self._table = table
        self._finisher = finisher
        self._outbox = outbox
        self._metrics = metrics
        self._watchdog_s = watchdog_s
        self._stop = threading.Event()
        # written by the completion thread only, once (None -> why); read through `dead_reason`
        self._dead_reason: str | None = None
        self._thread = threading.Thread(target=self._run, name="rl-completions", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def native_id(self) -> int | None:
        """The completion thread's native id while it runs (None before and after: an id of a
        thread that ended may belong to another one by now)."""
        return self._thread.native_id if self._thread.is_alive() else None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is dead, or None while it lives.  Set by the completion thread only
        (the frontend reads it to refuse new work); once set it never changes."""
        return self._dead_reason

    def _run(self) -> None:
        last_progress = time.monotonic()
        last_heartbeat = None
        while not self._stop.is_set():
            # 1. wait (at most 50 ms) for the backend to signal new CQ events
            self._backend.wait_for_events(0.05)
            # 2. take the CQ's events and route them: token frames, and the `done` of each DONE
            events, records = self._rings.completions.take_with_logprobs(self._logprobs_wanted)
            if len(events):
                self._route(events, records)
            # 3. engine dead: end whatever the frontend accepted before it saw dead_reason
            if self._dead_reason is not None:
                if len(self._table):
                    self._fail_all(self._dead_reason)
                continue
            # 4. watchdog: a failure the backend reports, or a heartbeat that stopped moving
            failure = self._backend.failure()
            heartbeat = int(self._rings.control[0]["heartbeat_ns"])
            now = time.monotonic()
            if heartbeat != last_heartbeat or len(events):
                last_heartbeat, last_progress = heartbeat, now
            elif now - last_progress > self._watchdog_s:
                failure = failure or f"device heartbeat stalled for {now - last_progress:.1f} s"
            if failure is not None:
                self._dead_reason = failure
                self._fail_all(failure)

    def _fail_all(self, reason: str) -> None:
        """Engine dead: every in-flight request ends now with engine_dead."""
        frames = []
        for req in self._table.all():
            frames += self._finisher.end(
                req, protocol.FINISH_ERROR, protocol.ERR_ENGINE_DEAD, f"engine dead: {reason}"
            )
        self._outbox.put_many(frames)

    def _logprobs_wanted(self, events) -> bool:
        """Read once the batch's events are copied, before the CQ entries go back: a request
        whose events are in it was in the table before its GENERATE was written."""
        return self._table.with_logprobs > 0

    def _route(self, events, records=None) -> None:
        """One CQ batch: a token frame per request, then its `done` if it ended; the batch's
        metrics go to ServerMetrics at once, under one lock, before its frames are handed on.
        records: the batch's cq_logprobs entries (None when no request in flight asked)."""
        frames: list[Frame] = []
        tokens: dict[int, list[int]] = {}
        positions: dict[int, list[int]] = {}  # per handle, its TOKEN events' places in the batch
        order: list[int] = []  # handles in first-event order, so frames keep event order
        dones: dict[int, int] = {}
        now = time.perf_counter_ns()
        queued: dict[int, int] = {}
        for at, (handle, kind, reason, token, waited) in enumerate(
            zip(
                events["handle"].tolist(),
                events["kind"].tolist(),
                events["finish_reason"].tolist(),
                events["token"].tolist(),
                events["queued_us"].tolist(),
            )
        ):
            if handle not in tokens and handle not in dones:
                order.append(handle)
            if kind == layout.EventKind.TOKEN:
                tokens.setdefault(handle, []).append(token)
                if records is not None:
                    positions.setdefault(handle, []).append(at)
            else:
                dones[handle] = reason
                queued[handle] = waited
        n_tokens = n_prompt = 0
        ttft: list[float] = []  # seconds, per request whose first token is in this batch
        itl: list[tuple[float, int]] = []  # (seconds per token, tokens) per later token frame
        for handle in order:
            req = self._table.get(handle)
            if req is None:
                continue  # already ended (engine_dead or shutdown): its late events are moot
            ids = tokens.get(handle)
            if ids:
                k = len(ids)
                if req.completion_tokens == 0:
                    req.first_token_ns = now
                    if req.arena_offset is not None:  # set before the GENERATE was published
                        self._rings.arena.release(req.arena_offset)  # prefill is over
                    if req.family is not None and req.index == 0:
                        req.family.open_gate()  # its prompt's pages are cached now
                    n_prompt += req.prompt_len
                    ttft.append((now - req.arrival_ns) / 1e9)
                    if k > 1:  # the rest of a first frame came with the first token: no gap
                        itl.append((0.0, k - 1))
                else:  # the gap since its last frame, shared evenly by this frame's tokens
                    itl.append(((now - req.last_token_ns) / 1e9 / k, k))
                req.last_token_ns = now
                req.completion_tokens += k
                n_tokens += k
                text = req.detokenizer.push(ids) if req.detokenizer is not None else None
                logprobs = None
                if req.sampling.logprobs is not None and records is not None:
                    logprobs = self._logprob_entries(req.sampling.logprobs, records, positions[handle], ids)
                index = None if req.family is None else req.index
                msg = protocol.token_msg(req.id, ids, text, index=index, logprobs=logprobs)
                frames.append((req.client, protocol.encode(msg)))
            if handle not in dones:
                continue
            finish = FINISH_NAMES.get(dones[handle], protocol.FINISH_ERROR)
            code = message = None
            if finish == protocol.FINISH_ABORT and req.end_as is not None:
                # the host's reason for the abort (a request that ended anyway keeps its own)
                finish, code, message = req.end_as.finish_reason, req.end_as.code, req.end_as.message
            # flushed first: if the frontend ended it meanwhile (shutdown), the tail goes unsent
            tail = req.detokenizer.flush() if req.detokenizer is not None else None
            ended = self._finisher.end(req, finish, code, message, device_queued_us=queued[handle], tail=tail)
            if not ended:
                continue
            if tail and req.family is None:  # a choice's tail travels in its last chunk instead
                msg = protocol.token_msg(req.id, [], tail, logprobs=no_logprobs(req))
                frames.append((req.client, protocol.encode(msg)))
            frames += ended
        if n_tokens:
            self._metrics.routed(n_tokens, n_prompt, ttft, itl)
        self._outbox.put_many(frames)

    def _logprob_entries(self, asked: int, records, at: list[int], token_ids: list[int]) -> list[dict]:
        """The protocol's logprobs entries (docs/protocol.md) of one request's tokens, from their
        cq_logprobs records; each token and alternative named by its text where the model has a
        tokenizer."""
        token_text = self._backend.model.token_text
        out = []
        for record, token in zip(records[at], token_ids):
            k = min(asked, int(record["n_top"]))
            ids = record["top_ids"][:k].tolist()
            entry = {
                "logprob": float(record["logprob"]),
                "top_ids": ids,
                "top_logprobs": record["top_logprobs"][:k].tolist(),
            }
            if token_text is not None:
                entry["token"] = token_text(token)
                entry["top_tokens"] = [token_text(i) for i in ids]
            out.append(entry)
        return out
