"""The one place a request's `done` frame is made.

`Finisher.end` ends a request that was accepted into the RequestTable, whichever thread ends it
and why: the completion thread for a DONE from the device and for engine_dead, the frontend
thread for a request the device does not hold (aborted while queued on the host, shut down).
It removes the request from the table, and only the caller that wins that removal gets its
messages back; so every accepted request gets exactly one `done`, counted once in ServerMetrics.
The completion thread puts them in its connection's frames (a `batch` or plain ones) and hands
those over through the Outbox (outbox.py); the frontend sends them at once.

`reject_frame` is the `done` of a generate that was never accepted (bad request, duplicate id,
overloaded, shutdown or engine dead at arrival): it has no table entry and zero usage, and
Intake.reject (intake.py) alone sends it.
"""

from __future__ import annotations

import logging
import time

from ringleader.hostctl.serving.inflight import Ending, Family, InFlight, RequestTable
from ringleader.hostctl.serving.metrics import ServerMetrics
from ringleader.ipc import protocol
from ringleader.ipc.automaton import GrammarArena
from ringleader.ipc.rings import PromptArena

Frame = tuple[bytes, bytes]  # (client identity, encoded message)
Reply = tuple[bytes, dict]  # (client identity, message map), encoded by whoever sends it

log = logging.getLogger("ringleader.requests")


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


def done_message(
    req: InFlight,
    finish_reason: str,
    code: str | None = None,
    message: str | None = None,
    device_queued_us: int | None = None,
    timing: dict | None = None,
) -> dict:
    """timing: server_timing's, when the caller already has it (Finisher.end counts the same)."""
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
    msg["timing"] = timing if timing is not None else server_timing(req, device_queued_us)
    return msg


def family_done_message(family: Family) -> dict:
    """The one `done` of a request with n > 1, once every choice ended: usage with the prompt
    once and every choice's tokens, how each choice ended, and an error if any choice ended in
    one (the first by index; else the first choice's finish reason)."""
    ends = [family.ends[i] for i in range(family.n)]
    first = family.members[0]
    errors = [ending for ending, _ in ends if ending.finish_reason == protocol.FINISH_ERROR]
    ending = errors[0] if errors else ends[0][0]
    completion = sum(tokens for _, tokens in ends)
    # unstarted timeouts bill nothing, as done_frame does for one request
    unbilled = ending.code == protocol.ERR_TIMEOUT and completion == 0
    msg = protocol.done_msg(
        first.id,
        ending.finish_reason,
        0 if unbilled else first.prompt_len,
        completion,
        error_code=ending.code,
        error_message=ending.message,
        choices=[
            {"index": i, "finish_reason": end.finish_reason, "completion_tokens": tokens}
            for i, (end, tokens) in enumerate(ends)
        ],
    )
    started = [m.first_token_ns for m in family.members if m.first_token_ns]
    timing = {"e2e_ms": (time.perf_counter_ns() - first.arrival_ns) / 1e6}
    if started:
        timing["ttft_ms"] = (min(started) - first.arrival_ns) / 1e6
    msg["timing"] = timing
    return msg


def reject_frame(request_id: protocol.RequestId | None, code: str, message: str) -> bytes:
    """The `done` of a generate that is never accepted (usage is zero by the protocol)."""
    return protocol.encode(
        protocol.done_msg(request_id, protocol.FINISH_ERROR, 0, 0, error_code=code, error_message=message)
    )


def no_logprobs(req: InFlight) -> list[dict] | None:
    """The logprobs of a token frame that carries no token ids (a text tail, a choice's last
    chunk): an empty list for a request that asked, so every one of its frames has a list."""
    return [] if req.sampling.logprobs is not None else None


class Finisher:
    """Ends accepted requests; used by both threads (the table and the metrics lock)."""

    def __init__(
        self,
        table: RequestTable,
        metrics: ServerMetrics,
        arena: PromptArena,
        grammar: GrammarArena | None = None,
    ):
        self._table = table
        self._metrics = metrics
        self._arena = arena
        self._grammar = grammar

    def end(
        self,
        req: InFlight,
        reason: str,
        code: str | None = None,
        message: str | None = None,
        *,
        device_queued_us: int | None = None,
        tail: str | None = None,
    ) -> list[Reply]:
        """Ends `req` once: returns its messages to the caller that removed it from the table, []
        to everyone else (it had already ended).  A request's messages are its `done`; a choice of
        a request with n > 1 gets its last chunk (index, finish_reason, and `tail`, the text its
        detokenizer held back), and the last choice to end the request's one `done` after it.

        device_queued_us is given exactly when the DONE came from the device: only then is the
        prompt's arena space released here (if its first token did not release it already),
        since the device no longer reads it; so is its constraint's automaton's place in the
        grammar array.  A request ended on the host either never reached the arena, or belongs to
        a device that is dead or did not answer at shutdown."""
        family = req.family
        if self._table.finish(req.handle, Ending(reason, code, message)) is not req:
            return []
        if device_queued_us is not None and req.completion_tokens == 0 and req.arena_offset is not None:
            self._arena.release(req.arena_offset)
        if device_queued_us is not None and req.grammar_off is not None and self._grammar is not None:
            assert req.constraint is not None
            self._grammar.release(req.constraint.key)
        timing = server_timing(req, device_queued_us)
        self._metrics.finished(req, reason, code, timing)
        if log.isEnabledFor(logging.INFO):
            log.info(request_log_line(req, reason, code, timing))
        if family is None:
            return [(req.client, done_message(req, reason, code, message, timing=timing))]
        if req.index == 0:
            family.open_gate()  # its prompt is as cached as it will be: the others go ahead
        no_tokens = no_logprobs(req)
        last = protocol.token_msg(
            req.id, [], tail or None, index=req.index, logprobs=no_tokens, finish_reason=reason
        )
        replies = [(req.client, last)]
        if len(family.ends) == family.n:  # the table recorded every choice's end
            replies.append((req.client, family_done_message(family)))
        return replies


def request_log_line(req: InFlight, reason: str, code: str | None, timing: dict) -> str:
    """The one line each accepted request leaves in the log when it ends (at info)."""
    rid = repr(req.id)
    if len(rid) > 48:
        rid = rid[:45] + "..."
    ttft = timing.get("ttft_ms")
    choice = f" choice {req.index}" if req.family is not None else ""  # n > 1: one line per choice
    return (
        f"request {rid}{choice} of client {req.client.hex()}: {reason}{' ' + code if code else ''}, "
        f"{req.prompt_len} prompt + {req.completion_tokens} completion tokens, "
        f"TTFT {f'{ttft:.1f} ms' if ttft is not None else '-'}, total {timing['e2e_ms']:.1f} ms"
    )
