"""bench/lab/sched_micro.py's report and this tree's own runs: the table it prints, --before REV
(the same script run in a temporary git worktree of REV), the null-host check and --steady.  Kept
apart so the script a --before run copies into an older tree needs nothing else from this one.

--steady: the critical phase's steady path (sched_critical.h rl_critical_steady) against the full
build on the same slot states.  Per size, twin decode-only harnesses with the same seed run in
lockstep (their host sides are deterministic): "steady" as the scheduler runs, "full" with
sched.steady_rows zeroed before every critical pass (the full build, which the kernel runs
whenever the steady path is not set up), and with --plan-ahead the same two with RingConfig(plan_ahead=True).  Every twin has the
CUDA backend's buckets.  Their layouts are checked equal over CHECK_STEPS steps after the warm-up,
then each repetition steps every twin once, in an order rotated by one per repetition, so drift
and cache effects fall on all of them alike.  Each condition (--neighbour: quiet, and busy: one
busy-looping process beside the run, on a shared 2-core VM) measures every size.  JSON:
{"mode": "steady", "machine", "variants", "conditions": [{"neighbour", "neighbour_cpu_share",
"sizes": [{"n_slots", "variants": {name: {"critical": {us_per_step (p50), us_p99, us_mean,
host_accesses_per_step, host_accesses_by_kind}, "overlapped": {...}, "steady_share",
"eligible_share"}}, "ratios": {"full/steady": {"p50", "p99", "paired_p50"}, ...}}]}]}.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
CHECK_STEPS = 20  # lockstep steps whose layouts must match across the twins before measuring
# (name, full build forced, plans published ahead); the first of each pair is the other's baseline
STEADY_VARIANTS = (("steady", False, False), ("full", True, False))
PLAN_VARIANTS = (("steady+plan", False, True), ("full+plan", True, True))
RATIOS = (("full", "steady"), ("full+plan", "steady+plan"), ("steady+plan", "steady"))


def run_before(script: Path, rev: str, args) -> dict:
    """`script` (sched_micro.py), with --whole-step, in a temporary detached worktree of `rev`."""
    tmp = Path(tempfile.mkdtemp(prefix="sched_micro_"))
    tree, out = tmp / "tree", tmp / "before.json"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree), rev], check=True
    )
    try:
        here = (
            tree / "bench" / "lab" if (tree / "bench" / "lab").is_dir() else tree / "bench"
        )  # the lab's move
        shutil.copy(script, here / "sched_micro.py")
        options = {
            "--json": out,
            "--steps": args.steps,
            "--warmup": args.warmup,
            "--seed": args.seed,
            "--scenarios": ",".join(args.scenarios),
            "--sizes": ",".join(map(str, args.sizes)),
        }
        cmd = [sys.executable, str(here / "sched_micro.py"), "--whole-step", "--quiet"]
        cmd += [word for flag, value in options.items() for word in (flag, str(value))]
        subprocess.run(
            cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=True, stdout=subprocess.DEVNULL
        )
        doc = json.loads(out.read_text())
        if Path(doc["machine"]["source_root"]) != tree.resolve():
            raise RuntimeError(f"the --before run imported {doc['machine']['source_root']}, not {tree}")
        doc["rev"] = rev
        return doc
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def _kinds(st) -> str:
    if not st or st.get("host_accesses_by_kind") is None:
        return "-"
    k = st["host_accesses_by_kind"]
    return (
        f"{st['host_accesses_per_step']:.1f} (acq {k['acquire_loads']:.1f} rel {k['release_stores']:.1f} "
        f"fen {k['system_fences']:.1f} ld {k['loads']:.1f} st {k['stores']:.1f})"
    )


def table(after: dict, before: dict | None) -> str:
    old = {(s["name"], s["n_slots"]): s for s in before["scenarios"]} if before else {}
    head = f"{'scenario':16} {'slots':>5} "
    if before:
        head += f"{'before step p50/p99':>20} "
    head += f"{'critical p50/p99':>17} {'overlapped p50/p99':>19} {'exposed p50/p99':>16} {'pass':>4}  host accesses/step: critical | overlapped"
    lines = [
        f"us per step ({after['mode']}"
        + (f"; before = {before.get('rev')}, whole step" if before else "")
        + ")",
        head,
    ]
    for s in after["scenarios"]:
        c, o, e = s["phases"]["critical"], s["phases"]["overlapped"], s["exposed"]
        row = f"{s['name']:16} {s['n_slots']:>5} "
        if before:
            b = old.get((s["name"], s["n_slots"]))
            bc = b["phases"]["critical"] if b else None
            row += f"{bc['us_per_step']:>9.1f}/{bc['us_p99']:<10.1f} " if bc else f"{'-':>20} "
        row += (
            f"{c['us_per_step']:>7.1f}/{c['us_p99']:<9.1f} "
            + (f"{o['us_per_step']:>8.1f}/{o['us_p99']:<10.1f} " if o else f"{'-':>19} ")
            + f"{e['us_per_step']:>6.1f}/{e['us_p99']:<9.1f} {s['passes_per_step']:>4.2f}  "
            + f"{_kinds(c)} | {_kinds(o)}"
        )
        lines.append(row)
    return "\n".join(lines)


# ---------------------------------------------------------------- the null-host check


def null_host_check(args, micro) -> int:
    """Twin harnesses in lockstep; one runs critical on a context without host-only pointers.
    micro: the sched_micro module (passed in: it imports this one)."""
    Harness = micro.Harness
    bad = 0
    for name in args.scenarios:
        for n in args.sizes:
            real = Harness(name, n, seed=args.seed, record_layouts=True)
            blind = Harness(name, n, seed=args.seed, record_layouts=True, null_host_critical=True)
            for _ in range(args.steps):
                real.step()
                blind.step()
            real.check()
            blind.check()
            diff = first_difference(real.layouts, blind.layouts)
            bad += diff is not None
            print(
                f"{name:16} n_slots={n:<4} layouts={len(real.layouts):<5} "
                + ("ok" if diff is None else f"DIFFER: {diff}")
            )
    print("ok" if bad == 0 else f"{bad} runs differ")
    return 0 if bad == 0 else 1


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    if len(a) != len(b):
        return f"{len(a)} layouts built vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        for key in x:
            if not np.array_equal(x[key], y[key]):
                return f"layout {i}: {key}"
    return None


# ---------------------------------------------------------------- --steady


def default_buckets(token_budget: int) -> tuple[int, ...]:
    """device/backends/cuda.default_buckets (whose module needs torch): powers of two, then the budget."""
    from ringleader.ipc import layout

    b, out = 1, []
    while b < token_budget and len(out) < layout.MAX_BUCKETS - 1:
        out.append(b)
        b *= 2
    return (*out, token_budget)


def _cpu_s(pid: int) -> float | None:
    """utime + stime of a process, from /proc (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


@contextmanager
def neighbour(kind: str):
    """quiet: nothing; busy: one busy-looping process beside the measurement (a shared VM's
    other tenant); yields a dict that holds the neighbour's CPU share of the wall time after."""
    if kind not in ("quiet", "busy"):
        raise SystemExit(f"--neighbour: quiet or busy, not {kind!r}")
    info: dict = {"neighbour": kind, "neighbour_cpu_share": None}
    if kind == "quiet":
        yield info
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.3)  # spinning before the first measured step
    t0, cpu0 = time.monotonic(), _cpu_s(proc.pid)
    try:
        yield info
    finally:
        cpu1, wall = _cpu_s(proc.pid), time.monotonic() - t0
        proc.kill()  # the process this function started, by its handle
        proc.wait()
        if cpu0 is not None and cpu1 is not None and wall > 0:
            info["neighbour_cpu_share"] = (cpu1 - cpu0) / wall


