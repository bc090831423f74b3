"""Per-request timelines -> the numbers of a run (client-side latency and throughput).

A RequestRecord holds what the load generator saw of one request, on one monotonic clock
(time.perf_counter, seconds): when it was sent, when each `token` message arrived and how many
tokens it carried, when its `done` arrived and what it said.

Definitions (all per request, in milliseconds in the run summary):
- TTFT: first token message's arrival - send time. It includes the time the request waited
  for a batch slot (queue time) and its prefill.
- queue time: from the server's `done.timing.queue_ms` (waiting for ring space on the host plus
  waiting in the device's pending queue for a slot, on the server's clocks); TTFT - queue is
  prefill plus transport ("ttft_after_queue_ms").
- decode time: E2E - TTFT (from the first token to the done message).
- Only messages that carry tokens count as arrivals (the server may flush leftover text in a
  token message with no token ids just before `done`).
- TPOT: (last token arrival - first token arrival) / (tokens - 1); requests with < 2 tokens
  have none.
- ITL: one gap per generated token after the first. A message carrying k tokens arrives as
  one gap (since the previous message) followed by k-1 zero gaps, because the client sees
  those k tokens at the same instant. So a request with n tokens gives exactly n-1 ITL
  samples, and their sum is last arrival - first arrival (mean ITL == TPOT).
- E2E: done arrival - send time.
Percentiles are numpy's (linear interpolation); an empty sample set gives None for every field.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

FINISH_OK = ("stop", "length")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    max_tokens: int
    send_t: float = 0.0
    chunk_t: list[float] = field(default_factory=list)  # arrival time of each token message
    chunk_n: list[int] = field(default_factory=list)  # tokens in that message
    done_t: float | None = None
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    completion_tokens: int = 0  # as reported by the server's done.usage
    server_queue_ms: float | None = None  # done.timing.queue_ms, when the server sends it

    @property
    def ok(self) -> bool:
        return self.done_t is not None and self.finish_reason in FINISH_OK

    @property
    def output_tokens(self) -> int:
        """Tokens the client actually received."""
        return int(sum(self.chunk_n))

    def token_times(self) -> list[float]:
        """Arrival times of the messages that carried tokens (a text-only flush carries none)."""
        return [t for t, k in zip(self.chunk_t, self.chunk_n) if k > 0]

    def ttft(self) -> float | None:
        times = self.token_times()
        return times[0] - self.send_t if times else None

    def e2e(self) -> float | None:
        return self.done_t - self.send_t if self.done_t is not None else None

    def decode_time(self) -> float | None:
        ttft, e2e = self.ttft(), self.e2e()
        return e2e - ttft if ttft is not None and e2e is not None else None

    def tpot(self) -> float | None:
        n = self.output_tokens
        if n < 2:
            return None
        times = self.token_times()
        return (times[-1] - times[0]) / (n - 1)

    def itl(self) -> list[float]:
        gaps: list[float] = []
        prev = None
        for t, k in zip(self.chunk_t, self.chunk_n):
            if k <= 0:
                continue
            if prev is not None:  # the first message's first token is the TTFT, not a gap
                gaps.append(t - prev)
            gaps.extend([0.0] * (k - 1))
            prev = t
        return gaps


def summarize(values: Iterable[float], scale: float = 1.0) -> dict:
    """{'mean', 'p50', 'p90', 'p99'} of values * scale; None everywhere when there are none."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64) * scale
    if arr.size == 0:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    out = {"mean": float(arr.mean())}
    for q, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES)):
        out[f"p{q}"] = float(v)
    return out


def percentile(values: Iterable[float], q: float) -> float | None:
    arr = np.asarray(list(values), dtype=np.float64)
    return float(np.percentile(arr, q)) if arr.size else None


def latency_samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Per-metric samples in milliseconds over the successful requests (for CDF plots)."""
    ok = [r for r in records if r.ok]
    ms = 1e3
    return {
        "ttft_ms": [r.ttft() * ms for r in ok if r.ttft() is not None],
        "tpot_ms": [r.tpot() * ms for r in ok if r.tpot() is not None],
        "itl_ms": [g * ms for r in ok for g in r.itl()],
        "e2e_ms": [r.e2e() * ms for r in ok],
        "decode_ms": [r.decode_time() * ms for r in ok if r.decode_time() is not None],
        "queue_ms": [r.server_queue_ms for r in ok if r.server_queue_ms is not None],
        "ttft_after_queue_ms": [
            r.ttft() * ms - r.server_queue_ms
            for r in ok
            if r.server_queue_ms is not None and r.ttft() is not None
        ],
    }


def run_metrics(records: list[RequestRecord]) -> dict:
    """Counts, throughput and latency distributions of one measured run."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    sent = [r.send_t for r in records if r.done_t is not None or r.chunk_t]
    ends = [r.done_t for r in records if r.done_t is not None]
    duration = (max(ends) - min(sent)) if sent and ends else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in failed:
        code = r.error_code or (r.finish_reason or "no_reply")
        errors[code] = errors.get(code, 0) + 1
    samples = latency_samples(records)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    return {
        "completed": len(ok),
        "failed": len(failed),
        "errors": errors,
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_tokens_per_s": per_s(out_tokens),
        "total_tokens_per_s": per_s(out_tokens + in_tokens),
        **{name: summarize(vals) for name, vals in samples.items()},
        "itl_zero_gaps": sum(1 for v in samples["itl_ms"] if v == 0.0),
        "tokens_per_message": (out_tokens / sum(len(r.token_times()) for r in ok))
        if ok and out_tokens
        else None,
    }
