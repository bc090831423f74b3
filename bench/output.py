"""What `ringleader bench` prints and writes: the console (kept for console.txt), a line per run,
the final tables, and under --out results.json, summary.md, console.txt and the plots."""

from __future__ import annotations

import math
from pathlib import Path

from ringleader.bench.report import loadgen_warnings, run_label, timeline_warnings, write_json
from ringleader.bench.report_markdown import markdown_summary
from ringleader.bench.report_tables import (
    format_client_costs,
    format_degradation,
    format_overhead,
    format_prefix_caching,
    format_ratios,
    format_table,
)


class Console:
    """print() that also keeps the text for console.txt."""

    def __init__(self, quiet: bool):
        self.quiet, self.lines = quiet, []

    def __call__(self, text: str = "", *, always: bool = False) -> None:
        self.lines.append(text)
        if always or not self.quiet:
            print(text, flush=True)


def say_run(say: Console, entry: dict) -> None:
    say(
        f"  {run_label(entry):<28} {entry['completed']}/{entry['requests']} ok, "
        f"{_fmt(entry['output_tokens_per_s'], '{:.0f}')} tok/s, "
        f"TTFT p50 {_fmt(entry['ttft_ms']['p50'], '{:.1f}')} ms, "
        f"TPOT p50 {_fmt(entry['tpot_ms']['p50'], '{:.2f}')} ms, "
        f"CPU {_fmt(entry['cpu_s_per_1k_tokens'], '{:.3f}')} s/1k tok, "
        f"loadgen {_fmt(entry['loadgen_cpu_s'], '{:.2f}')} s CPU in {entry['wall_s']:.1f} s"
        + (
            f", spec accept {100 * rate:.0f}% ({_fmt(entry.get('spec_accepted_per_draft'), '{:.2f}')}/draft)"
            if (rate := entry.get("spec_acceptance_rate")) is not None
            else ""
        )
    )
    if entry["failed"]:
        say(f"    failures: {entry['errors']}", always=True)


def say_results(say: Console, doc: dict) -> None:
    """The final tables (even with --quiet): every run, the ratios, overhead, prefix caching on /
    off and degradation there are, and the warnings (the load generator's, the device timeline's)."""
    runs = doc["runs"]
    say()
    say(format_table(runs), always=True)
    ratios = format_ratios(doc["ratios_vs_hf"])
    if ratios:
        say(ratios, always=True)
    overhead = format_overhead(doc["gateway_overhead"])
    if overhead:
        say(overhead, always=True)
    clients = format_client_costs(doc.get("client_costs") or [])
    if clients:
        say(clients, always=True)
    prefix = format_prefix_caching(doc.get("prefix_caching") or [])
    if prefix:
        say(prefix, always=True)
    deg = format_degradation(doc["degradation"])
    if deg:
        say(deg, always=True)
    for w in loadgen_warnings(runs) + timeline_warnings(runs):
        say(w, always=True)


def write_outputs(args, doc: dict, say: Console) -> None:
    out_dir = Path(args.out) if args.out else None
    json_path = Path(args.json) if args.json else (out_dir / "results.json" if out_dir else None)
    if json_path is not None:
        write_json(doc, json_path)
        say(f"wrote {json_path}", always=True)
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: list[str] = []
    if not args.no_plots:
        try:
            from ringleader.bench.plots import write_all

            plots = write_all(doc, out_dir)
        except ImportError as exc:  # matplotlib is an optional dependency (pip install .[bench])
            say(f"note: no plots ({exc}); install matplotlib", always=True)
    (out_dir / "summary.md").write_text(markdown_summary(doc, plots))
    say(f"wrote {out_dir / 'summary.md'}" + (f" and {len(plots)} plots" if plots else ""), always=True)
    (out_dir / "console.txt").write_text("\n".join(say.lines) + "\n")


def _fmt(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)
