"""Results of a benchmark invocation: run entries, degradation, the console table, JSON, markdown.

JSON layout (schema "ringleader-bench/1"):
    {"schema", "created", "command", "settings": {...every option...}, "environment": {git
     commit, python/torch versions, CPU, GPU}, "model", "device", "notes": [...],
     "runs": [run, ...], "degradation": [...], "ratios_vs_hf": [...], "gateway_overhead": [...]}
Each run holds at least: scheduler, device, model, concurrency (null in the open loop),
request_rate (null in the closed loop), completed, failed, output_tokens_per_s, ttft_ms,
tpot_ms, itl_ms, e2e_ms (each {mean, p50, p90, p99}) and cpu_s_per_1k_tokens; see
make_run_entry for the rest.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
from pathlib import Path

from bench.loadgen import Load, RunResult
from bench.metrics import latency_samples, run_metrics
from bench.servers import cpu_deltas, device_deltas

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
) -> dict:
    m = run_metrics(result.records)
    cpu = cpu_deltas(result.stats_before, result.stats_after)
    dev = device_deltas(result.stats_before, result.stats_after)
    frac = (
        (result.loadgen_cpu_s / result.wall_s)
        if result.loadgen_cpu_s is not None and result.wall_s > 0
        else None
    )
    entry = {
        "scheduler": scheduler,
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
        "cpu_s_per_1k_tokens": cpu["cpu_s_per_1k_tokens"],
        "server_output_tokens": cpu["server_output_tokens"],
        "thread_cpu_s": cpu["thread_cpu_s"],
        "thread_cpu_s_per_1k_tokens": cpu["thread_cpu_s_per_1k_tokens"],
        "bubble_us_p50": dev.get("bubble_us_p50"),
        "bubble_us_p99": dev.get("bubble_us_p99"),
        "step_us_p50": dev.get("step_us_p50"),
        "device_stats": dev,
        "loadgen_cpu_s": result.loadgen_cpu_s,
        "loadgen_cpu_frac": frac,
        "wall_s": result.wall_s,
        "send_lag_ms": result.send_lag_ms or None,
        "warmup_failed": result.warmup_failed,
        "busy_cpu_s": (busy or {}).get("busy_cpu_s"),
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
        "cpu_model": _cpu_model(),
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


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


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


# ---------------------------------------------------------------- tables


def _loadavg(v) -> str:
    return "?" if not v else "/".join(f"{x:.2f}" for x in v)


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def table_rows(runs: list[dict]) -> tuple[list[str], list[list[str]]]:
    has_bubbles = any(r.get("bubble_us_p50") is not None for r in runs)
    head = [
        "scheduler",
        "load",
        "busy",
        "ok/fail",
        "req/s",
        "out tok/s",
        "TTFT p50/p99 ms",
        "queue p50/p99 ms",
        "TPOT p50/p99 ms",
        "ITL p99 ms",
        "E2E p50/p99 ms",
        "CPU s/1k tok",
        "loadgen CPU",
    ]
    if has_bubbles:
        head += ["bubble p50/p99 us", "step p50 us"]
    rows = []
    for r in runs:
        row = [
            r["scheduler"],
            load_label(r),
            str(r.get("cpu_interference") or 0),
            f"{r['completed']}/{r['failed']}",
            _f(r["request_throughput"], "{:.2f}"),
            _f(r["output_tokens_per_s"], "{:.0f}"),
            f"{_f(r['ttft_ms']['p50'])}/{_f(r['ttft_ms']['p99'])}",
            f"{_f((r.get('queue_ms') or {}).get('p50'))}/{_f((r.get('queue_ms') or {}).get('p99'))}",
            f"{_f(r['tpot_ms']['p50'], '{:.2f}')}/{_f(r['tpot_ms']['p99'], '{:.2f}')}",
            _f(r["itl_ms"]["p99"], "{:.2f}"),
            f"{_f(r['e2e_ms']['p50'], '{:.0f}')}/{_f(r['e2e_ms']['p99'], '{:.0f}')}",
            _f(r["cpu_s_per_1k_tokens"], "{:.3f}"),
            "-"
            if r.get("loadgen_cpu_frac") is None
            else f"{r['loadgen_cpu_s']:.2f}s {100 * r['loadgen_cpu_frac']:.0f}%",
        ]
        if has_bubbles:
            row += [f"{_f(r.get('bubble_us_p50'))}/{_f(r.get('bubble_us_p99'))}", _f(r.get("step_us_p50"))]
        rows.append(row)
    return head, rows


def format_table(runs: list[dict]) -> str:
    head, rows = table_rows(runs)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += [
        "  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    return "\n".join(lines)


def format_degradation(rows: list[dict]) -> str:
    if not rows:
        return ""
    lines = ["degradation under CPU interference (with / without):"]
    for d in rows:
        load = load_label(d)
        lines.append(
            f"  {d['scheduler']:<7} {load:<12} +{d['cpu_interference']} busy: "
            f"throughput x{_f(d['throughput_ratio'], '{:.2f}')}, "
            f"TTFT p99 x{_f(d['ttft_ms_p99_ratio'], '{:.2f}')}, "
            f"TPOT p50 x{_f(d['tpot_ms_p50_ratio'], '{:.2f}')}, "
            f"TPOT p99 x{_f(d['tpot_ms_p99_ratio'], '{:.2f}')}, "
            f"CPU/1k x{_f(d['cpu_s_per_1k_tokens_ratio'], '{:.2f}')}"
        )
    return "\n".join(lines)


def _ratio_cells(d: dict) -> list[str]:
    a, b = d["output_tokens_per_s"]
    busy = f" +{d['cpu_interference']}busy" if d.get("cpu_interference") else ""
    return [
        d["scheduler"],
        load_label(d) + busy,
        f"{_f(a, '{:.1f}')} / {_f(b, '{:.1f}')}",
        f"x{_f(d['output_tokens_per_s_ratio'], '{:.2f}')}",
        f"x{_f(d['ttft_ms_p50_ratio'], '{:.2f}')}",
        f"x{_f(d['tpot_ms_p50_ratio'], '{:.2f}')}",
    ]


RATIO_HEAD = ["scheduler", "load", "out tok/s (it / hf)", "tok/s ratio", "TTFT p50 ratio", "TPOT p50 ratio"]


def format_ratios(rows: list[dict]) -> str:
    if not rows:
        return ""
    cells = [_ratio_cells(d) for d in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(RATIO_HEAD)]
    lines = [
        "ringleader / hf (transformers continuous batching) at the same load: tok/s above 1 and "
        "TTFT/TPOT below 1 favour ringleader",
        "  " + "  ".join(h.ljust(w) for h, w in zip(RATIO_HEAD, widths)),
    ]
    lines += [
        "  " + "  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    return "\n".join(lines)


def _signed(x, fmt="{:+.2f}") -> str:
    return "-" if x is None else fmt.format(x)


OVERHEAD_HEAD = [
    "load",
    "out tok/s (gateway / native)",
    "tok/s ratio",
    "TTFT p50 +ms",
    "TTFT p99 +ms",
    "TPOT p50 +ms/tok",
    "ITL p50 +ms/tok",
    "ITL p99 +ms/tok",
    "loadgen CPU s/1k tok (gateway / native)",
    "server CPU s/1k tok (gateway / native)",
]


def _overhead_cells(d: dict) -> list[str]:
    a, b = d["output_tokens_per_s"]
    la, lb = d["loadgen_cpu_s_per_1k_tokens"]
    sa, sb = d["server_cpu_s_per_1k_tokens"]
    busy = f" +{d['cpu_interference']}busy" if d.get("cpu_interference") else ""
    return [
        load_label(d) + busy,
        f"{_f(a, '{:.1f}')} / {_f(b, '{:.1f}')}",
        f"x{_f(d['output_tokens_per_s_ratio'], '{:.3f}')}",
        _signed(d["ttft_ms_p50_diff"]),
        _signed(d["ttft_ms_p99_diff"]),
        _signed(d["tpot_ms_p50_diff"], "{:+.3f}"),
        _signed(d["itl_ms_p50_diff"], "{:+.3f}"),
        _signed(d["itl_ms_p99_diff"], "{:+.3f}"),
        f"{_f(la, '{:.3f}')} / {_f(lb, '{:.3f}')}",
        f"{_f(sa, '{:.3f}')} / {_f(sb, '{:.3f}')}",
    ]


OVERHEAD_TEXT = (
    "the HTTP gateway against ZeroMQ on the same server (gateway - native; +ms/tok = added latency "
    "per token); the two load generators' own CPU differs (see loadgen CPU), and on a CPU host "
    "they share the cores with the server"
)


def format_overhead(rows: list[dict]) -> str:
    if not rows:
        return ""
    cells = [_overhead_cells(d) for d in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(OVERHEAD_HEAD)]
    lines = [
        OVERHEAD_TEXT,
        "  " + "  ".join(h.ljust(w) for h, w in zip(OVERHEAD_HEAD, widths)),
    ]
    lines += [
        "  " + "  ".join(c.rjust(w) if i >= 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    return "\n".join(lines)


def _requests_text(requests) -> str:
    if isinstance(requests, list):
        return "/".join(str(n) for n in requests) + " requests (one count per load point)"
    return f"{requests} requests"


def _md_table(head, rows) -> list[str]:
    """A markdown table's lines: the head, its rule, one line per row of cells."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(row) + " |" for row in rows
    ]


