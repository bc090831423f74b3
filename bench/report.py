"""Results of a benchmark invocation: run entries, the environment, the document and its JSON.
The comparisons between runs are in bench/report_comparisons.py, the console tables in
bench/report_tables.py, summary.md in bench/report_markdown.py.

JSON layout (schema "ringleader-bench/1"):
    {"schema", "created", "command", "settings": {...every option...}, "environment": {git
     commit, python/torch versions, CPU, GPU}, "model", "device", "notes": [...],
     "runs": [run, ...], "degradation": [...], "ratios_vs_hf": [...], "gateway_overhead": [...],
     "prefix_caching": [...]}
Each run holds at least: scheduler, device, model, concurrency (null in the open loop),
request_rate (null in the closed loop), completed, failed, output_tokens_per_s, ttft_ms,
tpot_ms, itl_ms, e2e_ms (each {mean, p50, p90, p99}) and cpu_s_per_1k_tokens; see
make_run_entry for the rest (among them variant, prefix_caching, the server's
prefix_cache_queries / _hits / _hit_rate over the run, expected_prefix_hit_rate[_cold], and its
speculative-decoding counters over the run: spec_drafts, spec_draft_tokens, spec_accepted_tokens,
spec_acceptance_rate = accepted / draft tokens, spec_accepted_per_draft = accepted / drafts, each
null where the server's stats lack them).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
from pathlib import Path

from ringleader.bench.loadgen import Load, RunResult
from ringleader.bench.metrics import latency_samples, run_metrics
from ringleader.bench.report_comparisons import (
    client_costs,
    degradation,
    gateway_overhead,
    prefix_caching_comparison,
    ratios_vs_hf,
)
from ringleader.bench.servers import cpu_deltas, device_deltas, prefix_cache_deltas, spec_decode_deltas

SCHEMA = "ringleader-bench/1"
LOADGEN_WARN_FRACTION = 0.8  # of one core over the run's wall time


# ---------------------------------------------------------------- run entries


def make_run_entry(
    *,
    scheduler: str,
    device: str,
    model: str,
    load: Load,
    result: RunResult,
    burstiness: float | None,
    busy: dict | None = None,
    backend: dict | None = None,
    variant: str | None = None,
    prefix_caching: bool | None = None,
    expected_prefix_hit_rate: dict | None = None,
) -> dict:
    """One run's entry. `variant`: the --compare variant it measured (None for --connect and
    --http); `prefix_caching`: on/off for an arm of the prefix-caching comparison, else None;
    `expected_prefix_hit_rate`: {steady, cold} of its shared-prefix workload (None without)."""
    m = run_metrics(result.records)
    cpu = cpu_deltas(result.stats_before, result.stats_after)
    dev = device_deltas(result.stats_before, result.stats_after)
    prefix = prefix_cache_deltas(result.stats_before, result.stats_after)
    spec = spec_decode_deltas(result.stats_before, result.stats_after)
    expected = expected_prefix_hit_rate or {}
    frac = (
        (result.loadgen_cpu_s / result.wall_s)
        if result.loadgen_cpu_s is not None and result.wall_s > 0
        else None
    )
    entry = {
        "scheduler": scheduler,
        "variant": variant,
        "prefix_caching": prefix_caching,
        "device": device,
        "model": model,
        "backend": backend or result.stats_after.get("backend"),
        "concurrency": load.concurrency,
        "request_rate": _finite_or_str(load.request_rate),
        "burstiness": burstiness if load.concurrency is None else None,
        "cpu_interference": (busy or {}).get("busy_processes", 0),
        "requests": len(result.records),
        **m,
        "server_cpu_s": cpu["process_cpu_s"],
        # resident memory after the run (hf: the whole benchmark process, its model included)
        "server_rss_mib": _mib(result.stats_after.get("process_rss_bytes")),
        "cpu_s_per_1k_tokens": cpu["cpu_s_per_1k_tokens"],
        "server_output_tokens": cpu["server_output_tokens"],
        "thread_cpu_s": cpu["thread_cpu_s"],
        "thread_cpu_s_per_1k_tokens": cpu["thread_cpu_s_per_1k_tokens"],
        "bubble_us_p50": dev.get("bubble_us_p50"),
        "bubble_us_p99": dev.get("bubble_us_p99"),
        "step_us_p50": dev.get("step_us_p50"),
        # the run's steps (the counter's delta) and how many of them the device timeline's
        # figures above summarise: fewer when the trace ring no longer held the first ones
        "device_steps": dev.get("steps"),
        "timeline_steps": dev.get("timeline_steps"),
        "device_stats": dev,
        "loadgen_cpu_s": result.loadgen_cpu_s,
        "loadgen_cpu_frac": frac,
        "wall_s": result.wall_s,
        "send_lag_ms": result.send_lag_ms or None,
        "warmup_failed": result.warmup_failed,
        "busy_cpu_s": (busy or {}).get("busy_cpu_s"),
        **prefix,
        "expected_prefix_hit_rate": expected.get("steady"),
        "expected_prefix_hit_rate_cold": expected.get("cold"),
        **spec,
        "_samples": latency_samples(result.records),  # for the CDF plots; not written to JSON
    }
    return entry


def load_label(run: dict) -> str:
    if run.get("concurrency") is not None:
        return f"c={run['concurrency']}"
    return (
        f"rate={run['request_rate']}/s"
        if isinstance(run.get("request_rate"), str)
        else f"rate={run['request_rate']:g}/s"
    )


def run_label(run: dict) -> str:
    busy = f" +{run['cpu_interference']}busy" if run.get("cpu_interference") else ""
    return f"{run['scheduler']} {load_label(run)}{busy}"


def loadgen_warnings(runs: list[dict]) -> list[str]:
    out = []
    for r in runs:
        if r.get("loadgen_cpu_frac") is not None and r["loadgen_cpu_frac"] >= LOADGEN_WARN_FRACTION:
            out.append(
                f"warning: {run_label(r)}: the load generator used {100 * r['loadgen_cpu_frac']:.0f}% "
                f"of a core over the run; it may have limited the results"
            )
        lag = (r.get("send_lag_ms") or {}).get("p99")
        if lag is not None and lag > 10.0:
            out.append(f"warning: {run_label(r)}: open-loop sends lagged their schedule (p99 {lag:.1f} ms)")
    return out


def timeline_warnings(runs: list[dict]) -> list[str]:
    """Runs whose device-timeline figures (bubble, step) cover only part of their steps."""
    out = []
    for r in runs:
        covered, steps = r.get("timeline_steps"), r.get("device_steps")
        if covered is not None and steps and covered < steps:
            out.append(
                f"warning: {run_label(r)}: the device timeline held {covered} of the run's {steps} "
                f"steps (the trace ring's length); its bubble and step figures are the last {covered}'s"
            )
    return out


# ---------------------------------------------------------------- environment


def git_commit(repo: str | os.PathLike | None = None) -> dict:
    repo = repo or Path(__file__).resolve().parent.parent

    def git(*a):
        return subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}


def environment() -> dict:
    env = {
        "git": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **dict(zip(("cpu_model", "cpu_flags"), cpu_identity())),
        "loadavg_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["cuda"] = torch.version.cuda
    except Exception:
        pass
    return env


# the instruction sets a CPU figure is compared by (AVX2-only machines and AVX-512 ones differ)
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")


def cpu_identity() -> tuple[str | None, dict[str, bool]]:
    """The CPU's model name and which of CPU_FLAGS it has (device/backends/cpu_features.py)."""
    from ringleader.device.backends.cpu_features import cpu_features

    cpu = cpu_features()
    return (None if cpu.model == "unknown CPU" else cpu.model), {k: k in cpu.flags for k in CPU_FLAGS}


