"""summary.md: a benchmark document as markdown (the settings, every table, how to read them,
the notes and the plots)."""

from __future__ import annotations

from pathlib import Path

from ringleader.bench.report import load_label
from ringleader.bench.report_comparisons import RATIO_BASE
from ringleader.bench.report_tables import (
    CLIENT_HEAD,
    OVERHEAD_HEAD,
    PREFIX_HEAD,
    RATIO_HEAD,
    cell,
    client_cells,
    overhead_cells,
    prefix_cells,
    ratio_cells,
    table_rows,
)


def _flags_text(flags: dict | None) -> str:
    if flags is None:
        return "flags unrecorded"
    return " ".join(k for k, on in flags.items() if on) or "none of " + "/".join(flags)


def _loadavg(v) -> str:
    return "?" if not v else "/".join(f"{x:.2f}" for x in v)


def _requests_text(requests) -> str:
    if isinstance(requests, list):
        return "/".join(str(n) for n in requests) + " requests (one count per load point)"
    return f"{requests} requests"


def _prefix_text(s: dict) -> str:
    """The workload line's shared prefixes, if any."""
    n = s.get("shared_prefix_len") or 0
    if n <= 0:
        return ""
    groups = s.get("prefix_groups") or 1
    return (
        f"; a shared prefix of {n} tokens before each prompt, {groups} group(s), request i in group "
        "i % G, fresh prefixes for every run"
    )


def _lengths_text(s: dict) -> str:
    """The workload line's prompt and output lengths (the copy workload's passages set both)."""
    if s.get("workload") == "copy":
        cap = s.get("copy_output_cap")
        return (
            f"copy workload ({s.get('copy_prompt') or 'chat'} prompts: repeat, quote or spell-correct a "
            "shipped passage; max_tokens = the passage's tokens"
            + (f", at most {cap}" if cap is not None else "")
            + ")"
        )
    return f"input {s.get('input_len')}, output {s.get('output_len')} tokens ({s.get('length_dist')})"


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
        f"- host: {env.get('cpu_model')} ({env.get('cpu_count')} CPUs; {_flags_text(env.get('cpu_flags'))})"
        + (f", GPU {env['gpu']}" if env.get("gpu") else "")
        + f"; python {env.get('python')}, torch {env.get('torch')}; load average at start "
        f"{_loadavg(s.get('host_loadavg_at_start'))}, at end {_loadavg(env.get('loadavg_at_end'))}",
        f"- workload: {_requests_text(s.get('requests'))} per run, {_lengths_text(s)}, ignore_eos={s.get('ignore_eos')}, "
        f"seed {s.get('seed')}, warm-up {s.get('warmup')} requests" + _prefix_text(s),
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
            *_md_table(RATIO_HEAD, [ratio_cells(d) for d in ratios]),
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
            *_md_table(OVERHEAD_HEAD, [overhead_cells(d) for d in overhead]),
        ]
        out.append("")
    clients = doc.get("client_costs") or []
    if clients:
        out += [
            "## clients",
            "",
            "One server (with its HTTP gateway), each load point run through every client a user "
            "links, back to back: `c` (clients/c, its ringleader-c-bench), `python-sync` (the "
            "bundled `Client`, a thread per request in flight), `python-async` (`AsyncClient`, a "
            "task per request), `pyzmq-raw` (bench/loadgen.py: pyzmq and msgpack, no client "
            "library) and `http` (the OpenAI gateway, streaming `/v1/completions`). A chunk is "
            "stamped when the client hands it to its user. `-model`: less the server's model step "
            "p50 (the null model's is its own few microseconds). CPU per 1k output tokens: the "
            "client's own (its process; on a CPU host it shares the cores with the server) and the "
            "server's, whole and per thread (the gateway runs in the server's process: other). "
            "Scheduler phases: the server's p50 over its last 4096 steps at the end of the run.",
            "",
            *_md_table(CLIENT_HEAD, [client_cells(d) for d in clients]),
        ]
        out.append("")
    prefix = doc.get("prefix_caching") or []
    if prefix:
        out += [
            "## prefix caching on / off",
            "",
            "Each variant run twice on the same shared-prefix workload, one server each, one after the "
            "other: `serve --prefix-caching` (on) and `serve --no-prefix-caching` (off). TTFT off / on "
            "and throughput on / off above 1 favour caching. Hit rate: the server's `prefix_cache_hits` "
            "/ `prefix_cache_queries` (prompt tokens found / looked up) over the run, - when its stats "
            "lack them. Expected: prefix tokens / prompt tokens once each group's prefix was seen, and "
            "(cold) with each group's first request a full miss; a cache that matches whole KV pages "
            "finds the prefix rounded down to a page, and requests of a group sent before its first "
            "was prefilled may miss too.",
            "",
            *_md_table(PREFIX_HEAD, [prefix_cells(d) for d in prefix]),
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
                f"| {d['scheduler']} | {load} | {d['cpu_interference']} | {cell(a, '{:.0f}')} -> {cell(b, '{:.0f}')} "
                f"| x{cell(d['throughput_ratio'], '{:.2f}')} | x{cell(d['ttft_ms_p99_ratio'], '{:.2f}')} "
                f"| x{cell(d['tpot_ms_p50_ratio'], '{:.2f}')} | x{cell(d['tpot_ms_p99_ratio'], '{:.2f}')} "
                f"| x{cell(d['cpu_s_per_1k_tokens_ratio'], '{:.2f}')} |"
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
    if any(r.get("spec_acceptance_rate") is not None for r in doc["runs"]):
        out.append(
            "- spec accept: the server's speculative-decoding counters over the run, "
            "`spec_accepted_tokens / spec_draft_tokens` (the share of draft tokens the model agreed "
            "with); accepted/draft: `spec_accepted_tokens / spec_drafts`, tokens gained per "
            "verification step that had a draft. - where the server lacks the counters or drafted nothing."
        )
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
