"""ServerSnapshot: the figures a Server exports to Prometheus, read at one moment by
Server.snapshot() (any thread), so the exporter (hostctl/serving/prometheus.py) reads the
server through this and nothing else.  docs/metrics.md names the series each figure becomes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringleader.ipc.histogram import HistogramSnapshot


@dataclass(frozen=True)
class ServerSnapshot:
    model_name: str  # the --model spec: every series' model_name label
    description: dict[str, Any]  # the backend's: device, scheduler, launch, dtype, ...
    batch_slots: int
    # requests, now
    running: int  # holding a batch slot (the control block's active_slots, mirrored by the scheduler)
    waiting: int  # accepted, not in a slot: host queue + SQ entries not drained + the device's pending queue
    in_flight: int  # accepted, their `done` not sent
    # requests, since start: one ServerMetrics snapshot, so counters and latencies agree
    accepted: int
    prompt_tokens: int  # of requests whose prefill finished, counted at their first token
    generation_tokens: int  # output tokens routed to clients
    finished: dict[str, int]  # accepted requests ended, by finish reason
    errors: dict[str, int]  # accepted requests ended with an error, by code
    rejected: dict[str, int]  # generates never accepted, by code
    bad_frames: int  # frames that were not a request at all
    # ServerMetrics' histograms: ttft_s, inter_token_s, time_per_output_token_s, e2e_s, queue_s,
    # request_prompt_tokens, request_generation_tokens
    latencies: dict[str, HistogramSnapshot]
    thread_cpu_s: dict[str, float]  # CPU seconds of each host thread running now, by name
    # the scheduler: the backend's step histograms (sched_critical_s, sched_overlapped_s, and where
    # measured bubble_s, tokens_per_step; empty if they could not be read) and the control block's counters
    step_histograms: dict[str, HistogramSnapshot]
    steps: int
    step_tokens: int
    cq_stalls: int
    kv_cache_usage: float  # share of the KV pages requests hold, 0..1 (mirrored with the counters)
    kv_pages: int  # the pool
    preemptions: int  # requests that gave their pages back to recompute later
    prefix_cache_queries: int  # prompt tokens of admitted requests
    prefix_cache_hits: int  # of those, the ones whose KV the prefix cache held (prefill skipped)
    engine_dead: str | None  # why the engine was declared dead; None while it lives