def _phase(samples: list[dict], phase: str, micro) -> dict:
    from ringleader.device.sched.build import HOST_ACCESS_KINDS

    st = micro._stats(np.array([s[phase + "_ns"] for s in samples], np.float64))
    mean = np.mean([s[phase] for s in samples], axis=0)
    st["host_accesses_by_kind"] = {k: float(v) for k, v in zip(HOST_ACCESS_KINDS, mean)}
    st["host_accesses_per_step"] = float(mean.sum())
    st["block_barriers_per_step"] = float(np.mean([s[phase + "_barriers"] for s in samples]))
    return st


def measure_steady(n: int, variants, micro, *, steps: int, warmup: int, seed: int) -> dict:
    Harness = micro.Harness
    budget = max(n, 256)  # sched_micro.ring_config's
    ring = {"buckets": default_buckets(budget)}
    twins = {
        name: Harness(
            "decode-only",
            n,
            seed=seed,
            force_full=full,
            ring={**ring, **({"plan_ahead": True} if plan else {})},
        )
        for name, full, plan in variants
    }
    names = list(twins)
    for h in twins.values():
        h.warm_up(warmup)
        h.layouts = []  # recorded for the check only: a snapshot per step would sit between the timed calls
    for _ in range(CHECK_STEPS):
        for h in twins.values():
            h.step()
    base = twins[names[0]].layouts
    differ = {name: first_difference(base, h.layouts) for name, h in twins.items() if name != names[0]}
    for h in twins.values():
        h.layouts = None
    samples: dict[str, list[dict]] = {name: [] for name in names}
    gc.collect()
    gc.disable()  # a collection inside a timed call would be the GC's time, not the scheduler's
    try:
        for i in range(steps):
            k = i % len(names)  # rotated: no twin always runs right after another's cache traffic
            for name in names[k:] + names[:k]:
                samples[name].append(twins[name].step())
    finally:
        gc.enable()
    for h in twins.values():
        h.check()
    out = {"n_slots": n, "token_budget": budget, "layouts_differ": {k: v for k, v in differ.items() if v}}
    out["variants"] = {}
    for name, got in samples.items():
        passes = sum(s["passes"] for s in got)
        out["variants"][name] = {
            "critical": _phase(got, "critical", micro),
            "overlapped": _phase(got, "overlapped", micro),
            "steady_share": sum(s["steady"] for s in got) / passes,
            "eligible_share": sum(s["eligible"] for s in got) / passes,
        }
    out["ratios"] = {}
    for a, b in RATIOS:
        if a in samples and b in samples:
            x = np.array([s["critical_ns"] for s in samples[a]], np.float64)
            y = np.array([s["critical_ns"] for s in samples[b]], np.float64)
            out["ratios"][f"{a}/{b}"] = {
                "p50": float(np.percentile(x, 50) / np.percentile(y, 50)),
                "p99": float(np.percentile(x, 99) / np.percentile(y, 99)),
                "paired_p50": float(np.median(x / y)),  # the same repetition's two calls
            }
    return out


