"""Speculative decoding (prompt lookup, n-gram drafts) against none, on the real model, side by side.

    python -m ringleader.bench.lab.spec_bench --out DIR [--quick] [--k 2,8] [--model PATH.gguf]

One `ringleader serve` per form (bench/servers.py's ServerProcess; the CPU backend, SmolLM2-135M
by default), all up at once (an idle CPU server takes about 1 % of a core): `off` (`--speculative
off`), `ngram` (`--speculative ngram`, the server's default number of draft tokens) and, with
`--k 2,8`, `ngram-k2`, `ngram-k8` (`--num-speculative-tokens K`). Every server gets the same
`--slots`, `--max-ctx`, `--no-prefix-caching` (so each round does the same work whatever ran
before it) and any `--server-arg`.

Cells: each workload (`copy`: bench/workloads.py's copy-heavy chat requests, whose answer
repeats a passage of the prompt; `random`: random prompt ids, the bench's default workload, with
prompts about as long) at 1 and 8 concurrent streams (closed loop, bench/loadgen.py's `measure`),
greedy with `ignore_eos` and max_tokens at most `--max-tokens` (the copy requests' own length is
their passage's), quiet and then beside `--neighbours` busy processes (bench/interference.py).
The forms are interleaved: each round runs every cell once on every form, in an order rotated
by one a round and a cell, the same requests for every form (round r sends requests
[r*n, (r+1)*n) of the cell's list, made once from `--seed`).

Per cell and form: output tok/s (the cell's tokens over its rounds' summed durations), TPOT p50
and p90 (ms, bench/metrics.py, pooled over the rounds' requests), tokens per server step, the
acceptance rate (the server's spec_accepted_tokens / spec_draft_tokens over the cell's runs) and
accepted tokens per draft, and against `off`: the tok/s ratio, the median of each round's own
tok/s ratio (`paired`, robust to a shared machine's drift) and the TPOT p50/p90 ratios. Before
the cells, a parity check: greedy outputs of a few copy requests from every form, token by token
against `off` (speculative decoding must not change them).

Writes DIR/results.json (every figure, each run's, the machine: CPU model and flags from
/proc/cpuinfo, torch, the commit) and DIR/README.md (the tables, also printed). `--quick` is a
smoke run (one round of 16 tokens, about 2 minutes on 2 cores); the default takes about 11
minutes on 2 cores, each `--k` value about 5 more.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import os
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ringleader.bench import servers as S
from ringleader.bench.interference import CpuInterference
from ringleader.bench.loadgen import Load, RunResult, SendOptions, measure
from ringleader.bench.metrics import run_metrics, summarize
from ringleader.bench.report import environment, save_json
from ringleader.bench.workloads import (
    WorkloadConfig,
    copy_encoder,
    make_copy_requests,
    make_requests,
    prompt_id_range_for,
)

SCHEMA = "ringleader-spec-bench/1"
WORKLOAD_KINDS = ("copy", "random")
BASE = "off"
# /proc/cpuinfo flags a CPU figure is read by (the model step's kernels use them)
CPU_FLAG_PATTERN = re.compile(r"^(avx2|avx512\w*|avx_vnni\w*|amx\w*|fma|f16c)$")


@dataclass(frozen=True)
class Form:
    """One server of the comparison: its name and its `serve` flags."""

    name: str
    server_args: tuple[str, ...]


def forms_for(ks: list[int]) -> list[Form]:
    """off, ngram (the server's default k), then ngram-kK for each K of `ks`."""
    out = [Form(BASE, ("--speculative", "off")), Form("ngram", ("--speculative", "ngram"))]
    out += [Form(f"ngram-k{k}", ("--speculative", "ngram", "--num-speculative-tokens", str(k))) for k in ks]
    return out


@dataclass
class Plan:
    rounds: int = 3
    max_tokens: int = 96
    streams: tuple[int, ...] = (1, 8)
    requests: dict[int, int] = field(default_factory=lambda: {1: 2, 8: 8})  # per round and cell
    neighbours: int = 1
    random_input_len: int = 192  # about the copy prompts' length under SmolLM2's chat template
    workloads: tuple[str, ...] = WORKLOAD_KINDS
    parity_requests: int = 3
    seed: int = 0
    temperature: float = 0.0  # > 0: sampled (seeded) runs, where a model's output repeats less

    def n_requests(self, streams: int) -> int:
        return self.requests.get(streams, streams)


def plan_for(args: argparse.Namespace) -> Plan:
    streams = tuple(args.streams)
    requests = {s: max(s, args.requests_per_stream * s if s > 1 else args.requests_single) for s in streams}
    plan = Plan(args.rounds, args.max_tokens, streams, requests, args.neighbours, seed=args.seed)
    kinds = tuple(args.workloads.split(","))
    plan = dataclasses.replace(plan, workloads=kinds, temperature=args.temperature)
    if args.quick:  # one round of short requests: the smoke run
        plan = dataclasses.replace(
            plan, rounds=1, max_tokens=16, requests={s: s for s in streams}, parity_requests=1
        )
    return plan


def cell_requests(plan: Plan, kind: str, streams: int, model: str, max_ctx: int, encoder=None) -> list:
    """Every round's requests of a cell, round r's at [r*n, (r+1)*n): the copy workload (through
    `encoder`, copy_encoder's (encode, count, how)) or random ids; the same seed for every cell, so
    the 1-stream list is the head of the 8-stream one."""
    n = plan.rounds * plan.n_requests(streams)
    if kind == "copy":
        encode, count, _ = encoder or copy_encoder(model)
        return make_copy_requests(
            n, encode, count, seed=plan.seed, max_context=max_ctx, output_cap=plan.max_tokens
        )
    cfg = WorkloadConfig(
        n,
        plan.random_input_len,
        plan.max_tokens,
        seed=plan.seed,
        max_context=max_ctx,
        prompt_id_range=prompt_id_range_for(model),
    )
    return make_requests(cfg)


def round_order(forms: list, round_index: int, cell_index: int) -> list:
    """The forms rotated by one a round and a cell, so none always runs first."""
    k = (round_index + cell_index) % len(forms)
    return forms[k:] + forms[:k]


# ---------------------------------------------------------------- one run, and the cell's figures


def run_entry(result: RunResult, **labels) -> dict:
    """One measured run as results.json keeps it: its labels, client figures, the server's
    speculative-decoding and step counters over it, and the raw TPOT samples (ms)."""
    m = run_metrics(result.records)
    spec = S.spec_decode_deltas(result.stats_before, result.stats_after)
    dev = S.device_deltas(result.stats_before, result.stats_after)
    ok = [r for r in result.records if r.ok]
    return {
        **labels,
        "requests": len(result.records),
        "completed": m["completed"],
        "failed": m["failed"],
        "errors": m["errors"],
        "short": sum(1 for r in ok if r.output_tokens < r.max_tokens),
        "output_tokens": m["output_tokens"],
        "duration_s": m["duration_s"],
        "output_tokens_per_s": m["output_tokens_per_s"],
        "tpot_ms": m["tpot_ms"],
        "device_steps": dev.get("steps"),
        "generated": dev.get("generated"),
        **spec,
        "tpot_samples_ms": [r.tpot() * 1e3 for r in ok if r.tpot() is not None],
    }


def _total(runs: list[dict], key: str):
    vals = [r.get(key) for r in runs]
    return None if not vals or any(v is None for v in vals) else sum(vals)


def cell_figures(runs: list[dict]) -> dict:
    """A cell's figures over its runs (one per round): tokens over summed durations, TPOT pooled
    over the requests, the speculative counters summed (acceptance = accepted / draft tokens)."""
    duration = sum(r["duration_s"] for r in runs)
    tokens = sum(r["output_tokens"] for r in runs)
    tpot = summarize(s for r in runs for s in r["tpot_samples_ms"])
    drafts, proposed, accepted = (_total(runs, k) for k in S.SPEC_COUNTERS)
    steps, generated = _total(runs, "device_steps"), _total(runs, "generated")
    return {
        "rounds": len(runs),
        "requests": sum(r["requests"] for r in runs),
        "completed": sum(r["completed"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "short": sum(r["short"] for r in runs),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if duration > 0 else None,
        "round_tokens_per_s": [r["output_tokens_per_s"] for r in runs],
        "tpot_ms_p50": tpot["p50"],
        "tpot_ms_p90": tpot["p90"],
        "tokens_per_step": generated / steps if steps and generated is not None else None,
        "spec_drafts_per_step": drafts / steps if steps and drafts is not None else None,
        "spec_drafts": drafts,
        "spec_draft_tokens": proposed,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / proposed if accepted is not None and proposed else None,
        "spec_accepted_per_draft": accepted / drafts if accepted is not None and drafts else None,
    }


def _ratio(a, b):
    return a / b if a is not None and b else None


def ratios_to_base(cells: list[dict]) -> list[dict]:
    """Each non-base form's cell against the base form's at the same condition, workload and
    streams: tok/s ratio, paired (median of the rounds' own tok/s ratios), TPOT p50/p90 ratios."""
    base = {(c["busy"], c["workload"], c["streams"]): c for c in cells if c["form"] == BASE}
    out = []
    for c in cells:
        b = base.get((c["busy"], c["workload"], c["streams"]))
        if c["form"] == BASE or b is None:
            continue
        per_round = [
            _ratio(x, y) for x, y in zip(c["round_tokens_per_s"], b["round_tokens_per_s"]) if _ratio(x, y)
        ]
        out.append(
            {
                "busy": c["busy"],
                "workload": c["workload"],
                "streams": c["streams"],
                "form": c["form"],
                "base": BASE,
                "tokens_per_s_ratio": _ratio(c["output_tokens_per_s"], b["output_tokens_per_s"]),
                "paired_tokens_per_s_ratio": statistics.median(per_round) if per_round else None,
                "tpot_ms_p50_ratio": _ratio(c["tpot_ms_p50"], b["tpot_ms_p50"]),
                "tpot_ms_p90_ratio": _ratio(c["tpot_ms_p90"], b["tpot_ms_p90"]),
            }
        )
    return out


def collect_cells(runs: list[dict], forms: list[str] | None = None) -> list[dict]:
    """The runs grouped by (busy, workload, streams, form): the cells in the order they first ran,
    each cell's forms in the order of `forms` (else as they first ran)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["busy"], r["workload"], r["streams"], r["form"]), []).append(r)
    first = {}
    for k in groups:
        first.setdefault(k[:3], len(first))
    rank = {f: i for i, f in enumerate(forms or [])}
    keys = sorted(groups, key=lambda k: (first[k[:3]], rank.get(k[3], len(rank))))
    return [
        {"busy": k[0], "workload": k[1], "streams": k[2], "form": k[3], **cell_figures(groups[k])}
        for k in keys
    ]


# ---------------------------------------------------------------- the servers and the schedule


def server_args(args, form: Form) -> list[str]:
    opts = S.ServerOptions(
        model=args.model,
        device="cpu",
        slots=args.slots,
        max_ctx=args.max_ctx,
        token_budget=args.token_budget,
        threads=args.threads,
        extra=["--no-prefix-caching", *args.server_arg],
    )
    return opts.args() + list(form.server_args)


def start_servers(args, forms: list[Form], say) -> dict[str, S.ServerProcess]:
    """Every form's server, started at once (each loads the model), stopped on any failure."""
    servers = {f.name: S.ServerProcess(server_args(args, f)) for f in forms}
    errors: dict[str, Exception] = {}

    def start(name: str) -> None:
        try:
            servers[name].start()
        except Exception as exc:
            errors[name] = exc

    t0 = time.perf_counter()
    _each(start, list(servers))
    if errors:
        stop_servers(servers)
        name, exc = next(iter(errors.items()))
        raise S.ServerError(f"the {name} server did not start: {exc}")
    say(f"{len(servers)} servers up in {time.perf_counter() - t0:.1f} s: " + ", ".join(servers))
    return servers


def _each(fn, items: list) -> None:
    """fn(item) for every item at once, a thread each (servers start and drain in parallel)."""
    threads = [threading.Thread(target=fn, args=(x,)) for x in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def stop_servers(servers: dict[str, S.ServerProcess]) -> None:
    _each(lambda s: s.stop(), list(servers.values()))


def parity(servers: dict[str, S.ServerProcess], specs: list) -> list[dict]:
    """Each form's greedy tokens for `specs` against the base form's: identical or where they part."""
    from ringleader.ipc.client import Client

    tokens: dict[str, list[list[int]]] = {}
    for name, server in servers.items():
        with Client(server.address) as client:
            outs = []
            for spec in specs:
                stream = client.generate(
                    prompt_ids=spec.prompt_ids, max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True
                )
                outs.append([t for chunk in stream for t in chunk.token_ids])
            tokens[name] = outs
    out = []
    for name, outs in tokens.items():
        if name == BASE or BASE not in tokens:
            continue
        for i, (a, b) in enumerate(zip(outs, tokens[BASE])):
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if first is None and len(a) != len(b):
                first = min(len(a), len(b))
            out.append({"form": name, "request": i, "identical": first is None, "first_difference": first})
    return out


def run_schedule(args, plan: Plan, forms: list[Form], servers: dict, specs: dict, say) -> tuple[list, list]:
    """Every round of every cell on every form, quiet then beside the busy processes; returns the
    runs and what each busy level's spinners did."""
    options = SendOptions(temperature=plan.temperature, ignore_eos=True, seed=plan.seed)
    cells = [(kind, s) for kind in plan.workloads for s in plan.streams]
    runs, busy_info = [], []
    for busy in sorted({0, plan.neighbours}):
        with CpuInterference(busy) as spinners:
            for r in range(plan.rounds):
                for ci, (kind, streams) in enumerate(cells):
                    n = plan.n_requests(streams)
                    round_specs = specs[(kind, streams)][r * n : (r + 1) * n]
                    for form in round_order(forms, r, ci):
                        result = measure(
                            servers[form.name].address,
                            round_specs,
                            Load(concurrency=streams),
                            options=options,
                            timeout_s=args.timeout,
                        )
                        entry = run_entry(
                            result, busy=busy, round=r, workload=kind, streams=streams, form=form.name
                        )
                        runs.append(entry)
                        rate = entry["spec_acceptance_rate"]
                        say(
                            f"  busy {busy} round {r} {kind:<6} c={streams:<2} {form.name:<9} "
                            f"{entry['completed']}/{entry['requests']} ok, "
                            f"{entry['output_tokens_per_s'] or 0:.1f} tok/s, TPOT p50 "
                            f"{_num(entry['tpot_ms']['p50'], '{:.2f}')} ms"
                            + (f", accept {100 * rate:.0f}%" if rate is not None else "")
                        )
        busy_info.append(spinners.describe())
    return runs, busy_info


# ---------------------------------------------------------------- the machine and the tables


def cpu_flags(path: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's vector flags (CPU_FLAG_PATTERN) from /proc/cpuinfo's first `flags` line."""
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            return sorted({f for f in line.split(":", 1)[1].split() if CPU_FLAG_PATTERN.match(f)})
    return []


def machine() -> dict:
    env = environment()
    return {
        "cpu_model": env.get("cpu_model"),
        "cpu_flags": cpu_flags(),
        "cpu_count": env.get("cpu_count"),
        "torch": env.get("torch"),
        "python": env.get("python"),
        "git": env.get("git"),
        "platform": env.get("platform"),
        "loadavg_at_end": env.get("loadavg_at_end"),
    }


def _num(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _loadavg(v) -> str:
    return "?" if not v else " ".join(f"{x:.1f}" for x in v)


def _condition(busy: int) -> str:
    return "quiet" if busy == 0 else f"busy ({busy} spinning)"


CELL_HEAD = (
    "| condition | workload | streams | form | tok/s | TPOT p50 ms | TPOT p90 ms | tok/step | accept "
    "| accepted/draft | tok/s ratio | paired | TPOT p50 ratio | TPOT p90 ratio | ok/short |"
)


def cell_table(cells: list[dict], ratios: list[dict]) -> list[str]:
    by = {(d["busy"], d["workload"], d["streams"], d["form"]): d for d in ratios}
    lines = [CELL_HEAD, "|---|---|---:|---|" + "---:|" * 11]
    for c in cells:
        d = by.get((c["busy"], c["workload"], c["streams"], c["form"]), {})
        base = c["form"] == BASE
        rate = c["spec_acceptance_rate"]
        lines.append(
            f"| {_condition(c['busy'])} | {c['workload']} | {c['streams']} | {c['form']} "
            f"| {_num(c['output_tokens_per_s'])} | {_num(c['tpot_ms_p50'], '{:.2f}')} "
            f"| {_num(c['tpot_ms_p90'], '{:.2f}')} | {_num(c['tokens_per_step'], '{:.2f}')} "
            f"| {'-' if rate is None else f'{100 * rate:.0f}%'} | {_num(c['spec_accepted_per_draft'], '{:.2f}')} "
            + " ".join(
                f"| {'1.000' if base else _num(d.get(k), '{:.3f}')}"
                for k in (
                    "tokens_per_s_ratio",
                    "paired_tokens_per_s_ratio",
                    "tpot_ms_p50_ratio",
                    "tpot_ms_p90_ratio",
                )
            )
            + f" | {c['completed']}/{c['requests']} {c['short']} |"
        )
    return lines


def markdown(doc: dict) -> str:
    m, p = doc["machine"], doc["plan"]
    git = m.get("git") or {}
    parity_rows = doc.get("parity") or []
    same = sum(1 for x in parity_rows if x["identical"])
    lines = [
        "# Speculative decoding (prompt lookup) against none",
        "",
        f"Date {doc['created']}. Machine: {m.get('cpu_model')} with {', '.join(m.get('cpu_flags') or []) or 'no listed flags'}, "
        f"{m.get('cpu_count')} CPUs; torch {m.get('torch')}, Python {m.get('python')}; load average "
        f"{_loadavg(m.get('loadavg_at_start'))} at the start, {_loadavg(m.get('loadavg_at_end'))} at the end; commit "
        f"{git.get('commit')}" + (" (dirty tree)" if git.get("dirty") else "") + ".",
        f"Model {Path(doc['model']).name}, CPU backend; forms: "
        + ", ".join(f"`{f['name']}` (`{' '.join(f['server_args'])}`)" for f in doc["forms"])
        + f"; every server `{' '.join(doc['common_server_args'])}`.",
        f"{p['rounds']} interleaved round(s); per round and cell "
        + ", ".join(f"{n} request(s) at {s} stream(s)" for s, n in p["requests"].items())
        + (f"; sampled at temperature {p['temperature']}" if p.get("temperature") else "; greedy")
        + f", ignore_eos, max_tokens at most {p['max_tokens']} (copy: its passage's tokens); "
        f"random prompts of {p['random_input_len']} ids. Busy: {p['neighbours']} spin process(es) beside the server.",
        f"Wall time {doc['elapsed_s']:.0f} s. Greedy parity against `{BASE}`: {same}/{len(parity_rows)} outputs identical"
        + (
            "."
            if same == len(parity_rows)
            else " (first differences: "
            + ", ".join(
                f"{x['form']} #{x['request']} at token {x['first_difference']}"
                for x in parity_rows
                if not x["identical"]
            )
            + ")."
        ),
        "",
        "tok/s: the cell's output tokens over its runs' summed durations; TPOT pooled over the "
        "requests; tok/step: tokens generated per server step; accept: the server's "
        "spec_accepted_tokens / spec_draft_tokens over the cell, accepted/draft: spec_accepted_tokens / "
        "spec_drafts. Ratios are the form over `off` at the same cell (tok/s above 1 and TPOT "
        "below 1 favour the form); paired: the median of each round's own tok/s ratio. ok/short: "
        "completed of sent, and how many ended before max_tokens.",
        "",
        *cell_table(doc["cells"], doc["ratios"]),
        "",
    ]
    for b in doc.get("busy") or []:
        if b.get("busy_processes"):
            lines.append(
                f"Busy neighbour: {b['busy_processes']} spin process(es), "
                f"{_num(b.get('busy_cpu_s'))} CPU-s over {_num(b.get('busy_wall_s'))} s."
            )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ringleader.bench.lab.spec_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, metavar="DIR", help="write results.json and README.md here")
    p.add_argument("--quick", action="store_true", help="a smoke run: one round of 16 tokens")
    p.add_argument("--model", help="a .gguf file (default SmolLM2-135M: python -m ringleader.bench.smollm2)")
    p.add_argument(
        "--k",
        type=lambda t: [int(x) for x in t.split(",") if x.strip()],
        default=[],
        help="also ngram forms with --num-speculative-tokens K for each K of this comma list",
    )
    p.add_argument("--rounds", type=int, default=Plan.rounds, help="interleaved rounds (default %(default)s)")
    p.add_argument(
        "--max-tokens", type=int, default=Plan.max_tokens, help="max_tokens cap (default %(default)s)"
    )
    p.add_argument(
        "--streams",
        type=lambda t: [int(x) for x in t.split(",") if x.strip()],
        default=list(Plan.streams),
        help="concurrent streams of the cells (default 1,8)",
    )
    p.add_argument("--requests-single", type=int, default=2, help="requests per round at 1 stream (2)")
    p.add_argument(
        "--requests-per-stream", type=int, default=1, help="requests per round and stream above 1 (1)"
    )
    p.add_argument("--neighbours", type=int, default=1, help="busy processes of the busy half (1; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled runs (parity stays greedy)")
    p.add_argument("--workloads", default=",".join(WORKLOAD_KINDS), help="of copy,random (both)")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-ctx", type=int, default=1024)
    p.add_argument("--token-budget", type=int)
    p.add_argument("--threads", type=int, help="server torch threads (default: the server's)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="more serve flags")
    return p


def speculative_flags() -> bool:
    """Whether this checkout's `serve` takes --speculative (EngineConfig.speculative)."""
    from ringleader.device.engine_config import EngineConfig

    return "speculative" in {f.name for f in dataclasses.fields(EngineConfig)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not speculative_flags():
        print("spec_bench: this checkout's `ringleader serve` has no --speculative flag", file=sys.stderr)
        return 2
    if args.model is None:
        from ringleader.bench.smollm2 import smollm2_path

        args.model = str(smollm2_path())
    plan = plan_for(args)
    forms = forms_for(args.k)
    out = Path(args.out)
    t0 = time.perf_counter()
    loadavg = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    encoder = copy_encoder(args.model)
    specs = {
        (kind, s): cell_requests(plan, kind, s, args.model, args.max_ctx, encoder)
        for kind in plan.workloads
        for s in plan.streams
    }
    print(f"spec_bench: {len(forms)} forms, {plan.rounds} round(s), model {args.model}", flush=True)
    servers = start_servers(args, forms, lambda text: print(text, flush=True))
    try:
        for server in servers.values():  # warm each: its first steps of every shape
            measure(server.address, specs[(plan.workloads[0], max(plan.streams))][:2], Load(concurrency=2))
        checks = parity(servers, specs[(plan.workloads[0], min(plan.streams))][: plan.parity_requests])
        runs, busy = run_schedule(args, plan, forms, servers, specs, lambda text: print(text, flush=True))
    finally:
        stop_servers(servers)
    cells = collect_cells(runs, [f.name for f in forms])
    doc = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": ["python", "-m", "ringleader.bench.lab.spec_bench", *(argv or sys.argv[1:])],
        "machine": {**machine(), "loadavg_at_start": loadavg},
        "model": args.model,
        "plan": {**dataclasses.asdict(plan), "requests": {str(k): v for k, v in plan.requests.items()}},
        "forms": [{"name": f.name, "server_args": list(f.server_args)} for f in forms],
        "common_server_args": server_args(args, Form("", ())),
        "elapsed_s": time.perf_counter() - t0,
        "parity": checks,
        "busy": busy,
        "cells": cells,
        "ratios": ratios_to_base(cells),
        "runs": runs,
    }
    save_json(doc, out / "results.json")
    text = markdown(doc)
    (out / "README.md").write_text(text)
    print(text)
    print(f"wrote {out / 'results.json'} and {out / 'README.md'}")
    failed = sum(c["failed"] for c in cells)
    return 1 if failed or not all(x["identical"] for x in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
