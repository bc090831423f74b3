#!/usr/bin/env python3
"""The staged bring-up of the CUDA path on a GPU machine: two runs, value first, then a second
pass of two shorter runs that fits one session's 15 minutes of device time.

    python3 bench/lab/gpu_bringup.py --wheels .whl --out OUT --run A
    python3 bench/lab/gpu_bringup.py --wheels .whl --out OUT --run B --previous A/bringup.json
    python3 bench/lab/gpu_bringup.py --wheels .whl --out OUT --work /tmp/wC --run C   # carry .carry/piece-1
    python3 bench/lab/gpu_bringup.py --wheels .whl --out OUT --work /tmp/wD --run D   # at once; .carry/piece-2

Runs C and D (330 s each: parity on tiny, a transformers-made checkpoint and SmolLM2; device vs
host vs static at 256 streams; CPU interference; transformers' continuous batching; an open-loop
sweep; the gpu_limits probes not yet run) need two calls back to back on one warm machine: the
SmolLM2 GGUF travels half in each (bench/lab/gpu_model_pieces.py), the first half kept in /tmp.

A device call of this workplace runs at most 600 s and brings back at most 8 files, so the
bring-up is two runs (A: env, module, graphs, roofline, the resident backend and the bubble; B:
host and pump backends, perf, the device tests left over, three gpu_limits probes), each with
stage timeouts summing to at most 540 s and a wall-clock budget (`--budget-s`, default 540) that
the runner's own work (wheel install, versions, packing) counts against too: a stage gets
min(its timeout, the budget left) and is skipped as out of time when that is under
min(30 s, its timeout).

Stages run in a fixed order, each in its own process group under a hard kill timeout; a stage
whose `needs` did not pass (in this run, or in the `--previous` run's records) is skipped, every
other stage runs whatever failed before it.  Each stage gets RL_BRINGUP_TIMEOUT_S (the timeout
it was given), RL_BRINGUP_RESULT (where to write its key figures) and the argv placeholders
{py}, {dir} (its working folder) and {run_budget_s} (max(10, timeout - 20): a persistent kernel
the stage leaves behind ends itself before the stage is killed).

Stage working folders live OUTSIDE OUT, in the work folder (`--work`; default OUT's sibling
`<OUT>.work`, or a fresh temp folder when that cannot be made).  After every stage the runner
rewrites OUT/bringup.json (per stage: status, seconds, key figures, the tail of its log; the
versions; what the archive left out), OUT/bringup.log (every log of this run) and
OUT/artifacts.tar.gz (every stage folder of this run, files over 20 MB left out), each written
under a temporary name in the work folder and moved in with os.replace.  So OUT holds at most
those three files at any instant, and a runner killed at the device limit still returns
everything finished before the kill.  (`--pack` is accepted and does nothing: packing always
happens.)

Its first line of output is the versions line (NVRTC, driver, cuda-bindings, torch, triton),
found in a subprocess: this process never imports torch or touches CUDA, so a persistent kernel
that will not stop can hang its own stage's process, never the runner.  Without a GPU it says so
and exits 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds ringleader/
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ringleader.bench.lab.bringup_machine import find_versions, has_gpu, install_wheels, versions_line
from ringleader.bench.lab.bringup_runner import Runner
from ringleader.bench.lab.bringup_stages import (
    RUN_LIMIT_S,
    RUN_LIMITS,
    RUNS,
    list_stages,
    load_stages,
    select,
)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="gpu_bringup.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", help="folder for bringup.json, bringup.log and artifacts.tar.gz (nothing else)")
    p.add_argument("--work", help="folder for the stages' own folders (default: OUT's sibling <OUT>.work)")
    p.add_argument(
        "--run",
        choices=RUNS,
        help="run only this run's stages (A first, then B with --previous; the second pass: C, then D)",
    )
    p.add_argument("--list", action="store_true", help="print the stages (with --run/--only/--skip) and exit")
    p.add_argument("--json", action="store_true", help="with --list: a JSON document")
    p.add_argument("--only", default="", help="comma list of stage names or globs")
    p.add_argument("--skip", default="", help="comma list of stage names or globs to leave out")
    p.add_argument(
        "--previous",
        help="an earlier bringup.json: its records are kept and its passed "
        "stages satisfy `needs` (run B after run A)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        help="this invocation's wall clock, its own work included (default: the run's limit, "
        + ", ".join(f"{r} {v:.0f}" for r, v in RUN_LIMITS.items())
        + f"; {RUN_LIMIT_S:.0f} without --run)",
    )
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every stage's timeout")
    p.add_argument("--wheels", help="install these wheels (pip --no-index --target) for every stage first")
    p.add_argument(
        "--pack", action="store_true", help="accepted, does nothing: OUT is packed after every stage"
    )
    p.add_argument("--stages-file", help=argparse.SUPPRESS)  # a JSON stage table (tests, custom runs)
    return p.parse_args(argv)


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def work_folder(out: Path, asked: str | None) -> Path:
    if asked:
        work = Path(asked).resolve()
        work.mkdir(parents=True, exist_ok=True)
        return work
    try:
        work = out.parent / f"{out.name}.work"
        work.mkdir(parents=True, exist_ok=True)
        return work
    except OSError:
        return Path(tempfile.mkdtemp(prefix="ringleader-bringup-"))


def main(argv=None) -> int:
    started = time.monotonic()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.budget_s is None:
        args.budget_s = RUN_LIMITS.get(args.run, RUN_LIMIT_S)
    stages = load_stages(args.stages_file)
    chosen = select(stages, args.run, names(args.only), names(args.skip))
    if args.list:
        list_stages(chosen, args.json)
        return 0
    if not args.out:
        print("gpu_bringup.py: --out DIR is required (or --list)", file=sys.stderr)
        return 2
    if not has_gpu():
        print(
            "gpu_bringup.py: no CUDA GPU here (nvidia-smi finds none); the bring-up needs an "
            "H100/H200. `python3 bench/lab/gpu_bringup.py --list` shows its stages."
        )
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = work_folder(out, args.work)
    previous = json.loads(Path(args.previous).read_text())["stages"] if args.previous else []
    pythonpath, wheel_failure = install_wheels(args.wheels) if args.wheels else ([], None)
    runner = Runner(
        out,
        work,
        chosen,
        budget_s=args.budget_s,
        timeout_scale=args.timeout_scale,
        previous=previous,
        pythonpath=pythonpath,
        argv=sys.argv[1:] if argv is None else list(argv),
        started=started,
        run=args.run,
    )
    runner.versions = find_versions(runner.env({}))
    print(versions_line(runner.versions), flush=True)
    if wheel_failure is not None:
        runner.announce(wheel_failure)
        runner.results.append(wheel_failure)
    if args.run == "B" and not args.previous:
        print("note: --run B without --previous: stages that need run A's stages will be skipped")
    print(f"=== work folder {work}; OUT {out}; budget {args.budget_s:.0f} s", flush=True)

    def on_signal(signum, _frame):
        runner.interrupt()
        sys.exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return runner.run()


if __name__ == "__main__":
    sys.exit(main())