def markdown_summary(doc: dict, plots: list[str]) -> str:
    s, env = doc["settings"], doc["environment"]
    git = env.get("git") or {}
    out = [
        f"# ringleader bench: {doc['model']} on {doc['device']}",
        "",
        f"- created: {doc['created']}",
        f"- command: `{' '.join(['ringleader', 'bench', *doc['command']])}`",
        f"- git commit: `{git.get('commit')}`" + (" (uncommitted changes)" if git.get("dirty") else ""),
        f"- host: {env.get('cpu_model')} ({env.get('cpu_count')} CPUs)"
        + (f", GPU {env['gpu']}" if env.get("gpu") else "")
        + f"; python {env.get('python')}, torch {env.get('torch')}; load average at start "
        f"{_loadavg(s.get('host_loadavg_at_start'))}, at end {_loadavg(env.get('loadavg_at_end'))}",
        f"- workload: {_requests_text(s.get('requests'))} per run, input {s.get('input_len')}, "
        f"output {s.get('output_len')} tokens ({s.get('length_dist')}), ignore_eos={s.get('ignore_eos')}, "
        f"seed {s.get('seed')}, warm-up {s.get('warmup')} requests",
        "",
    ]
    head, rows = table_rows(doc["runs"])
    out += _md_table(head, rows)
    out.append("")
    ratios = doc.get("ratios_vs_hf") or []
    if ratios:
        out += [
            "## ringleader / hf",
            "",
            "Each ringleader variant against transformers' continuous batching (`hf`) at the same "
            "load: output tok/s ratio above 1, and TTFT / TPOT p50 ratios below 1, favour ringleader.",
            "",
            *_md_table(RATIO_HEAD, [_ratio_cells(d) for d in ratios]),
        ]
        out.append("")
    overhead = doc.get("gateway_overhead") or []
    if overhead:
        out += [
            "## gateway / native",
            "",
            "The same server measured over ZeroMQ (`native`, bench/loadgen.py) and through its "
            "OpenAI-compatible HTTP gateway (`gateway`, streaming `/v1/completions`, "
            "bench/http_loadgen.py), back to back at each load: output tok/s ratio gateway / native, "
            "and gateway - native for TTFT (ms) and for TPOT and ITL (ms per token: the latency the "
            "gateway adds to each token). The load generators' own CPU per 1k tokens is shown for both, "
            "since they differ (the HTTP client: aiohttp, SSE framing, one JSON parse per chunk; the "
            "ZeroMQ one: a msgpack frame per message through zmq.asyncio and zmq's I/O thread), and on "
            "a CPU host each takes cores the server could use. The server's CPU of the gateway rows "
            "includes the gateway, which runs in the server's process. Differences smaller than the "
            "run-to-run spread (run the command twice to see it) are noise.",
            "",
            *_md_table(OVERHEAD_HEAD, [_overhead_cells(d) for d in overhead]),
        ]
        out.append("")
    deg = doc.get("degradation") or []
    if deg:
        out += [
            "## Degradation under CPU interference",
            "",
            "| scheduler | load | busy | out tok/s without -> with | throughput | TTFT p99 | TPOT p50 | TPOT p99 | CPU/1k |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for d in deg:
            load = load_label(d)
            a, b = d["output_tokens_per_s"]
            out.append(
                f"| {d['scheduler']} | {load} | {d['cpu_interference']} | {_f(a, '{:.0f}')} -> {_f(b, '{:.0f}')} "
                f"| x{_f(d['throughput_ratio'], '{:.2f}')} | x{_f(d['ttft_ms_p99_ratio'], '{:.2f}')} "
                f"| x{_f(d['tpot_ms_p50_ratio'], '{:.2f}')} | x{_f(d['tpot_ms_p99_ratio'], '{:.2f}')} "
                f"| x{_f(d['cpu_s_per_1k_tokens_ratio'], '{:.2f}')} |"
            )
        out.append("")
    out += [
        "## How to read it",
        "",
        "- TTFT includes queueing for a batch slot and prefill; queue is the server's `done.timing."
        "queue_ms` (host ring wait + device pending-queue wait); `decode_ms` in the JSON is E2E - TTFT.",
        "- ITL: a token message carrying k tokens counts as one gap and k-1 zero gaps.",
        "- CPU s/1k tok: the server process's CPU-seconds (all threads) per 1000 output tokens, from "
        "`process_cpu_s` in its `stats` before and after the run; per-thread figures are in the JSON. "
        "On the CPU backend this includes the model's compute.",
        "- loadgen CPU: CPU-seconds of the benchmark process during the run, and that as a share of one core.",
    ]
    if any(r["scheduler"] == RATIO_BASE for r in doc["runs"]):
        out.append(
            "- hf runs in the benchmark's own process: its CPU s/1k tok is that whole process (model, "
            "batching and load generation), and it has no separate loadgen CPU."
        )
    out += [
        "",
    ]
    if doc.get("notes"):
        out += ["## Notes", ""] + [f"- {n}" for n in doc["notes"]] + [""]
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(out)