def steady_main(args, micro) -> int:
    """micro: the sched_micro module (passed in: it imports this one)."""
    variants = STEADY_VARIANTS + (PLAN_VARIANTS if args.plan_ahead else ())
    doc = {
        "mode": "steady",
        "scenario": "decode-only",
        "steps": args.steps,
        "warmup": args.warmup,
        "check_steps": CHECK_STEPS,
        "variants": [v[0] for v in variants],
        "machine": micro.machine(),
        "conditions": [],
    }
    for kind in args.neighbour:
        with neighbour(kind) as cond:
            cond["sizes"] = []
            for n in args.sizes:
                cond["sizes"].append(
                    measure_steady(n, variants, micro, steps=args.steps, warmup=args.warmup, seed=args.seed)
                )
                if not args.quiet:
                    print(f"  measured {kind} n_slots={n}", file=sys.stderr, flush=True)
        doc["conditions"].append(cond)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    if not args.quiet:
        print(steady_table(doc))
    bad = [(c["neighbour"], s["n_slots"], s["layouts_differ"]) for c in doc["conditions"] for s in c["sizes"]]
    bad = [b for b in bad if b[2]]
    for b in bad:
        print(f"layouts differ: {b}", file=sys.stderr)
    return 1 if bad else 0


def _pq(st: dict) -> str:
    return f"{st['us_per_step']:.2f}/{st['us_p99']:.2f}"


def steady_table(doc: dict) -> str:
    """One row per condition and size: each variant's critical phase, the ratios, the share of
    passes that took the steady path (steady twin) and that could have (full twin), and host
    accesses per step (critical: the sum over every variant, which must be 0), and the block
    barriers of the critical phase per step (a GPU's __syncthreads; the kernel's warp-0 path for
    steady steps of up to 32 rows has none, which one CPU thread cannot show)."""
    m = doc["machine"]
    flags = " ".join(k for k, on in (m.get("cpu_flags") or {}).items() if on) or "-"
    names = doc["variants"]
    lines = [
        f"critical phase, µs per step p50/p99 ({doc['scenario']}, twins in lockstep, interleaved, "
        f"{doc['steps']} steps); CPU {m['cpu_model']} [{flags}], {m['cpus_usable']} CPUs usable; "
        f"an empty ctypes call {m['ctypes_call_us']:.2f} µs (inside every figure)",
        f"{'neighbour':14} {'slots':>5} "
        + "".join(f"{n:>14}" for n in names)
        + "".join(f"{a + '/' + b:>27}" for a, b in RATIOS if a in names)
        + f"{'steady|eligible':>17} {'host acc. crit|overl.':>22} {'barriers steady|full':>21}",
    ]
    for c in doc["conditions"]:
        share = c.get("neighbour_cpu_share")
        label = c["neighbour"] + (f" ({share:.0%} cpu)" if share is not None else "")
        for s in c["sizes"]:
            v = s["variants"]
            ratios = "".join(f"{r['p50']:>18.2f} ({r['paired_p50']:.2f})" for r in s["ratios"].values())
            crit = sum(v[n]["critical"]["host_accesses_per_step"] for n in names)
            lines.append(
                f"{label:14} {s['n_slots']:>5} "
                + "".join(f"{_pq(v[n]['critical']):>14}" for n in names)
                + ratios
                + f"{v['steady']['steady_share']:>11.2f}|{v['full']['eligible_share']:<5.2f}"
                + f" {crit:>14.0f}|{v['steady']['overlapped']['host_accesses_per_step']:<7.1f}"
                + f" {v['steady']['critical']['block_barriers_per_step']:>13.1f}|"
                + f"{v['full']['critical']['block_barriers_per_step']:<7.1f}"
            )
    lines.append("ratios: of the p50s, and (paired) the median of each repetition's own ratio")
    return "\n".join(lines)
