"""A request with n > 1: n choices under one id, the prompt prefilled once where the prefix cache
can share it.

Choice i samples with seed + i (each its own random seed when the request gave none), and is a
request of its own on the host and the device (its table entry, deadlines and SQ entry); the
Family ties them to one `done` (inflight.py, finisher.py).  Where the prefix cache can share the
prompt, choices 1..n-1 wait on the host (Admission.hold_gated) until choice 0's prompt is cached:
its first token, or its end, opens the family's gate, and then they prefill only what the cache
does not hold (the last partial page).

Used by the frontend thread, but for the gate: whichever thread opens it (the completion thread,
mostly) appends the family to `_opened` (a deque: append and popleft are safe across threads)
and wakes the frontend, which queues the waiting choices (release_opened).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

import numpy as np

from ringleader.hostctl.serving.admission import Admission
from ringleader.hostctl.serving.deadlines import Deadlines
from ringleader.hostctl.serving.inflight import Family, InFlight, RequestTable
from ringleader.hostctl.serving.tokenization import Tokenization
from ringleader.ipc import protocol
from ringleader.ipc.sampling_params import UINT64_MAX, SamplingParams


def random_seed() -> int:
    """The seed of a request (or choice) that gave none."""
    return int.from_bytes(os.urandom(8), "little")


class Families:
    """shared_prefill_len: a prompt longer than this shares its full pages' KV through the prefix
    cache (the page size; 0 without prefix caching)."""

    def __init__(
        self,
        table: RequestTable,
        admission: Admission,
        deadlines: Deadlines,
        tokenization: Tokenization,
        wake: Callable[[], None],
        *,
        shared_prefill_len: int,
    ):
        self._table = table
        self._admission = admission
        self._deadlines = deadlines
        self._tokenization = tokenization
        self._wake = wake
        self._shared_prefill_len = shared_prefill_len
        self._opened: deque[Family] = deque()  # families whose later choices may now be queued

    def submit(
        self,
        client: bytes,
        r: protocol.GenerateRequest,
        prompt: np.ndarray,
        sampling: SamplingParams,
        ready: Callable[[list[InFlight]], bool] = lambda members: True,
    ) -> None:
        """Accepts the request's sampling.n choices: each in the table with its deadlines, choice 0
        (every choice, where the prompt is not shared) into admission, the others held until the
        gate opens.  ready(members): False holds them all on the host (their constraint is being
        compiled: constraints.py queues them).  The caller checked that admission can take all n."""
        base = sampling.seed
        seeds = [random_seed() if base is None else (base + i) & UINT64_MAX for i in range(sampling.n)]
        family = self._table.add_family(
            client,
            r.id,
            # the prompt is scored once, by choice 0
            [
                sampling.with_seed(seed).without_prompt_logprobs() if i else sampling.with_seed(seed)
                for i, seed in enumerate(seeds)
            ],
            prompt_ids=prompt,
            priority=r.priority,
            constraint=r.structured,
        )
        # the page of the prompt's last token runs again whatever the cache holds: its row samples
        shared = 0 < self._shared_prefill_len < len(prompt)
        if shared:
            family.gate = self._open
        held = not ready(family.members)
        for member in family.members:
            member.detokenizer = self._tokenization.new_detokenizer(r) if r.detokenize else None
            self._deadlines.arm(member, r.timeout_ms)
            if not held and (member.index == 0 or not shared):
                self._admission.submit(member)
            else:
                self._admission.hold_gated(member)

    def release_opened(self) -> None:
        """Queues the held choices of every family whose gate opened.  Frontend thread."""
        while self._opened:
            for member in self._opened.popleft().members[1:]:
                self._admission.release_gated(member)

    def _open(self, family: Family) -> None:
        """Family.gate, from any thread: the frontend queues the family's later choices."""
        self._opened.append(family)
        self._wake()
