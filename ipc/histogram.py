"""A fixed-bucket histogram cheap enough for the per-token and per-step paths, and its snapshot.

It lives in ipc because both sides fill one: the host's completion thread (hostctl/serving/metrics.py:
latencies and token counts) and a backend's engine thread (step times, device/backends/common.py),
and a backend hands its snapshots to the host through ringleader.ipc.backend.Backend.step_histograms.  It is
not thread-safe by itself: its owner writes it under a lock of its own and takes `snapshot()`
under the same lock, so a snapshot's buckets, sum and count always agree.

`observe` is a bisect and three adds; `observe_array` does a numpy array at once (the device
timeline's rows, fed at scrape time).  Buckets follow Prometheus: bucket i counts the values
<= bounds[i] and > bounds[i - 1]; the last bucket (+Inf) counts the values above every bound.

TTFT_BUCKETS are the bounds of every time-to-first-token histogram: the server's
(hostctl/serving/metrics.py), the HTTP gateway's and each Ray Serve replica's.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Seconds: vLLM's TTFT bounds, so vLLM's dashboards read the server's series, and the gateway's
# and the Ray replicas' TTFT compare with the server's bucket for bucket (what HTTP adds).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]  # upper bounds, increasing; +Inf is implied
    counts: tuple[int, ...]  # per bucket (not cumulative), len(bounds) + 1: the last is +Inf's
    sum: float
    count: int

    def cumulative(self) -> list[tuple[float, int]]:
        """(le, values <= le) per bound, then (inf, count): Prometheus's `_bucket` series."""
        out: list[tuple[float, int]] = []
        total = 0
        for le, n in zip((*self.bounds, math.inf), self.counts):
            total += n
            out.append((le, total))
        return out


class Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]):
        b = tuple(float(x) for x in bounds)
        if not b or any(not math.isfinite(x) for x in b) or any(x >= y for x, y in itertools.pairwise(b)):
            raise ValueError(f"bounds must be finite and strictly increasing, got {bounds!r}")
        self.bounds = b
        self.counts = [0] * (len(b) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        """Counts `value` n times (n equal observations for the price of one)."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def observe_many(
        self,
        values: Sequence[float] | np.ndarray,
        counts: Sequence[int] | np.ndarray | None = None,
        scale: float = 1.0,
    ) -> None:
        """Counts each value * scale its count of times (counts None: once each): a step's worth
        of observations in a few array operations (a loop of observe() costs a microsecond each)."""
        if counts is not None and len(values) < 8:
            for v, n in zip(values, counts):
                self.observe(v * scale, n)
            return
        if len(values) == 0:
            return
        v = np.asarray(values, dtype=np.float64) * scale
        idx = np.searchsorted(self.bounds, v, side="left")
        if counts is None:
            per_bucket = np.bincount(idx, minlength=len(self.counts))
            total, weighted_sum = len(v), float(np.sum(v))
        else:
            n = np.asarray(counts, dtype=np.int64)
            per_bucket = np.bincount(idx, weights=n, minlength=len(self.counts))
            total, weighted_sum = int(n.sum()), float(np.dot(v, n))
        for i, c in enumerate(per_bucket.tolist()):
            if c:
                self.counts[i] += int(c)
        self.sum += weighted_sum
        self.count += total

    def observe_array(self, values: np.ndarray) -> None:
        self.observe_many(values)

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.sum, self.count)


def buckets_125(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10
