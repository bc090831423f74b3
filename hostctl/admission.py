"""Admission: accepted requests go into the SQ and the prompt arena, or wait in a bounded host
queue while those are full; past that bound a request is rejected as overloaded.

Used by the frontend thread only, which makes it the single writer of the SQ.  The host never
decides what runs in a step: it only forwards requests and aborts in arrival order.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from hostctl.inflight import InFlight
from ipc import layout
from ipc.rings import HostRings


class Admission:
    def __init__(self, rings: HostRings, *, max_queued: int = 4096,
                 max_queued_tokens: int = 1 << 22):
        self._rings = rings
        self._queue: deque[tuple[int, InFlight]] = deque()  # (op, request) in arrival order
        self._queued_tokens = 0
        self.max_queued = max_queued
        self.max_queued_tokens = max_queued_tokens

    @property
    def queued(self) -> int:
        return len(self._queue)

    def can_accept(self, prompt_len: int) -> bool:
        if not self._queue:
            return True  # it may go straight in; if not, it is the first one queued
        return (len(self._queue) < self.max_queued
                and self._queued_tokens + prompt_len <= self.max_queued_tokens)

    def submit(self, req: InFlight) -> bool:
        """Queues or writes the request; False means rejected (overloaded)."""
        if not self.can_accept(req.prompt_len):
            return False
        if not self._queue and self._write_generate(req):
            return True
        self._queue.append((layout.RL_OP_GENERATE, req))
        self._queued_tokens += req.prompt_len
        return True

    def abort(self, req: InFlight) -> bool:
        """Aborts a request.  Returns True when it was still on the host: then no DONE will come
        from the device, and the caller ends it itself."""
        if not req.in_device:
            for i, (op, queued) in enumerate(self._queue):
                if queued is req:
                    del self._queue[i]
                    self._queued_tokens -= req.prompt_len
                    return True
            return False
        if req.abort_sent:
            return False
        req.abort_sent = True
        if self._queue or not self._write_abort(req):
            self._queue.append((layout.RL_OP_ABORT, req))
        return False

    def pump(self) -> None:
        """Moves queued operations into the SQ while it and the arena have room."""
        while self._queue:
            op, req = self._queue[0]
            written = (self._write_generate(req) if op == layout.RL_OP_GENERATE
                       else self._write_abort(req))
            if not written:
                break
            self._queue.popleft()
            if op == layout.RL_OP_GENERATE:
                self._queued_tokens -= req.prompt_len

    def publish(self) -> bool:
        """Makes everything written so far visible to the device; True if anything was new."""
        return self._rings.submissions.publish()

    def drop_queued(self) -> list[InFlight]:
        """Empties the host queue (shutdown); returns the generates that never reached the SQ."""
        dropped = [req for op, req in self._queue if op == layout.RL_OP_GENERATE]
        self._queue.clear()
        self._queued_tokens = 0
        return dropped

    def _write_generate(self, req: InFlight) -> bool:
        sq, arena = self._rings.submissions, self._rings.arena
        if sq.free_entries() < 1 or not arena.can_allocate(req.prompt_len):
            return False
        offset = arena.allocate(np.asarray(req.prompt_ids, dtype=np.int32))
        if offset is None:
            return False
        sq.push(layout.RL_OP_GENERATE, req.handle, prompt_off=offset,
                prompt_len=req.prompt_len, max_tokens=req.max_tokens,
                flags=layout.RL_FLAG_IGNORE_EOS if req.ignore_eos else 0,
                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                priority=req.priority, seed=req.seed, stop_ids=req.stop_ids)
        req.arena_offset = offset
        req.in_device = True
        req.submit_ns = time.perf_counter_ns()
        return True

    def _write_abort(self, req: InFlight) -> bool:
        sq = self._rings.submissions
        if sq.free_entries() < 1:
            return False
        sq.push(layout.RL_OP_ABORT, req.handle)
        return True
