"""The completion thread: reads CQ events, turns them into wire frames, and hands the frames to the
frontend thread through the Outbox (outbox.py: the frontend alone touches the ROUTER socket).

Tokens of one request that arrive in one batch of events are coalesced into one chunk, and a
connection's chunks and dones of one batch into one `batch` frame where it asked for them
(connection_frames.py; else one `token` frame per request, as protocol 1.6).  A started request
that asked for ids alone takes the hot path: a few attribute updates and list appends, no map,
no pack of its own.
A request's DONE ends it through Finisher.end; a request that is no longer in the table (ended
by the watchdog, say) has its late events ignored, so no request ever gets two `done` frames.
The watchdog lives here too: when the backend reports a failure or the device's heartbeat
stalls, every request in flight ends with engine_dead, and `dead_reason` tells the frontend to
accept no more.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ringleader.hostctl.serving.connection_frames import ConnectionFrames, pack_frame
from ringleader.hostctl.serving.finisher import Finisher, no_logprobs
from ringleader.hostctl.serving.inflight import InFlight, RequestTable
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
        self.batches = 0  # CQ batches routed (non-empty takes): the completion thread's, read by stats
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
                self.batches += 1
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
        frames = ConnectionFrames(self._outbox.wants_batch)
        for req in self._table.all():
            frames.add_replies(
                self._finisher.end(
                    req, protocol.FINISH_ERROR, protocol.ERR_ENGINE_DEAD, f"engine dead: {reason}"
                )
            )
        self._outbox.put_many(frames.frames())

    def _logprobs_wanted(self, events) -> bool:
        """Read once the batch's events are copied, before the CQ entries go back: a request
        whose events are in it was in the table before its GENERATE was written."""
        return self._table.with_logprobs > 0

    def _route(self, events, records=None) -> None:
        """One CQ batch: each request's tokens as one chunk of its connection's frames, then the
        `done` of each request that ended; the batch's metrics go to ServerMetrics at once, under
        one lock, before its frames are handed on.  records: the batch's cq_logprobs entries
        (None when no request in flight asked).

        Hot requests (started, token ids alone: stream_columns.py) are counted, stamped and put
        in their connections' frames by array operations, whatever their number; the others
        (a first token, text, logprobs, a choice) one by one."""
        now = time.perf_counter_ns()
        frames = ConnectionFrames(self._outbox.wants_batch)
        if records is not None:  # PROMPT events come only while some request asked for records
            prompt_at = np.flatnonzero(events["kind"] == layout.EventKind.PROMPT)
            if len(prompt_at):
                self._keep_prompt_scores(events, records, prompt_at)
        chunks = TokenChunks.of(events)
        n_tokens = n_prompt = 0
        ttft: list[float] = []  # seconds, per request whose first token is in this batch
        gaps: list[float] = []  # ns per token since the request's last chunk, per later chunk ...
        gap_tokens: list[int] = []  # ... and that chunk's tokens (the inter-token latency)
        hot_gaps = hot_counts = None  # the same of the hot chunks, as arrays
        if len(chunks.handles):
            hot, hot_gaps, connections, hot_ids, live = self._table.advance_hot(
                chunks.handles, chunks.counts, now
            )
            if len(hot_gaps):
                hot_counts = chunks.counts[hot]
                n_tokens += int(hot_counts.sum())
                chunks.add_hot_frames(frames, hot, hot_counts, connections, hot_ids)
            others = np.flatnonzero(live & ~hot).tolist()
            for i, req in zip(others, self._table.lookup(chunks.handles[others].tolist())):
                if req is None:
                    continue  # ended meanwhile (engine_dead or shutdown): its late events are moot
                ids = chunks.token_ids(i)
                k = len(ids)
                n_tokens += k
                # its prompt's logprobs come first, and its chunk after them as a map (the
                # columns of plain chunks go out before a connection's maps)
                as_map = req.prompt_scores is not None
                if as_map:
                    frames.add_reply(req.client, self._prompt_reply(req))
                if req.completion_tokens == 0:
                    req.first_token_ns = now
                    if req.arena_offset is not None:  # set before the GENERATE was published
                        self._rings.arena.release(req.arena_offset)  # prefill is over
                    if req.family is not None and req.index == 0:
                        req.family.open_gate()  # its prompt's pages are cached now
                    n_prompt += req.prompt_len
                    ttft.append((now - req.arrival_ns) / 1e9)
                    if k > 1:  # the rest of a first chunk came with the first token: no gap
                        gaps.append(0.0)
                        gap_tokens.append(k - 1)
                else:  # the gap since its last chunk, shared evenly by this chunk's tokens
                    gaps.append((now - req.last_token_ns) / k)
                    gap_tokens.append(k)
                req.last_token_ns = now
                req.completion_tokens += k
                if req.detokenizer is None and req.family is None and req.sampling.logprobs is None:
                    self._table.make_hot(req)  # ids alone: its later chunks take the hot path
                    if not as_map:
                        frames.add_ids(req.client, req.id, ids)
                        continue
                text = req.detokenizer.push(ids) if req.detokenizer is not None else None
                if req.family is None and req.sampling.logprobs is None and not as_map:
                    frames.add_ids(req.client, req.id, ids, text)  # ids and text: columns too
                    continue
                logprobs = None
                if req.sampling.logprobs is not None and records is not None:
                    logprobs = self._logprob_entries(req, records, chunks.positions(i), ids)
                index = None if req.family is None else req.index
                frames.add_reply(
                    req.client, protocol.token_msg(req.id, ids, text, index=index, logprobs=logprobs)
                )
        for handle, reason, waited in chunks.dones:
            req = self._table.get(handle)
            if req is not None:
                self._end(req, reason, waited, frames)
        if n_tokens:
            if hot_gaps is not None and hot_counts is not None:  # the hot chunks' gaps, and the others'
                all_gaps = np.concatenate([hot_gaps, gaps]) if gaps else hot_gaps
                all_tokens = np.concatenate([hot_counts, gap_tokens]) if gap_tokens else hot_counts
                self._metrics.routed(n_tokens, n_prompt, ttft, all_gaps, all_tokens)
            else:
                self._metrics.routed(n_tokens, n_prompt, ttft, gaps, gap_tokens)
        self._outbox.put_many(frames.frames())

    def _end(self, req: InFlight, reason: int, queued_us: int, frames: ConnectionFrames) -> None:
        """A DONE from the device: the request's text tail, then its `done` (Finisher.end)."""
        finish = FINISH_NAMES.get(reason, protocol.FINISH_ERROR)
        code = message = None
        ending = req.end_as or req.queue_end_as  # a plain abort's outcome wins: it ends the request
        if finish == protocol.FINISH_ABORT and ending is not None:
            # the host's reason for the abort (a request that ended anyway keeps its own)
            finish, code, message = ending.finish_reason, ending.code, ending.message
        # flushed first: if the frontend ended it meanwhile (shutdown), the tail goes unsent
        tail = req.detokenizer.flush() if req.detokenizer is not None else None
        prompt = self._prompt_reply(req) if req.prompt_scores is not None else None  # none generated
        ended = self._finisher.end(req, finish, code, message, device_queued_us=queued_us, tail=tail)
        if not ended:
            return
        if prompt is not None:
            frames.add_reply(req.client, prompt)
        if tail and req.family is None:  # a choice's tail travels in its last chunk instead
            frames.add_reply(req.client, protocol.token_msg(req.id, [], tail, logprobs=no_logprobs(req)))
        frames.add_replies(ended)

    def _keep_prompt_scores(self, events, records, prompt_at: np.ndarray) -> None:
        """The batch's PROMPT events, by request: their prompt positions and records, kept until
        the request's prompt message (an aborted request's, handle 0 or ended, are dropped)."""
        handles = events["handle"][prompt_at]
        for handle in np.unique(handles).tolist():
            req = self._table.get(handle)
            if req is None or req.prompt_scores is None:
                continue
            mine = prompt_at[handles == handle]
            req.prompt_scores.append((events["index"][mine], records[mine]))

    def _prompt_reply(self, req: InFlight) -> dict:
        """The request's prompt message (protocol.prompt_msg): its prompt, and its tokens'
        logprobs as columns, each position's from its PROMPT event's record."""
        scores, req.prompt_scores = req.prompt_scores or [], None
        asked = req.sampling.prompt_logprobs
        assert asked is not None
        prompt = np.asarray(req.prompt_ids, dtype=np.int64)
        n = len(prompt)
        k = min(asked, self._backend.model.vocab_size)
        lps = np.full(n, np.nan)
        top_ids = np.zeros((n, k), np.int64)
        top_lps = np.zeros((n, k), np.float64)
        for at, recs in scores:
            ok = (at > 0) & (at < n)  # the positions the device scored: every one but the first
            pos, recs = at[ok].astype(np.int64), recs[ok]
            lps[pos] = recs["logprob"]
            top_ids[pos] = recs["top_ids"][:, :k]
            top_lps[pos] = recs["top_logprobs"][:, :k]
        columns: dict = {
            "n_top": k,
            "logprob": [None if lp != lp else lp for lp in lps.tolist()],  # NaN: not scored
            "top_ids": top_ids[1:].reshape(-1).tolist(),
            "top_logprobs": top_lps[1:].reshape(-1).tolist(),
        }
        model, tokens, text = self._backend.model, None, None
        if req.detokenizer is not None and model.token_text is not None:
            columns["top_tokens"] = [model.token_text(i) for i in columns["top_ids"]]
            tokens = [model.token_text(i) for i in prompt.tolist()]
            if model.new_detokenizer is not None:
                whole = model.new_detokenizer(skip_special_tokens=False)
                text = whole.push(prompt.tolist()) + whole.flush()
        index = req.index if req.family is not None else None
        return protocol.prompt_msg(req.id, prompt.tolist(), columns, tokens, text, index)

    def _logprob_entries(self, req: InFlight, records, at: list[int], token_ids: list[int]) -> list[dict]:
        """The protocol's logprobs entries (docs/protocol.md) of one request's tokens, from their
        cq_logprobs records; each token and alternative named by its text where the request has a
        detokenizer (the model has a tokenizer, and the request asked for text)."""
        asked = req.sampling.logprobs
        assert asked is not None
        # a request that asked for ids alone has no detokenizer, and gets no token strings either
        token_text = self._backend.model.token_text if req.detokenizer is not None else None
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


