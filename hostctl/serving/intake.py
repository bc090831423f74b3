"""Intake: a generate's way in, where the server accepts it or refuses it.

A refused generate was never accepted: it has no table entry, and reject() sends its one `done`
(finisher.py:reject_frame), counted by its code.  It is refused, checked in this order, for a
duplicate id, a server shutting down, an engine that died, a client at its
--max-inflight-per-client, a prompt the model cannot tokenize or that does not fit the context,
a constraint (`structured`) the server cannot enforce, and a host queue that is full.  An
accepted one enters the table with its deadlines and goes to admission (admission.py; a
constraint not yet compiled holds it there: constraints.py), or as n choices to families.py; from
then on Finisher.end alone ends it.

Used by the frontend thread only.  It reads the engine's death from the completion thread
(CompletionRouter.dead_reason: written once, never changed) and the table under the table's lock.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ringleader.hostctl.serving.admission import Admission
from ringleader.hostctl.serving.constraints import Constraints
from ringleader.hostctl.serving.deadlines import Deadlines
from ringleader.hostctl.serving.families import Families, random_seed
from ringleader.hostctl.serving.finisher import reject_frame
from ringleader.hostctl.serving.inflight import RequestTable
from ringleader.hostctl.serving.metrics import ServerMetrics
from ringleader.hostctl.serving.outbox import Outbox
from ringleader.hostctl.serving.tokenization import Prompt, Tokenization
from ringleader.ipc import protocol
from ringleader.ipc.structured import StructuredError


class Refused(Exception):
    """Why a generate is not accepted: its `done`'s error code and message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Intake:
    """dead_reason: why the engine is dead, None while it lives (CompletionRouter.dead_reason);
    max_inflight_per_client: ServerConfig's (0: no cap)."""

    def __init__(
        self,
        table: RequestTable,
        admission: Admission,
        deadlines: Deadlines,
        tokenization: Tokenization,
        families: Families,
        constraints: Constraints,
        metrics: ServerMetrics,
        outbox: Outbox,
        dead_reason: Callable[[], str | None],
        *,
        max_inflight_per_client: int,
    ):
        self._table = table
        self._admission = admission
        self._deadlines = deadlines
        self._tokenization = tokenization
        self._families = families
        self._constraints = constraints
        self._metrics = metrics
        self._outbox = outbox
        self._dead_reason = dead_reason
        self._max_inflight_per_client = max_inflight_per_client
        self._accepting = True

    def stop_accepting(self) -> None:
        """From now on every generate is refused as shutdown."""
        self._accepting = False

    def generate(self, client: bytes, r: protocol.GenerateRequest) -> None:
        """Accepts the request, or refuses it with its one `done`."""
        try:
            prompt = self._check(client, r)
        except Refused as refusal:
            self.reject(client, r.id, refusal.code, refusal.message)
            return
        self._accept(client, r, prompt)

    def reject(self, client: bytes, request_id: protocol.RequestId | None, code: str, message: str) -> None:
        """Answers a generate that is never accepted (it has no table entry): counts it, sends
        reject_frame's `done`."""
        self._metrics.rejected(code)
        self._outbox.send(client, reject_frame(request_id, code, message))

    def _check(self, client: bytes, r: protocol.GenerateRequest) -> Prompt:
        """The request's prompt, if the server can take it now; else Refused, the first reason."""
        if self._table.contains(client, r.id):
            raise Refused(protocol.ERR_DUPLICATE_ID, f"id: {r.id!r} is already in flight for this client")
        if not self._accepting:
            raise Refused(protocol.ERR_SHUTDOWN, "server is not accepting requests: shutting down")
        dead_reason = self._dead_reason()
        if dead_reason is not None:
            raise Refused(protocol.ERR_ENGINE_DEAD, f"server is not accepting requests: {dead_reason}")
        cap = self._max_inflight_per_client
        if cap and self._table.count_of(client) >= cap:
            raise Refused(
                protocol.ERR_OVERLOADED,
                f"overloaded: this client already has {cap} requests in flight "
                f"(the server's --max-inflight-per-client)",
            )
        try:
            prompt = self._tokenization.prompt(r)
            self._constraints.check(r.structured)
        except protocol.BadRequest as exc:
            raise Refused(protocol.ERR_BAD_REQUEST, exc.message) from None
        except StructuredError as exc:
            raise Refused(protocol.ERR_BAD_REQUEST, str(exc)) from None
        if not self._admission.can_accept(len(prompt.ids), r.sampling.n):
            raise Refused(
                protocol.ERR_OVERLOADED,
                f"overloaded: {self._admission.queued} requests already wait for a slot",
            )
        return prompt

    def _accept(self, client: bytes, r: protocol.GenerateRequest, prompt: Prompt) -> None:
        sampling = r.sampling
        if sampling.max_tokens != prompt.max_tokens:
            sampling = sampling.with_max_tokens(prompt.max_tokens)
        ids = np.asarray(prompt.ids, dtype=np.int32)
        n = r.sampling.n
        if n == 1:
            if sampling.seed is None:
                sampling = sampling.with_seed(random_seed())
            req = self._table.add(
                client,
                r.id,
                prompt_ids=ids,
                sampling=sampling,
                priority=r.priority,
                detokenizer=self._tokenization.new_detokenizer(r) if r.detokenize else None,
                constraint=r.structured,
            )
            self._deadlines.arm(req, r.timeout_ms)
            if r.structured is None or self._constraints.attach([req], r.structured):
                self._admission.submit(req)  # _check made sure admission can take it
            else:
                self._admission.hold_gated(req)  # until its constraint is compiled
        else:  # can_accept counted all n; a constraint not yet compiled holds them all
            structured = r.structured
            self._families.submit(
                client,
                r,
                ids,
                sampling,
                ready=lambda members: structured is None or self._constraints.attach(members, structured),
            )
        self._metrics.accepted += n  # a request of n choices counts as n, as each ends on its own
