"""bench/lab/sched_micro.py's report: the table it prints, and --before REV (the same script run in a
temporary git worktree of REV).  Kept apart so the script a --before run copies into an older
tree needs nothing else from this one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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
