"""A benchmark document's tables as the console shows them: every run, the degradation under CPU
interference, the ratios to hf, the gateway's overhead, prefix caching on / off and each client's cost
(bench/report_markdown.py reuses their rows and cells)."""

from __future__ import annotations

from ringleader.bench.report import load_label
from ringleader.bench.report_comparisons import SERVER_THREADS


def cell(x, fmt="{:.1f}") -> str:
    """A number as a table shows it: `fmt`, or "-" for None."""
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
    has_spec = any(r.get("spec_acceptance_rate") is not None for r in runs)
    if has_bubbles:
        head += ["bubble p50/p99 us", "step p50 us"]
    if has_spec:
        head += ["spec accept", "accepted/draft"]
    rows = []
    for r in runs:
        row = [
            r["scheduler"],
            load_label(r),
            str(r.get("cpu_interference") or 0),
            f"{r['completed']}/{r['failed']}",
            cell(r["request_throughput"], "{:.2f}"),
            cell(r["output_tokens_per_s"], "{:.0f}"),
            f"{cell(r['ttft_ms']['p50'])}/{cell(r['ttft_ms']['p99'])}",
            f"{cell((r.get('queue_ms') or {}).get('p50'))}/{cell((r.get('queue_ms') or {}).get('p99'))}",
            f"{cell(r['tpot_ms']['p50'], '{:.2f}')}/{cell(r['tpot_ms']['p99'], '{:.2f}')}",
            cell(r["itl_ms"]["p99"], "{:.2f}"),
            f"{cell(r['e2e_ms']['p50'], '{:.0f}')}/{cell(r['e2e_ms']['p99'], '{:.0f}')}",
            cell(r["cpu_s_per_1k_tokens"], "{:.3f}"),
            "-"
            if r.get("loadgen_cpu_frac") is None
            else f"{r['loadgen_cpu_s']:.2f}s {100 * r['loadgen_cpu_frac']:.0f}%",
        ]
        if has_bubbles:
            row += [
                f"{cell(r.get('bubble_us_p50'))}/{cell(r.get('bubble_us_p99'))}",
                cell(r.get("step_us_p50")),
            ]
        if has_spec:
            rate = r.get("spec_acceptance_rate")
            row += [
                "-" if rate is None else f"{100 * rate:.0f}%",
                cell(r.get("spec_accepted_per_draft"), "{:.2f}"),
            ]
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
            f"throughput x{cell(d['throughput_ratio'], '{:.2f}')}, "
            f"TTFT p99 x{cell(d['ttft_ms_p99_ratio'], '{:.2f}')}, "
            f"TPOT p50 x{cell(d['tpot_ms_p50_ratio'], '{:.2f}')}, "
            f"TPOT p99 x{cell(d['tpot_ms_p99_ratio'], '{:.2f}')}, "
            f"CPU/1k x{cell(d['cpu_s_per_1k_tokens_ratio'], '{:.2f}')}"
        )
    return "\n".join(lines)


def ratio_cells(d: dict) -> list[str]:
    a, b = d["output_tokens_per_s"]
    busy = f" +{d['cpu_interference']}busy" if d.get("cpu_interference") else ""
    return [
        d["scheduler"],
        load_label(d) + busy,
        f"{cell(a, '{:.1f}')} / {cell(b, '{:.1f}')}",
        f"x{cell(d['output_tokens_per_s_ratio'], '{:.2f}')}",
        f"x{cell(d['ttft_ms_p50_ratio'], '{:.2f}')}",
        f"x{cell(d['tpot_ms_p50_ratio'], '{:.2f}')}",
    ]


RATIO_HEAD = ["scheduler", "load", "out tok/s (it / hf)", "tok/s ratio", "TTFT p50 ratio", "TPOT p50 ratio"]


