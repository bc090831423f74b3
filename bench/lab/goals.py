"""The GPU goals as one report: one row per goal, each with the goal, what was measured, and met,
missed or not measured, from the files a bring-up window returned.

    python -m ringleader.bench.lab.goals E F --out DIR     # E, F: bring-up OUT folders (or any folders)

Each argument is a folder (searched for the benchmark's results.json, the roofline's result.json
and the gpu_limits probes' JSON, inside artifacts.tar.gz too) or one of those files.  Where a goal
was measured more than once (runs E and F measure the same loads in opposite orders), every value
is shown and the verdict needs all of them: the spread between the runs is part of the result.
The bubble goal has one row per launch mode the device runs name (run F's bubble-pingpong and
bubble-resident stages measure the two side by side), each with the critical phase's µs and the
TPOT (the cadence, which also counts what the timeline's step start leaves out) beside.  Beside
the goals, one row per step-boundary design that run F's launch probes measured
(bench/lab/launch_designs.py).  Writes DIR/summary.md and DIR/goals.json; a goal with no figure says
"not measured".

The goals are the default step's (fused): a run served with `--step-kernels layered` (run F's
goals-layered; known by the server's description, else by the bench's --server-arg) stands
beside them in the last row, the fused step's throughput against the layered one's at each
load; the step goal's row shows each kind the roofline timed and the fused/layered ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ringleader.bench.lab.launch_designs import LIMITS_SCHEMA, design_rows, designs_markdown

LOADS = (1, 32, 256)  # the closed-loop concurrencies every goal is asked at
BUBBLE_P50_US, BUBBLE_P99_US = 3.0, 10.0
STEP_OVER_FLOOR = 1.15
SCHED_CPU_RATIO = 10.0
INTERFERENCE_KEPT = 0.95
LAYERED = "layered"  # the step kind the fused one replaces: its runs sit beside the goals, not in them
FUSED_MAX_ROWS = 32  # the largest bucket the fused step runs; larger ones are layered either way
SCHED_THREADS = {"device": ("rl-cq-poll", "rl-pump"), "host": ("rl-host-sched",)}  # the scheduling side


@dataclass
class Goal:
    goal: str
    measured: str
    verdict: str  # met | missed | not measured | met where measured (some loads did not run)


def load_documents(paths: list[Path]) -> tuple[list[dict], list[dict], list[dict]]:
    """(benchmark documents, roofline documents, gpu_limits documents) found under paths."""
    docs: list[dict] = []
    for p in paths:
        if p.is_file() and p.suffix == ".json":
            docs.append(json.loads(p.read_text()))
            continue
        if not p.is_dir():
            continue
        for f in sorted(p.rglob("*.json")):
            docs.append(json.loads(f.read_text()))
        for tar in sorted(p.rglob("*.tar.gz")):
            with tarfile.open(tar) as t:
                for m in t.getmembers():
                    if m.isfile() and m.name.endswith(".json") and (fh := t.extractfile(m)) is not None:
                        docs.append(json.loads(fh.read()))
    bench = [d for d in docs if isinstance(d, dict) and isinstance(d.get("runs"), list)]
    roofline = [d for d in docs if isinstance(d, dict) and "copy_bandwidth_GBps" in d and "steps" in d]
    limits = [d for d in docs if isinstance(d, dict) and d.get("schema") == LIMITS_SCHEMA]
    return bench, roofline, limits


def server_flag(doc: dict, flag: str) -> str | None:
    """The value the bench gave `ringleader serve` for flag (--server-arg), or None."""
    args = [str(a) for a in (doc.get("settings") or {}).get("server_arg") or []]
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def step_kernels_of(run: dict, doc: dict) -> str | None:
    """The step kind a run served with: the server's description, else the bench's
    --server-arg, else None (the server's default)."""
    return (run.get("backend") or {}).get("step_kernels") or server_flag(doc, "--step-kernels")


def runs_of(bench: list[dict], model: str | None = "llama-1b") -> list[dict]:
    """Every run of the model, each with its step_kernels (step_kernels_of)."""
    return [
        {**r, "step_kernels": step_kernels_of(r, d)}
        for d in bench
        for r in d["runs"]
        if model is None or r.get("model") == model
    ]


def default_step(runs: list[dict]) -> list[dict]:
    """The runs the goals judge: all but the layered step's."""
    return [r for r in runs if r.get("step_kernels") != LAYERED]


def pick(runs, scheduler, *, concurrency=None, rate=None, busy=0, prefix=None) -> list[dict]:
    return [
        r
        for r in runs
        if r.get("scheduler") == scheduler
        and r.get("concurrency") == concurrency
        and (rate is None or r.get("request_rate") == rate)
        and (r.get("cpu_interference") or 0) == busy
        and r.get("prefix_caching") == prefix
        and r.get("completed")
    ]


def sched_cpu_us_per_step(run: dict) -> float | None:
    steps = (run.get("device_stats") or {}).get("steps")
    threads = run.get("thread_cpu_s") or {}
    names = SCHED_THREADS.get(run.get("scheduler"), ())
    cpu = [threads[n] for n in names if threads.get(n) is not None]
    if not steps or not cpu:
        return None
    return sum(cpu) / steps * 1e6


def _fmt(values, spec=".1f") -> str:
    return " / ".join(format(v, spec) for v in values)


def _bubbles(runs) -> str:
    return ", ".join(f"{r['bubble_us_p50']:.1f}/{r['bubble_us_p99']:.1f}" for r in runs)


def launch_of(run: dict) -> str | None:
    """The launch mode that ran (the server's stats: resident, pingpong, pump), or None."""
    return (run.get("backend") or {}).get("launch")


def launch_requested(run: dict) -> str | None:
    """The launch mode the server was asked for (auto, or one a bubble stage forces), or None."""
    return (run.get("backend") or {}).get("launch_requested")


def _beside(runs) -> str:
    """The critical phase p50/p99 and TPOT p50 of each run, where its document has them."""
    crit = [(r.get("device_stats") or {}) for r in runs]
    crit = [
        f"{d['device_sched_us_p50']:.2f}/{d['device_sched_us_p99']:.2f}"
        for d in crit
        if d.get("device_sched_us_p50") is not None and d.get("device_sched_us_p99") is not None
    ]
    tpot = [(r.get("tpot_ms") or {}).get("p50") for r in runs]
    tpot = [f"{1e3 * t:.1f}" for t in tpot if t is not None]
    return (f", critical {', '.join(crit)}" if crit else "") + (f", TPOT {', '.join(tpot)}" if tpot else "")


def bubble_goal(runs, launch: str | None = None, by_launch: bool = False) -> Goal:
    """The bubble goal over the device runs (by_launch: only those whose launch mode is `launch`)."""
    parts, ok, seen, missing = [], True, False, False
    for c in LOADS:
        dev = [r for r in pick(runs, "device", concurrency=c) if r.get("bubble_us_p50") is not None]
        dev = [r for r in dev if not by_launch or launch_of(r) == launch]
        host = [r for r in pick(runs, "host", concurrency=c) if r.get("bubble_us_p50") is not None]
        if not dev:
            missing = True
            parts.append(f"c={c}: not measured")
            continue
        seen = True
        ok &= all(r["bubble_us_p50"] <= BUBBLE_P50_US and r["bubble_us_p99"] <= BUBBLE_P99_US for r in dev)
        text = f"c={c}: device {_bubbles(dev)}{_beside(dev)}" + (f"; host {_bubbles(host)}" if host else "")
        parts.append(text + " µs")
    mode = f"device mode, launch {launch or 'not recorded'}" if by_launch else "device mode"
    goal = f"bubble p50 ≤ {BUBBLE_P50_US:g} µs, p99 ≤ {BUBBLE_P99_US:g} µs ({mode}; critical phase, TPOT and host mode beside)"
    return Goal(goal, "; ".join(parts), verdict(seen, ok, missing))


LAUNCH_ORDER = ("resident", "pingpong", "pump")  # the measured baseline first, then what replaces it


def bubble_goals(runs) -> list[Goal]:
    """One bubble row per launch mode the device runs name (one row when they name at most one),
    so a mode that meets the goal is not hidden by another that misses it."""
    launches = {
        launch_of(r) for r in runs if r.get("scheduler") == "device" and r.get("bubble_us_p50") is not None
    }
    if len(launches) <= 1:
        return [bubble_goal(runs, next(iter(launches), None), by_launch=bool(launches - {None}))]
    rank = lambda x: (LAUNCH_ORDER.index(x) if x in LAUNCH_ORDER else len(LAUNCH_ORDER), x or "~")  # noqa: E731
    return [bubble_goal(runs, x, by_launch=True) for x in sorted(launches, key=rank)]


def judged_steps(doc: dict) -> list[dict]:
    """A roofline document's steps the step goal judges: the fused kind's where it timed kinds
    (none when fused failed), else its steps (a document from before the kinds)."""
    by_kind = doc.get("by_kind") or {}
    return by_kind["fused"] if "fused" in by_kind else doc["steps"]


def step_text(doc: dict) -> list[str]:
    """Per rows: the judged step over its floor, each other kind beside when the kinds were steps
    of their own, the fused/layered ratio; then each kind that failed to build."""
    ratios = {x["rows"]: x["ratio"] for x in doc.get("fused_over_layered") or []}
    apart = doc.get("fused_over_layered") is not None
    others = {k: v for k, v in (doc.get("by_kind") or {}).items() if k != "fused"} if apart else {}
    parts = []
    for s in judged_steps(doc):
        kind = "fused " if apart else ""
        text = f"{s['rows']} rows: {kind}{s['step_us']:.0f} µs over {s['floor_us']:.0f} = {s['ratio']:.2f}x"
        for name, steps in others.items():
            text += "".join(
                f", {name} {o['step_us']:.0f} µs = {o['ratio']:.2f}x" for o in steps if o["rows"] == s["rows"]
            )
        if s["rows"] in ratios:
            text += f", fused/layered {ratios[s['rows']]:.2f}"
        parts.append(text)
    return parts + [
        f"{e['step_kernels']} at {e['rows']} rows failed: {e['error']}" for e in doc.get("errors") or []
    ]


def step_goal(roofline: list[dict]) -> Goal:
    goal = f"1-row llama-1b bf16 decode step ≤ {STEP_OVER_FLOOR}x its memory floor (the fused step; layered beside)"
    docs = [d for d in roofline if d.get("model") == "llama-1b"]
    one = [s for d in docs for s in judged_steps(d) if s["rows"] == 1]
    text = "; ".join(part for d in docs for part in step_text(d))
    if not one:
        return Goal(goal, text or "not measured", "not measured")
    return Goal(goal, text, verdict(True, all(s["ratio"] <= STEP_OVER_FLOOR for s in one)))


def kernels_goal(runs: list[dict]) -> Goal:
    """The fused step's device-mode throughput against the layered step's at each load: judged
    where the fused step runs (c ≤ FUSED_MAX_ROWS), shown at 256."""
    goal = (
        f"fused step ≥ layered step throughput, device mode, at c ≤ {FUSED_MAX_ROWS} (output tok/s, "
        f"fused vs layered; c=256 beside: its steps are over {FUSED_MAX_ROWS} rows, layered either way)"
    )
    parts, ok, seen, missing = [], True, False, False
    for c in LOADS:
        done = [r for r in pick(runs, "device", concurrency=c) if r.get("output_tokens_per_s") is not None]
        layered_runs = [r for r in done if r.get("step_kernels") == LAYERED]
        # like with like: the fused runs launched as the layered ones were asked to (not the bubble stages')
        asked = {launch_requested(r) for r in layered_runs}
        fused = [
            r["output_tokens_per_s"]
            for r in done
            if r.get("step_kernels") != LAYERED and launch_requested(r) in asked
        ]
        layered = [r["output_tokens_per_s"] for r in layered_runs]
        judged = c <= FUSED_MAX_ROWS
        if not fused or not layered:
            missing |= judged
            parts.append(f"c={c}: not measured")
            continue
        if judged:
            seen = True
            ok &= all(f >= x for f in fused for x in layered)
        ratio = (sum(fused) / len(fused)) / (sum(layered) / len(layered))
        parts.append(
            f"c={c}: {_fmt(fused, '.0f')} vs {_fmt(layered, '.0f')} (x{ratio:.2f}){'' if judged else ', beside'}"
        )
    return Goal(goal, "; ".join(parts), verdict(seen, ok, missing))


def paired(runs, key, **where) -> tuple[list, list]:
    dev = [key(r) for r in pick(runs, "device", **where)]
    host = [key(r) for r in pick(runs, "host", **where)]
    return [v for v in dev if v is not None], [v for v in host if v is not None]


def loads(runs) -> list[dict]:
    """Every load point with both modes: the closed-loop concurrencies, then the open-loop rates."""
    out = [dict(concurrency=c) for c in LOADS]
    rates = sorted(
        {r["request_rate"] for r in runs if r.get("concurrency") is None and r.get("request_rate")}, key=str
    )
    return out + [dict(rate=x) for x in rates]


def label(where: dict) -> str:
    return f"c={where['concurrency']}" if "concurrency" in where else f"{where['rate']} req/s"


def compare_goal(runs, goal: str, key, better, spec: str, which: list[dict], lower: bool = False) -> Goal:
    """device vs host at each load in `which`: met when `better(device, host)` holds for every
    pairing of the device's and the host's values.  The ratio shown is device/host, or with
    `lower` host/device (how many times lower the device's is)."""
    parts, ok, seen, missing = [], True, False, False
    for where in which:
        dev, host = paired(runs, key, **where)
        if not dev or not host:
            missing = True
            parts.append(f"{label(where)}: not measured")
            continue
        seen = True
        ok &= all(better(d, h) for d in dev for h in host)
        d_mean, h_mean = sum(dev) / len(dev), sum(host) / len(host)
        num, den = (h_mean, d_mean) if lower else (d_mean, h_mean)
        ratio = f"x{num / den:.2f}{' lower' if lower else ''}" if den else "x?"
        parts.append(f"{label(where)}: {_fmt(dev, spec)} vs {_fmt(host, spec)} ({ratio})")
    return Goal(goal, "; ".join(parts), verdict(seen, ok, missing))


def interference_goal(bench: list[dict]) -> Goal:
    """Each busy run against the quiet run of the same mode and load in the same document (the
    benchmark measures the two side by side)."""
    goal = f"≥ {INTERFERENCE_KEPT:.0%} of throughput kept under CPU interference (device; host beside)"
    parts, ok, seen = [], True, False
    for doc in bench:
        runs = default_step(runs_of([doc]))
        for loaded in (r for r in runs if r.get("cpu_interference") and r.get("completed")):
            mode, c = loaded.get("scheduler"), loaded.get("concurrency")
            quiet = pick(runs, mode, concurrency=c, prefix=loaded.get("prefix_caching"))
            if not quiet or not quiet[0].get("output_tokens_per_s"):
                continue
            kept = loaded["output_tokens_per_s"] / quiet[0]["output_tokens_per_s"]
            parts.append(f"{mode} c={c} +{loaded['cpu_interference']} busy: {100 * kept:.1f}% kept")
            if mode == "device":
                seen = True
                ok &= kept >= INTERFERENCE_KEPT
    return Goal(goal, "; ".join(parts) or "not measured", verdict(seen, ok))


def verdict(seen: bool, ok: bool, missing: bool = False) -> str:
    if not seen:
        return "not measured"
    if not ok:
        return "missed"
    return "met where measured" if missing else "met"


def goals(bench: list[dict], roofline: list[dict]) -> list[Goal]:
    every = runs_of(bench)
    runs = default_step(every)
    closed = [dict(concurrency=c) for c in LOADS]
    return [
        *bubble_goals(runs),
        step_goal(roofline),
        compare_goal(
            runs,
            f"scheduling side's host CPU per step ≥ {SCHED_CPU_RATIO:g}x lower in device mode (µs/step: "
            "CQ poller vs the host scheduler's thread)",
            sched_cpu_us_per_step,
            lambda d, h: d * SCHED_CPU_RATIO <= h,
            ".1f",
            closed,
            lower=True,
        ),
        compare_goal(
            runs,
            "server CPU per 1k tokens lower in device mode at every load (s)",
            lambda r: r.get("cpu_s_per_1k_tokens"),
            lambda d, h: d < h,
            ".4f",
            loads(runs),
            lower=True,
        ),
        compare_goal(
            runs,
            "device ≥ host throughput, closed loop (output tok/s)",
            lambda r: r.get("output_tokens_per_s"),
            lambda d, h: d >= h,
            ".0f",
            closed,
        ),
        compare_goal(
            runs,
            "device ≥ host throughput, open loop (output tok/s)",
            lambda r: r.get("output_tokens_per_s"),
            lambda d, h: d >= h,
            ".0f",
            loads(runs)[len(LOADS) :] or [dict(rate="any")],
        ),
        interference_goal(bench),
        kernels_goal(every),
    ]


def summary_markdown(rows: list[Goal]) -> str:
    lines = ["| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {g.goal} | {g.measured} | **{g.verdict}** |" for g in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", type=Path, help="bring-up OUT folders, result folders or JSON files")
    ap.add_argument("--out", type=Path, required=True, help="folder for summary.md and goals.json")
    args = ap.parse_args(argv)
    bench, roofline, limits = load_documents(args.inputs)
    rows = goals(bench, roofline)
    designs = design_rows(limits, BUBBLE_P50_US)
    text = summary_markdown(rows) + "\n" + designs_markdown(designs, BUBBLE_P50_US)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text(text)
    doc = {
        "inputs": [str(p) for p in args.inputs],
        "goals": [asdict(g) for g in rows],
        "designs": [asdict(d) for d in designs],
    }
    (args.out / "goals.json").write_text(json.dumps(doc, indent=2) + "\n")
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
