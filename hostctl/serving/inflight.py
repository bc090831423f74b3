"""A request from acceptance until its one `done` is sent: the host's request table.

Written by the frontend thread (add, mark_in_sq) and by both threads through Finisher.end
(finish); all of it under the lock.  A request leaves the table exactly once (`finish`), which
is what makes its `done` unique.  The table also keeps, under the same lock, what admission and
fairness need in O(1): the requests of each client, and how many requests have entered the SQ
and not ended.

Fields of InFlight and their one writer (the other thread only reads):
  handle, client, id, prompt_ids,
  sampling, priority, detokenizer,
  arrival_ns                   set at creation, never written again (the detokenizer is used by
                               the completion thread only)
  in_sq, sq_pos                frontend thread, under the table lock (mark_in_sq)
  arena_offset, submit_ns      frontend thread, before the GENERATE is published; the completion
                               thread reads them after the request's first event
  abort_sent, deadline_ns,
  queue_deadline_ns            frontend thread, which alone reads them too
  end_as                       frontend thread, only before the request's abort enters the ring;
                               the completion thread reads it after it sees the request's DONE
                               (the Ending that DONE's abort becomes); never written again
  queue_end_as                 the same, for its IF_QUEUED abort (the queue deadline's), which
                               the device applies only while the request waits for a slot
  first_token_ns,
  completion_tokens            completion thread; the frontend reads them (timeouts, and the
                               usage of a `done` it sends itself)
  last_token_ns                completion thread (the inter-token gap); read by whichever thread
                               ends the request (time per output token).  A hot request's two
                               live in the table's columns until it leaves the table, which
                               writes them back first (stream_columns.py)
  constraint                   set at creation: its output's constraint (ipc/structured.py)
  automaton, grammar_off       frontend thread, before its GENERATE is published (constraints.py
                               and admission.py); the finisher reads grammar_off after its DONE
  index, family                set at creation (a request with n > 1 is a Family of n InFlights
                               under one id, each with its own handle, seed and SQ entry); the
                               family's `ends` are written under the table lock (RequestTable.finish)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringleader.hostctl.serving.stream_columns import StreamColumns
from ringleader.ipc import protocol
from ringleader.ipc.automaton import Automaton
from ringleader.ipc.sampling_params import SamplingParams
from ringleader.ipc.structured import StructuredSpec


def wants_records(sampling: SamplingParams) -> bool:
    """Its events carry cq_logprobs records: its tokens' logprobs, or its prompt's."""
    return sampling.logprobs is not None or sampling.prompt_logprobs is not None


@dataclass(frozen=True, slots=True)
class Ending:
    """How a request the host stops ends: its `done`'s finish reason, with (code, message) for
    "error".  An abort from a client ends as "abort", or as "stop" when the client found its own
    stop (a stop string); a timeout or a shutdown ends as an error."""

    finish_reason: str
    code: str | None = None
    message: str | None = None

    def __post_init__(self) -> None:
        if (self.finish_reason == protocol.FINISH_ERROR) != (self.code is not None):
            raise ValueError(f"an error ending needs a code and only it has one: {self}")


@dataclass(eq=False)
class Family:
    """The n choices of one request with n > 1: one InFlight each (index 0..n-1), one `done` for
    them all, made when the last one ends (Finisher.end).  `ends` (index -> how it ended and its
    completion tokens) is written under the table lock by whichever thread ends a member.

    Prefill once: where the prefix cache can share the prompt, members 1..n-1 wait on the host
    until the first one's prompt is cached (its first token, or its end): `gate` is called once
    then, by the completion thread (or whichever thread ends member 0 first)."""

    members: list[InFlight] = field(default_factory=list)
    ends: dict[int, tuple[Ending, int]] = field(default_factory=dict)
    gate: Callable[[Family], None] | None = None

    @property
    def n(self) -> int:
        return len(self.members)

    def open_gate(self) -> None:
        gate, self.gate = self.gate, None  # once; a race between two threads only repeats a no-op
        if gate is not None:
            gate(self)


@dataclass(eq=False)
class InFlight:
    handle: int
    client: bytes
    id: Any
    prompt_ids: Any  # numpy int32 tokens, kept until they are in the arena
    sampling: SamplingParams  # its seed resolved
    priority: int
    detokenizer: Any = None  # None: the server has no tokenizer, or the request asked for ids only
    arena_offset: int | None = None  # frontend thread, once the prompt is in the arena
    # frontend thread, under the table lock: its GENERATE entry was written to the SQ (the device
    # owns it now), and the SQ index of that entry, which its abort names
    in_sq: bool = False
    sq_pos: int = 0
    abort_sent: bool = False  # frontend thread only
    # frontend thread, only before its abort enters the ring; read by the completion thread after
    # the DONE: what the device's abort becomes (a stop, an error such as timeout)
    end_as: Ending | None = None
    queue_end_as: Ending | None = None  # as end_as, for the queue deadline's IF_QUEUED abort
    completion_tokens: int = 0  # completion thread
    arrival_ns: int = field(default_factory=time.perf_counter_ns)
    submit_ns: int = 0  # frontend thread, when it enters the SQ
    first_token_ns: int = 0  # completion thread
    last_token_ns: int = 0  # completion thread: when its latest token frame was routed
    deadline_ns: int = 0  # frontend thread only: perf_counter_ns by which it must end (0: none)
    queue_deadline_ns: int = 0  # frontend thread only: by when its first token must come (0: none)
    index: int = 0  # its choice, of a request with n > 1
    family: Family | None = None  # the request's choices when n > 1; set at creation
    constraint: StructuredSpec | None = None  # structured output: set at creation
    automaton: Automaton | None = None  # the constraint compiled; frontend thread
    grammar_off: int | None = None  # where admission placed it in the grammar array
    # prompt logprobs (completion thread): its PROMPT events so far, per CQ batch (their prompt
    # positions, their records); None once its prompt message went out, or when it asked none
    prompt_scores: list | None = None

    def __post_init__(self) -> None:
        if self.sampling.prompt_logprobs is not None:
            self.prompt_scores = []

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def started(self) -> bool:
        return self.first_token_ns != 0


class RequestTable:
    def __init__(self):
        self._lock = threading.Lock()  # everything below is read and written under it, by both threads
        self._by_handle: dict[int, InFlight] = {}
        self._by_key: dict[tuple[bytes, Any], InFlight] = {}
        self._by_client: dict[bytes, dict[int, InFlight]] = {}
        self._in_sq = 0
        self._with_logprobs = 0  # requests in the table that asked for logprobs
        self._columns = StreamColumns()  # each request's row: its handle, and the hot path's counts

    def __len__(self) -> int:
        return len(self._by_handle)

    @property
    def in_sq(self) -> int:
        """Requests the device holds (written to the SQ, not ended): what the admission window bounds."""
        return self._in_sq

    @property
    def with_logprobs(self) -> int:
        """Requests in the table that asked for logprobs or prompt logprobs (the completion
        thread reads their records from the CQ only while there are some)."""
        return self._with_logprobs

    @staticmethod
    def key(client: bytes, request_id: Any) -> tuple:
        return (client, type(request_id).__name__, request_id)  # 1 and "1" are different ids

    def contains(self, client: bytes, request_id: Any) -> bool:
        with self._lock:
            return self.key(client, request_id) in self._by_key

    def add(self, client: bytes, request_id: Any, **fields) -> InFlight:
        with self._lock:
            req = self._add(client, request_id, fields)
            self._by_key[self.key(client, request_id)] = req
            return req

    def add_family(self, client: bytes, request_id: Any, samplings: list[SamplingParams], **fields) -> Family:
        """The choices of a request with n = len(samplings) > 1, one InFlight each, under one id."""
        with self._lock:
            family = Family()
            for index, sampling in enumerate(samplings):
                member = self._add(client, request_id, {**fields, "sampling": sampling})
                member.index, member.family = index, family
                family.members.append(member)
            self._by_key[self.key(client, request_id)] = family.members[0]
            return family

    def _add(self, client: bytes, request_id: Any, fields: dict) -> InFlight:
        handle = self._columns.take(self._columns.client_number(client), request_id)
        req = InFlight(handle=handle, client=client, id=request_id, **fields)
        self._with_logprobs += wants_records(req.sampling)
        self._by_handle[handle] = req
        self._by_client.setdefault(client, {})[handle] = req
        return req

    def mark_in_sq(self, req: InFlight, sq_pos: int) -> None:
        """Records that its GENERATE entry is in the SQ (not counted if it ended meanwhile)."""
        with self._lock:
            if self._by_handle.get(req.handle) is req:
                req.in_sq, req.sq_pos = True, sq_pos
                self._in_sq += 1

    def get(self, handle: int) -> InFlight | None:
        with self._lock:
            return self._by_handle.get(handle)

    def lookup(self, handles: list[int]) -> list[InFlight | None]:
        """The requests of many handles under one lock (None for one that ended)."""
        with self._lock:
            get = self._by_handle.get
            return [get(h) for h in handles]

    def make_hot(self, req: InFlight) -> None:
        """Completion thread, once `req`'s first token is routed, for a request that asked for
        token ids alone: its tokens are counted by advance_hot from now on (stream_columns.py)."""
        with self._lock:
            self._columns.make_hot(req)

    def advance_hot(self, handles: np.ndarray, counts: np.ndarray, now_ns: int) -> tuple[Any, ...]:
        """Completion thread: one batch's chunks (unique handles, token counts).  The hot ones
        are counted and stamped at once; returns (hot mask, their gaps per token in ns, their
        connections as StreamColumns.connections, their request ids (an object array), live
        mask: the chunks whose request is still in the table)."""
        with self._lock:
            hot, rows, gaps, numbers, live = self._columns.advance(handles, counts, now_ns)
            return hot, gaps, self._columns.connections(numbers), self._columns.ids[rows], live

    def find(self, client: bytes, request_id: Any) -> list[InFlight]:
        """The live requests under the client's id: one, the choices of a request with n > 1
        that have not ended, or none."""
        with self._lock:
            req = self._by_key.get(self.key(client, request_id))
            if req is None:
                return []
            if req.family is None:
                return [req]
            return [m for m in req.family.members if self._by_handle.get(m.handle) is m]

    def of_client(self, client: bytes) -> list[InFlight]:
        with self._lock:
            return list(self._by_client.get(client, {}).values())

    def count_of(self, client: bytes) -> int:
        with self._lock:
            return len(self._by_client.get(client, ()))

    def all(self) -> list[InFlight]:
        with self._lock:
            return list(self._by_handle.values())

    def finish(self, handle: int, ending: Ending | None = None) -> InFlight | None:
        """Removes the request; only the caller that gets it back may send its `done` (or, for
        a choice of a request with n > 1, its last chunk: `ending` is recorded in its family,
        and the id stays taken until every choice ended).  Called by Finisher.end only."""
        with self._lock:
            req = self._by_handle.pop(handle, None)
            if req is not None:
                self._columns.release(req)  # a hot request's counts come back first
                family = req.family
                if family is not None:
                    assert ending is not None
                    family.ends[req.index] = (ending, req.completion_tokens)
                if family is None or len(family.ends) == family.n:
                    self._by_key.pop(self.key(req.client, req.id), None)
                mine = self._by_client.get(req.client)
                if mine is not None:
                    mine.pop(handle, None)
                    if not mine:
                        del self._by_client[req.client]
                        self._columns.forget_client(req.client)
                if req.in_sq:
                    self._in_sq -= 1
                self._with_logprobs -= wants_records(req.sampling)
            return req
