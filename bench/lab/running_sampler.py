"""Samples a running server's batch while something else loads it: requests running (holding a
slot), waiting on the device, and the KV pages in use, every --interval seconds, until --duration
passes or the server stops answering; writes the samples and their summary as JSON.

    python -m ringleader.bench.lab.running_sampler tcp://127.0.0.1:5555 --duration 120 --json out.json

The figures are the scheduler's mirrored counters (refreshed at least every 16 steps or 1 ms),
read through `stats`: what `ringleader stats` shows, over time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ringleader.ipc.client import Client


def sample(address: str, duration_s: float, interval_s: float) -> list[dict]:
    out: list[dict] = []
    t0 = time.monotonic()
    with Client(address, timeout=5) as client:
        while time.monotonic() - t0 < duration_s:
            try:
                device = client.stats()["device"]
            except Exception:  # the server went away: the run is over
                break
            out.append(
                {
                    "t_s": round(time.monotonic() - t0, 3),
                    "running": int(device["active_slots"]),
                    "pending": int(device["pending"]),
                    # absent on servers from before the paged KV cache
                    "kv_cache_usage_perc": device.get("kv_cache_usage_perc"),
                    "preemptions": device.get("preemptions"),
                }
            )
            time.sleep(interval_s)
    return out


def summary(samples: list[dict]) -> dict:
    """Peak and mean of the samples taken while anything ran."""
    busy = [s for s in samples if s["running"] > 0]
    if not busy:
        return {"samples": len(samples), "busy_samples": 0}
    usage = [s["kv_cache_usage_perc"] for s in busy if s["kv_cache_usage_perc"] is not None]
    return {
        "samples": len(samples),
        "busy_samples": len(busy),
        "running_peak": max(s["running"] for s in busy),
        "running_mean": round(sum(s["running"] for s in busy) / len(busy), 2),
        "kv_cache_usage_mean": round(sum(usage) / len(usage), 3) if usage else None,
        "preemptions": busy[-1]["preemptions"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address")
    p.add_argument("--duration", type=float, default=60.0, help="seconds to sample (default 60)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between samples (default 0.1)")
    p.add_argument("--json", type=Path, help="write {summary, samples} here")
    args = p.parse_args(argv)
    samples = sample(args.address, args.duration, args.interval)
    doc = {"summary": summary(samples), "samples": samples}
    print(json.dumps(doc["summary"]))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
