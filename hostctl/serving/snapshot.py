"""ServerSnapshot: the figures a Server exports to Prometheus, read at one moment by
Server.snapshot() (any thread), so the exporter (hostctl/serving/prometheus.py) reads the
server through this and nothing else.  docs/metrics.md names the series each figure becomes."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ringleader.ipc.counters import COUNTERS
from ringleader.ipc.histogram import HistogramSnapshot

log = logging.getLogger("ringleader.server")


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
    device_counters: dict[str, int]  # every counter of ipc/counters.py, by name (as mirrored)
    kv_cache_usage: float  # share of the KV pages requests hold, 0..1 (mirrored with the counters)
    kv_pages: int  # the pool
    engine_dead: str | None  # why the engine was declared dead; None while it lives


def read_snapshot(server: Any) -> ServerSnapshot:
    """A hostctl.serving.server.Server's figures now (Server.snapshot); safe from any thread
    (the server is not imported here: it imports this)."""
    counters, latencies = server.metrics.snapshot_with_histograms()
    ctl = server.backend.rings.control[0]
    device = server.backend.rings.counters()
    in_sq_ring = (int(ctl["sq_tail"]) - int(ctl["sq_head"])) & 0xFFFFFFFF
    try:
        steps = server.backend.step_histograms()
    except Exception:  # a scrape never fails because of the device; the log says why
        log.exception("reading the step histograms failed")
        steps = {}
    return ServerSnapshot(
        model_name=str(server.backend.model.name),
        description=dict(server.backend.description),
        batch_slots=server.backend.rings.config.n_slots,
        running=int(device["active_slots"]),
        waiting=server.admission.queued + in_sq_ring + int(device["pending"]),
        in_flight=len(server.table),
        accepted=counters["accepted"],
        prompt_tokens=counters["prompt_tokens"],
        generation_tokens=counters["output_tokens"],
        finished=counters["finished"],
        errors=counters["errors_by_code"],
        rejected=counters["rejected_by_code"],
        bad_frames=counters["bad_frames"],
        latencies=latencies,
        thread_cpu_s=server.thread_cpu_seconds(),
        step_histograms=steps,
        device_counters={c.name: int(device[c.name]) for c in COUNTERS},
        kv_cache_usage=float(device["kv_cache_usage_perc"]),
        kv_pages=int(device["kv_pages_total"]),
        engine_dead=server.router.dead_reason,
    )