class TokenChunks:
    """A CQ batch's TOKEN events as one chunk per request: `handles` (unique), `counts` and the
    token ids in handle order (`tokens`, each chunk's from `starts`), in array operations; and
    the batch's DONE events as (handle, finish reason, device queue time in µs)."""

    __slots__ = ("_positions", "counts", "dones", "handles", "starts", "tokens")
    handles: np.ndarray  # uint32, unique, ascending
    counts: np.ndarray  # each chunk's tokens
    starts: np.ndarray  # each chunk's first token in `tokens`
    tokens: np.ndarray  # every token id, by handle, each request's in generation order
    _positions: np.ndarray  # each token's event in the batch
    dones: list[tuple[int, int, int]]

    @classmethod
    def of(cls, events) -> TokenChunks:
        out = cls()
        kinds = events["kind"]
        is_token = kinds == layout.EventKind.TOKEN
        every = bool(is_token.all())
        if every:  # a step's batch: no DONE, so no copy of the token events first
            handles, tokens = events["handle"], events["token"]
        else:
            at = np.flatnonzero(is_token)
            handles, tokens = events["handle"][at], events["token"][at]
        order = np.argsort(handles, kind="stable")  # stable: a request's tokens stay in order
        sorted_handles = handles[order]
        out.tokens = tokens[order]
        out._positions = order if every else at[order]  # each token's event (its logprobs record)
        if len(sorted_handles) < 2 or bool((sorted_handles[1:] != sorted_handles[:-1]).all()):
            out.handles, out.starts = sorted_handles, np.arange(len(sorted_handles))
            out.counts = np.ones(len(sorted_handles), np.int64)
        else:  # some request has several tokens in the batch (the completion thread fell behind)
            first = np.flatnonzero(np.r_[True, sorted_handles[1:] != sorted_handles[:-1]])
            out.handles, out.starts = sorted_handles[first], first
            out.counts = np.diff(np.r_[first, len(sorted_handles)])
        out.dones = []
        if not every:
            done = np.flatnonzero(kinds == layout.EventKind.DONE)
            out.dones = list(
                zip(
                    events["handle"][done].tolist(),
                    events["finish_reason"][done].tolist(),
                    events["queued_us"][done].tolist(),
                )
            )
        return out

    def token_ids(self, i: int) -> list[int]:
        start = int(self.starts[i])
        return self.tokens[start : start + int(self.counts[i])].tolist()

    def positions(self, i: int) -> list[int]:
        start = int(self.starts[i])
        return self._positions[start : start + int(self.counts[i])].tolist()

    def add_hot_frames(self, frames: ConnectionFrames, hot, hot_counts, connections, hot_ids) -> None:
        """The hot chunks into their connections' frames: `connections` is one client for them
        all (whole columns at once), or each chunk's (then chunk by chunk: many connections
        with a stream or two each, where grouping by arrays costs more than it saves)."""
        token_of_hot = np.repeat(hot, self.counts)  # per token in handle order: its chunk is hot
        hot_tokens = self.tokens[token_of_hot].tolist()
        counts = hot_counts.tolist()
        if isinstance(connections, bytes):
            frames.add_hot(connections, hot_ids.tolist(), counts, hot_tokens)
            return
        ids, seen = hot_ids.tolist(), {}
        for client in connections:
            seen[client] = client in seen  # True: the connection has several hot chunks
        at = 0
        for client, request_id, k in zip(connections, ids, counts):
            if seen[client]:
                frames.add_ids(client, request_id, hot_tokens[at : at + k])
            else:  # its one hot chunk: a plain frame, packed at once (one stream per connection)
                chunk = {"op": protocol.OP_TOKEN, "id": request_id, "token_ids": hot_tokens[at : at + k]}
                frames.add_packed(client, pack_frame(chunk))
            at += k