# ---------------------------------------------------------------- the document


def build_document(
    *, command: list[str], settings: dict, model: str, device: str, runs: list[dict], notes: list[str]
) -> dict:
    env = environment()
    for r in runs:
        r.setdefault("git_commit", (env.get("git") or {}).get("commit"))
    return {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "settings": settings,
        "environment": env,
        "model": model,
        "device": device,
        "notes": notes,
        "runs": runs,
        "degradation": degradation(runs),
        "ratios_vs_hf": ratios_vs_hf(runs),
        "gateway_overhead": gateway_overhead(runs),
        "prefix_caching": prefix_caching_comparison(runs),
        "client_costs": client_costs(runs),
    }


def write_json(doc: dict, path: str | os.PathLike) -> None:
    """A benchmark document, without the runs' private (underscored) fields."""
    save_json(
        dict(doc, runs=[{k: v for k, v in r.items() if not k.startswith("_")} for r in doc["runs"]]), path
    )


def save_json(obj: dict, path: str | os.PathLike) -> None:
    """Any result as indented JSON (non-finite floats as strings), making the folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_json_safe(obj), f, indent=2, sort_keys=False)
        f.write("\n")


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _finite_or_str(x):
    return str(x) if isinstance(x, float) and math.isinf(x) else x


def _mib(nbytes) -> float | None:
    return round(nbytes / (1 << 20), 1) if isinstance(nbytes, (int, float)) else None