def titled_table(text: str, head: list[str], cells: list[list[str]], left: int) -> str:
    """A console table under its one-line explanation: the first `left` columns flush left, the
    rest right, each as wide as its widest cell; "" without rows."""
    if not cells:
        return ""
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    lines = [text, "  " + "  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += [
        "  " + "  ".join(c.rjust(w) if i >= left else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    return "\n".join(lines)


RATIO_TEXT = (
    "ringleader / hf (transformers continuous batching) at the same load: tok/s above 1 and "
    "TTFT/TPOT below 1 favour ringleader"
)


def format_ratios(rows: list[dict]) -> str:
    return titled_table(RATIO_TEXT, RATIO_HEAD, [ratio_cells(d) for d in rows], left=2)


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


def overhead_cells(d: dict) -> list[str]:
    a, b = d["output_tokens_per_s"]
    la, lb = d["loadgen_cpu_s_per_1k_tokens"]
    sa, sb = d["server_cpu_s_per_1k_tokens"]
    busy = f" +{d['cpu_interference']}busy" if d.get("cpu_interference") else ""
    return [
        load_label(d) + busy,
        f"{cell(a, '{:.1f}')} / {cell(b, '{:.1f}')}",
        f"x{cell(d['output_tokens_per_s_ratio'], '{:.3f}')}",
        _signed(d["ttft_ms_p50_diff"]),
        _signed(d["ttft_ms_p99_diff"]),
        _signed(d["tpot_ms_p50_diff"], "{:+.3f}"),
        _signed(d["itl_ms_p50_diff"], "{:+.3f}"),
        _signed(d["itl_ms_p99_diff"], "{:+.3f}"),
        f"{cell(la, '{:.3f}')} / {cell(lb, '{:.3f}')}",
        f"{cell(sa, '{:.3f}')} / {cell(sb, '{:.3f}')}",
    ]


OVERHEAD_TEXT = (
    "the HTTP gateway against ZeroMQ on the same server (gateway - native; +ms/tok = added latency "
    "per token); the two load generators' own CPU differs (see loadgen CPU), and on a CPU host "
    "they share the cores with the server"
)


def format_overhead(rows: list[dict]) -> str:
    return titled_table(OVERHEAD_TEXT, OVERHEAD_HEAD, [overhead_cells(d) for d in rows], left=1)


PREFIX_HEAD = [
    "variant",
    "load",
    "TTFT p50 ms (on / off)",
    "TTFT p90 ms (on / off)",
    "out tok/s (on / off)",
    "req/s (on / off)",
    "hit rate (on / off)",
    "expected",
    "TTFT p50 off/on",
    "tok/s on/off",
    "req/s on/off",
]


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def prefix_cells(d: dict) -> list[str]:
    busy = f" +{d['cpu_interference']}busy" if d.get("cpu_interference") else ""
    pair = lambda key, fmt: " / ".join(cell(v, fmt) for v in d[key])  # noqa: E731
    expected = _pct(d.get("expected_prefix_hit_rate"))
    if d.get("expected_prefix_hit_rate_cold") is not None:
        expected += f" ({_pct(d['expected_prefix_hit_rate_cold'])} cold)"
    return [
        str(d["variant"]),
        load_label(d) + busy,
        pair("ttft_ms_p50", "{:.1f}"),
        pair("ttft_ms_p90", "{:.1f}"),
        pair("output_tokens_per_s", "{:.0f}"),
        pair("request_throughput", "{:.2f}"),
        " / ".join(_pct(v) for v in d["prefix_cache_hit_rate"]),
        expected,
        f"x{cell(d['ttft_ms_p50_ratio_off_on'], '{:.2f}')}",
        f"x{cell(d['output_tokens_per_s_ratio_on_off'], '{:.2f}')}",
        f"x{cell(d['request_throughput_ratio_on_off'], '{:.2f}')}",
    ]


PREFIX_TEXT = (
    "prefix caching on / off (serve --prefix-caching / --no-prefix-caching, the same shared-prefix "
    "workload): TTFT off/on and throughput on/off above 1 favour caching; hit rate = the server's "
    "prefix-cache hits / queries over the run (- when it does not report them); expected = prefix / "
    "prompt tokens once each group's prefix was seen (cold: each group's first request a miss)"
)


def format_prefix_caching(rows: list[dict]) -> str:
    return titled_table(PREFIX_TEXT, PREFIX_HEAD, [prefix_cells(d) for d in rows], left=2)


CLIENT_HEAD = [
    "client",
    "load",
    "ok/fail",
    "out tok/s",
    "TTFT p50/p99 ms",
    "TPOT p50/p99 ms",
    "ITL p99 ms",
    "tok/msg",
    "model step p50 us",
    "TTFT-model p50 us",
    "TPOT-model p50 us",
    "client CPU s/1k",
    "server CPU s/1k",
    "engine/completions/frontend/other s/1k",
    "sched crit/overlap p50 us",
]


def client_cells(d: dict) -> list[str]:
    busy = f" +{d['cpu_interference']}busy" if d.get("cpu_interference") else ""
    t = d["server_thread_cpu_s_per_1k_tokens"]
    return [
        d["client"],
        load_label(d) + busy,
        f"{d['completed']}/{d['failed']}",
        cell(d["output_tokens_per_s"], "{:.0f}"),
        f"{cell(d['ttft_ms']['p50'], '{:.2f}')}/{cell(d['ttft_ms']['p99'], '{:.2f}')}",
        f"{cell(d['tpot_ms']['p50'], '{:.3f}')}/{cell(d['tpot_ms']['p99'], '{:.3f}')}",
        cell(d["itl_ms"]["p99"], "{:.3f}"),
        cell(d["tokens_per_message"], "{:.1f}"),
        cell(d["model_step_us_p50"]),
        cell(d["ttft_less_model_us_p50"], "{:.0f}"),
        cell(d["tpot_less_model_us_p50"], "{:.0f}"),
        cell(d["client_cpu_s_per_1k_tokens"], "{:.3f}"),
        cell(d["server_cpu_s_per_1k_tokens"], "{:.3f}"),
        "/".join(cell(t.get(k), "{:.3f}") for k in (*SERVER_THREADS, "other")),
        f"{cell(d['sched_critical_us_p50'])}/{cell(d['sched_overlapped_us_p50'])}",
    ]


CLIENT_TEXT = (
    "each client against the same server, back to back at each load (a chunk stamped when the "
    "client hands it over; tok/msg: token ids per token message); -model = less the server's "
    "model step p50; CPU per 1k output tokens"
)


def format_client_costs(rows: list[dict]) -> str:
    return titled_table(CLIENT_TEXT, CLIENT_HEAD, [client_cells(d) for d in rows], left=2)
