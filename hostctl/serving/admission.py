"""Admission: accepted requests wait in a host queue, fair across clients, and enter the SQ and
the prompt arena while the device holds fewer than `device_window` requests; past the queue's
bound a request is rejected as overloaded.  Aborts never wait behind generates: they go to their
own ring (ringleader.ipc.rings.AbortQueue), which the device reads every step.

Used by the frontend thread only, which makes it the single writer of the SQ and the abort ring.
The host never decides what runs in a step: it only forwards requests and aborts.

Why a window: whatever sits in the SQ or the device's pending queue is served in arrival order,
so a client that sends 1,000 requests at once would put them all ahead of everyone else's.  With
at most `device_window` requests on the device (two batches' worth: one running, one ready to
refill freed slots), the order that matters is the host queue's, and that one is round-robin
across clients (within a client: by priority, then arrival).  Priority is the client's own word,
so it orders a client's requests and what the device holds, never one client ahead of another:
otherwise `priority: 1000` would be all a hostile client needs to starve everyone.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict, deque

import numpy as np

from ringleader.hostctl.serving.inflight import InFlight, RequestTable
from ringleader.ipc.rings import HostRings


class Admission:
    def __init__(
        self,
        rings: HostRings,
        table: RequestTable,
        *,
        max_queued: int,
        max_queued_tokens: int,
        device_window: int | None = None,
    ):
        """max_queued, max_queued_tokens: the host queue's bounds (ServerConfig's); device_window:
        requests on the device at most (None: two batches' worth, as far as the rings hold)."""
        self._rings = rings
        self._table = table
        self._waiting: dict[int, InFlight] = {}  # handle -> request still on the host
        # client -> heap of (-priority, arrival seq, handle); entries of ended requests are skipped
        self._queues: OrderedDict[bytes, list[tuple[int, int, int]]] = OrderedDict()
        self._waiting_of: dict[bytes, int] = {}  # client -> how many of its requests are on the host
        self._arrivals = itertools.count()
        self._queued_tokens = 0
        # aborts the abort ring had no room for, each with its IF_QUEUED bit
        self._abort_backlog: deque[tuple[InFlight, bool]] = deque()
        # handles of requests held on the host until release_gated (later choices of a request
        # with n > 1, waiting for the first one's prompt to be cached); in _waiting, not queued
        self._gated: set[int] = set()
        self.max_queued = max_queued
        self.max_queued_tokens = max_queued_tokens
        cfg = rings.config
        self.device_window = device_window or min(2 * cfg.n_slots, cfg.sq_size + cfg.pending_cap)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def waits_for_ring_space(self) -> bool:
        """True when work is held back by a full SQ, arena or abort ring (or a grammar array
        full of running requests' automata), which the device frees without telling the host (a
        full window opens on a DONE, which wakes the frontend)."""
        queued = len(self._waiting) > len(self._gated)
        return bool(self._abort_backlog) or (queued and self._window_open())

    def can_accept(self, prompt_len: int, count: int = 1) -> bool:
        """Whether `count` requests of prompt_len tokens (the choices of one request) fit."""
        if not self._waiting:
            return True  # they may go straight in; if not, they are the first ones queued
        return (
            len(self._waiting) + count <= self.max_queued
            and self._queued_tokens + count * prompt_len <= self.max_queued_tokens
        )

    def submit(self, req: InFlight) -> bool:
        """Writes the request to the SQ or queues it; False means rejected (overloaded)."""
        if not self.can_accept(req.prompt_len):
            return False
        if not self._waiting and self._window_open() and self._write_generate(req):
            return True
        self._hold(req)
        self._enqueue(req)
        return True

    def hold_gated(self, req: InFlight) -> None:
        """Holds an accepted request on the host until release_gated(req) (an abort or a shutdown
        ends it there as it would a queued one)."""
        self._hold(req)
        self._gated.add(req.handle)

    def release_gated(self, req: InFlight) -> None:
        """Queues a request hold_gated held, if it is still waiting."""
        if req.handle in self._gated:
            self._gated.discard(req.handle)
            self._enqueue(req)

    def _enqueue(self, req: InFlight) -> None:
        heap = self._queues.setdefault(req.client, [])
        heapq.heappush(heap, (-req.priority, next(self._arrivals), req.handle))
        if len(heap) > 2 * self._waiting_of[req.client] + 64:  # many ended while queued
            self._compact(req.client)

    def abort(self, req: InFlight, *, if_queued: bool = False) -> bool:
        """Aborts a request.  Returns True when it was still on the host: then no DONE will come
        from the device, and the caller ends it itself.  if_queued: only while its prefill has
        not started; the device then cancels it in the SQ or its pending queue, and leaves it
        running once it holds a slot (a later plain abort still ends it)."""
        if req.handle in self._waiting:
            self._release(req)
            return True
        if not req.in_sq or req.abort_sent:
            return False
        if not if_queued:
            req.abort_sent = True
        if self._abort_backlog or not self._rings.aborts.push(req.handle, req.sq_pos, if_queued=if_queued):
            self._abort_backlog.append((req, if_queued))
        return False

    def is_gated(self, req: InFlight) -> bool:
        """Whether hold_gated holds it (waiting for its family's prompt, or its constraint)."""
        return req.handle in self._gated

    def pump(self) -> None:
        """Sends held-back aborts, then moves queued requests into the SQ, one client at a time,
        while the window, the SQ and the arena have room."""
        while self._abort_backlog:
            req, if_queued = self._abort_backlog[0]
            if not self._rings.aborts.push(req.handle, req.sq_pos, if_queued=if_queued):
                break
            self._abort_backlog.popleft()
        while self._queues and self._window_open():
            client, heap = next(iter(self._queues.items()))
            while heap and heap[0][2] not in self._waiting:
                heapq.heappop(heap)
            if not heap:
                del self._queues[client]
                continue
            req = self._waiting[heap[0][2]]
            if not self._write_generate(req):
                break
            heapq.heappop(heap)
            self._release(req)
            if heap:
                self._queues.move_to_end(client)  # round-robin: the next request is someone else's
            else:
                del self._queues[client]

    def publish(self) -> bool:
        """Makes everything written so far visible to the device; True if anything was new."""
        generates = self._rings.submissions.publish()
        aborts = self._rings.aborts.publish()
        return generates or aborts

    def drop_queued(self) -> list[InFlight]:
        """Empties the host queue (shutdown); returns the requests that never reached the SQ."""
        dropped = list(self._waiting.values())
        self._waiting.clear()
        self._gated.clear()
        self._waiting_of.clear()
        self._queues.clear()
        self._queued_tokens = 0
        return dropped

    def _hold(self, req: InFlight) -> None:
        self._waiting[req.handle] = req
        self._waiting_of[req.client] = self._waiting_of.get(req.client, 0) + 1
        self._queued_tokens += req.prompt_len

    def _release(self, req: InFlight) -> None:
        del self._waiting[req.handle]
        self._gated.discard(req.handle)
        left = self._waiting_of[req.client] - 1
        if left:
            self._waiting_of[req.client] = left
        else:
            del self._waiting_of[req.client]
        self._queued_tokens -= req.prompt_len

    def _window_open(self) -> bool:
        return self._table.in_sq < self.device_window

    def _compact(self, client: bytes) -> None:
        heap = [e for e in self._queues[client] if e[2] in self._waiting]
        heapq.heapify(heap)
        self._queues[client] = heap

    def _write_generate(self, req: InFlight) -> bool:
        sq = self._rings.submissions
        if sq.free_entries() < 1 or not self._rings.can_write_prompt(req.prompt_len):
            return False
        grammar, grammar_off = self._rings.grammar, None
        if req.automaton is not None:  # its constraint's automaton, in place before the entry
            assert req.constraint is not None and grammar is not None
            grammar_off = grammar.place(req.constraint.key, req.automaton.words)
            if grammar_off is None:  # running requests hold the room it needs: wait for them
                return False
        offset = self._rings.write_prompt(np.asarray(req.prompt_ids, dtype=np.int32))
        if offset is None:
            if grammar is not None and req.constraint is not None and grammar_off is not None:
                grammar.release(req.constraint.key)
            return False
        pos = sq.push(
            req.handle,
            req.sampling,
            prompt_off=offset,
            prompt_len=req.prompt_len,
            priority=req.priority,
            grammar_off=grammar_off,
        )
        req.grammar_off = grammar_off
        req.arena_offset = offset
        req.submit_ns = time.perf_counter_ns()
        self._table.mark_in_sq(req, pos)
        return True
