"""Comparisons between the runs of one benchmark document: each run under CPU interference
against the same run without it, each ringleader run against transformers' (hf), the HTTP
gateway against ZeroMQ on the same server, prefix caching on against off, and each client's cost."""

from __future__ import annotations


def degradation(runs: list[dict]) -> list[dict]:
    """Each run under CPU interference against the same scheduler and load without it."""
    base = {
        (r["scheduler"], r["concurrency"], r["request_rate"]): r
        for r in runs
        if not r.get("cpu_interference")
    }
    out = []
    for r in runs:
        if not r.get("cpu_interference"):
            continue
        b = base.get((r["scheduler"], r["concurrency"], r["request_rate"]))
        if b is None:
            continue

        def ratio(a, c):
            return (a / c) if a is not None and c not in (None, 0) else None

        tput = ratio(r["output_tokens_per_s"], b["output_tokens_per_s"])
        out.append(
            {
                "scheduler": r["scheduler"],
                "concurrency": r["concurrency"],
                "request_rate": r["request_rate"],
                "cpu_interference": r["cpu_interference"],
                "output_tokens_per_s": [b["output_tokens_per_s"], r["output_tokens_per_s"]],
                "throughput_ratio": tput,
                "throughput_drop_pct": (100.0 * (1.0 - tput)) if tput is not None else None,
                **{
                    f"{k}_{p}_ratio": ratio(r[k][p], b[k][p])
                    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
                    for p in ("p50", "p99")
                },
                "cpu_s_per_1k_tokens_ratio": ratio(r["cpu_s_per_1k_tokens"], b["cpu_s_per_1k_tokens"]),
            }
        )
    return out


RATIO_BASE = "hf"  # the baseline of a compare run's ratios


def _ratio(a, b):
    return (a / b) if a is not None and b not in (None, 0) else None


def _point(r: dict) -> tuple:
    """A run's load point: concurrency, request rate and busy level."""
    return r["concurrency"], r["request_rate"], r.get("cpu_interference") or 0


def paired_with(runs: list[dict], baseline: str, scheduler: str | None = None) -> list[tuple[dict, dict]]:
    """(run, baseline run) for each run of `scheduler` (None: of any other scheduler) that has
    a `baseline` run at its load point, in the order of `runs`."""
    base = {_point(r): r for r in runs if r["scheduler"] == baseline}
    return [
        (r, base[_point(r)])
        for r in runs
        if r["scheduler"] != baseline and scheduler in (None, r["scheduler"]) and _point(r) in base
    ]


def _point_fields(r: dict, baseline: str) -> dict:
    """The fields that name a comparison's run, baseline and load point."""
    return {
        "scheduler": r["scheduler"],
        "baseline": baseline,
        "concurrency": r["concurrency"],
        "request_rate": r["request_rate"],
        "cpu_interference": r.get("cpu_interference") or 0,
    }


def ratios_vs_hf(runs: list[dict]) -> list[dict]:
    """Each ringleader run against the `hf` run at the same load (and busy level): the ratio
    ringleader / hf of output tok/s (above 1: ringleader is faster) and of TTFT and TPOT p50
    (below 1: ringleader is faster). Empty when the runs have no hf variant."""
    out = []
    for r, b in paired_with(runs, RATIO_BASE):
        out.append(
            {
                **_point_fields(r, RATIO_BASE),
                "output_tokens_per_s": [r["output_tokens_per_s"], b["output_tokens_per_s"]],
                "output_tokens_per_s_ratio": _ratio(r["output_tokens_per_s"], b["output_tokens_per_s"]),
                "ttft_ms_p50_ratio": _ratio(r["ttft_ms"]["p50"], b["ttft_ms"]["p50"]),
                "tpot_ms_p50_ratio": _ratio(r["tpot_ms"]["p50"], b["tpot_ms"]["p50"]),
                "cpu_s_per_1k_tokens_ratio": _ratio(r["cpu_s_per_1k_tokens"], b["cpu_s_per_1k_tokens"]),
            }
        )
    return out


OVERHEAD_BASE, OVERHEAD_OF = "native", "gateway"  # the --compare gateway variant's two labels


def _diff(a, b):
    return (a - b) if a is not None and b is not None else None


def _per_1k(cpu_s, tokens):
    return cpu_s / (tokens / 1000.0) if cpu_s is not None and tokens else None


def gateway_overhead(runs: list[dict]) -> list[dict]:
    """Each `gateway` run (HTTP through the gateway) against the `native` run (ZeroMQ) of the same
    server at the same load and busy level: output tok/s gateway / native, and what the gateway
    adds, gateway - native, to TTFT p50/p99 (ms) and to TPOT p50 and ITL p50/p99 (ms per token);
    the load generator's CPU per 1k tokens and the server's (which includes the in-process
    gateway) of each, as [gateway, native]. Empty without a gateway variant."""
    out = []
    for r, b in paired_with(runs, OVERHEAD_BASE, OVERHEAD_OF):
        out.append(
            {
                **_point_fields(r, OVERHEAD_BASE),
                "output_tokens_per_s": [r["output_tokens_per_s"], b["output_tokens_per_s"]],
                "output_tokens_per_s_ratio": _ratio(r["output_tokens_per_s"], b["output_tokens_per_s"]),
                **{
                    f"{k}_{p}_diff": _diff(r[k][p], b[k][p])
                    for k, p in (
                        ("ttft_ms", "p50"),
                        ("ttft_ms", "p99"),
                        ("tpot_ms", "p50"),
                        ("itl_ms", "p50"),
                        ("itl_ms", "p99"),
                        ("e2e_ms", "p50"),
                    )
                },
                "loadgen_cpu_s_per_1k_tokens": [
                    _per_1k(r.get("loadgen_cpu_s"), r.get("output_tokens")),
                    _per_1k(b.get("loadgen_cpu_s"), b.get("output_tokens")),
                ],
                "server_cpu_s_per_1k_tokens": [r.get("cpu_s_per_1k_tokens"), b.get("cpu_s_per_1k_tokens")],
            }
        )
    return out


def prefix_caching_comparison(runs: list[dict]) -> list[dict]:
    """Each variant's prefix-on run against its prefix-off run at the same load and busy level
    (--shared-prefix-len; the runs' `prefix_caching` says which arm): [on, off] of TTFT p50 and
    p90 (ms), output tok/s, requests/s and the server's prefix-cache hit rate; the ratios TTFT
    off / on (above 1: caching cut TTFT) and throughput on / off (above 1: caching raised it);
    and the workload's expected hit rates. Empty without both arms."""
    off = {(r.get("variant"), *_point(r)): r for r in runs if r.get("prefix_caching") is False}
    out = []
    for on in runs:
        if on.get("prefix_caching") is not True:
            continue
        b = off.get((on.get("variant"), *_point(on)))
        if b is None:
            continue
        out.append(
            {
                "variant": on.get("variant"),
                "on": on["scheduler"],
                "off": b["scheduler"],
                "concurrency": on["concurrency"],
                "request_rate": on["request_rate"],
                "cpu_interference": on.get("cpu_interference") or 0,
                "ttft_ms_p50": [on["ttft_ms"]["p50"], b["ttft_ms"]["p50"]],
                "ttft_ms_p90": [on["ttft_ms"]["p90"], b["ttft_ms"]["p90"]],
                "output_tokens_per_s": [on["output_tokens_per_s"], b["output_tokens_per_s"]],
                "request_throughput": [on["request_throughput"], b["request_throughput"]],
                "prefix_cache_hit_rate": [on.get("prefix_cache_hit_rate"), b.get("prefix_cache_hit_rate")],
                "expected_prefix_hit_rate": on.get("expected_prefix_hit_rate"),
                "expected_prefix_hit_rate_cold": on.get("expected_prefix_hit_rate_cold"),
                "ttft_ms_p50_ratio_off_on": _ratio(b["ttft_ms"]["p50"], on["ttft_ms"]["p50"]),
                "ttft_ms_p90_ratio_off_on": _ratio(b["ttft_ms"]["p90"], on["ttft_ms"]["p90"]),
                "output_tokens_per_s_ratio_on_off": _ratio(
                    on["output_tokens_per_s"], b["output_tokens_per_s"]
                ),
                "request_throughput_ratio_on_off": _ratio(on["request_throughput"], b["request_throughput"]),
            }
        )
    return out


# the server's threads, in the order the table shows them (others are summed into "other")
SERVER_THREADS = ("engine", "completions", "frontend")


def _less(ms, us):
    """A latency in ms less a step time in us, in us."""
    return ms * 1e3 - us if ms is not None and us is not None else None


def client_costs(runs: list[dict]) -> list[dict]:
    """What each client costs, from the runs of `--compare clients` (one server, each load point
    run through every client back to back): one row per run that has a `client`, in run order:
    its latencies, those less the model's step (the null model's is its own few microseconds),
    its own CPU and the server's (whole, per thread) per 1k tokens, the scheduler's phases."""
    out = []
    for r in runs:
        if not r.get("client"):
            continue
        dev = r.get("device_stats") or {}
        model_us = dev.get("model_step_us_p50")
        threads = dict(r.get("thread_cpu_s_per_1k_tokens") or {})
        named = {k: threads.pop(k, None) for k in SERVER_THREADS}
        out.append(
            {
                "client": r["client"],
                "concurrency": r.get("concurrency"),
                "request_rate": r.get("request_rate"),
                "cpu_interference": r.get("cpu_interference"),
                "completed": r.get("completed"),
                "failed": r.get("failed"),
                "output_tokens_per_s": r.get("output_tokens_per_s"),
                "ttft_ms": {p: r["ttft_ms"].get(p) for p in ("p50", "p99")},
                "tpot_ms": {p: r["tpot_ms"].get(p) for p in ("p50", "p99")},
                "itl_ms": {p: r["itl_ms"].get(p) for p in ("p50", "p99")},
                "tokens_per_message": r.get("tokens_per_message"),
                "model_step_us_p50": model_us,
                "ttft_less_model_us_p50": _less(r["ttft_ms"].get("p50"), model_us),
                "tpot_less_model_us_p50": _less(r["tpot_ms"].get("p50"), model_us),
                "client_cpu_s_per_1k_tokens": _per_1k(r.get("loadgen_cpu_s"), r.get("output_tokens")),
                "server_cpu_s_per_1k_tokens": r.get("cpu_s_per_1k_tokens"),
                "server_thread_cpu_s_per_1k_tokens": {
                    **named,
                    "other": sum(v for v in threads.values() if v is not None) if threads else None,
                },
                "sched_critical_us_p50": dev.get("sched_critical_us_p50"),
                "sched_overlapped_us_p50": dev.get("sched_overlapped_us_p50"),
                "tokens_per_step": dev.get("tokens_per_step"),
            }
        )
    return out
