"""The CLI: ``python -m ringleader.bench.lab.gpu_limits [--quick] [--only 1,3] [--compile-only] ...`` (see the
package docstring); the run loop gives each probe its own thread, timeout and health check."""

from __future__ import annotations

import argparse
import atexit
import datetime as _dt
import faulthandler
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import ringleader.bench.lab.gpu_limits as gpu_limits
from ringleader.bench.lab.gpu_limits.blocking import exit_child, probe_blocking
from ringleader.bench.lab.gpu_limits.common import (
    DEFAULT_OUT,
    PROBE_NAMES,
    RUN_ORDER,
    SCHEMA,
    TORCH_PROBES,
    Budget,
    device_slug,
    shutdown_all,
)
from ringleader.bench.lab.gpu_limits.device import (
    Probe,
    health_check,
    init_torch,
    run_in_thread,
    try_init_device,
)
from ringleader.bench.lab.gpu_limits.devlaunch import probe_devlaunch
from ringleader.bench.lab.gpu_limits.doorbell import probe_doorbell
from ringleader.bench.lab.gpu_limits.graphpair import probe_graphpair
from ringleader.bench.lab.gpu_limits.handoff import probe_handoff
from ringleader.bench.lab.gpu_limits.kernels import (
    COMPILE_TAG,
    compile_all,
    compile_summary,
    nvrtc_version,
    print_kernel_table,
)
from ringleader.bench.lab.gpu_limits.launch import probe_launch
from ringleader.bench.lab.gpu_limits.memops import probe_memops
from ringleader.bench.lab.gpu_limits.report import (
    fmt,
    install_tee,
    json_default,
    open_log,
    print_table,
    save_json,
)
from ringleader.bench.lab.gpu_limits.roofline import probe_roofline
from ringleader.bench.lab.gpu_limits.stepwhile import probe_stepwhile
from ringleader.bench.lab.gpu_limits.torchgraph import probe_torchgraph

HERE = Path(__file__).resolve().parent

PROBE_FUNCS = {
    1: probe_doorbell,
    2: probe_handoff,
    3: probe_launch,
    4: probe_torchgraph,
    5: probe_blocking,
    6: probe_roofline,
    7: probe_memops,
    8: probe_devlaunch,
    9: probe_graphpair,
    10: probe_stepwhile,
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m ringleader.bench.lab.gpu_limits",
        description=gpu_limits.__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--only", default="", help="comma-separated probe numbers (1-10) to run")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="compile every kernel with NVRTC (sm_90 unless --arch), print resources, exit",
    )
    ap.add_argument("--arch", default=None, help="override the target arch, e.g. sm_90")
    ap.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    ap.add_argument("--step-model", default="llama-1b", help="probe 10's model preset (its 1-row step graph)")
    ap.add_argument("--out-dir", default=str(DEFAULT_OUT), help="where the JSON and log go")
    ap.add_argument("--no-save", action="store_true", help="print only; write no files")
    ap.add_argument(
        "--max-seconds", type=float, default=None, help="whole-run watchdog (default 330, quick 240)"
    )
    ap.add_argument("--_exit-child", dest="_exit_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_child-budget-s", dest="_child_budget_s", default="10", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sel = set()
    for part in [p for p in args.only.replace(" ", "").split(",") if p]:
        if "-" in part:
            a, b = part.split("-", 1)
            sel.update(range(int(a), int(b) + 1))
        else:
            sel.add(int(part))
    bad = sel - set(PROBE_NAMES)
    if bad:
        ap.error(f"unknown probe number(s) {sorted(bad)}; probes are {sorted(PROBE_NAMES)}")
    args.selected = [n for n in RUN_ORDER if n in sel] if sel else list(RUN_ORDER)
    return args


def _versions() -> dict:
    v = {"python": platform.python_version(), "numpy": np.__version__, "nvrtc": nvrtc_version()}
    try:
        from cuda.bindings import __version__ as cbv

        v["cuda_bindings"] = cbv
    except Exception:
        try:
            import cuda  # noqa: F401

            v["cuda_bindings"] = getattr(sys.modules.get("cuda"), "__version__", "unknown")
        except Exception:
            v["cuda_bindings"] = "unknown"
    return v


def _git_rev() -> str | None:
    try:
        r = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return r.stdout.strip() or None
    except Exception:
        return None


def run_compile_only(arch: str, reason: str | None) -> int:
    groups = compile_all(arch)
    summary = compile_summary(groups, arch)
    print_kernel_table(summary)
    for g in groups.values():
        if g["error"]:
            print(f"\n--- NVRTC log for group {g['group']} ---\n{g['log'] or g['error']}")
    line = {k: v for k, v in summary.items() if k != "groups"}
    line["groups"] = {g: {"ok": v["ok"], "error": v["error"]} for g, v in summary["groups"].items()}
    print(f"{COMPILE_TAG} " + json.dumps(line, default=json_default), flush=True)
    n, m = summary["n_compiled"], summary["n_expected"]
    if reason is not None:
        print(f"no CUDA device: compiled {n} kernels for {arch}; measurements need an H100/H200 ({reason})")
    else:
        print(f"compile-only: compiled {n} of {m} kernels for {arch}; no measurements run")
    return 0 if summary["ok"] else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._exit_child:
        return exit_child(args)
    install_tee()
    t_start = time.monotonic()
    print(
        f"gpu_limits: {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} "
        f"python {platform.python_version()} nvrtc {nvrtc_version()}",
        flush=True,
    )
    if args.compile_only:
        return run_compile_only(args.arch or "sm_90", None)
    dev, why = try_init_device(args.device)
    if dev is None:
        return run_compile_only(args.arch or "sm_90", why)

    scale = float(os.environ.get("GPU_LIMITS_TIMEOUT_SCALE", "1") or 1)
    B = Budget(args.quick, scale)
    arch = args.arch or dev.arch
    print(
        f"device {args.device}: {dev.name} (cc {dev.props['compute_capability']}, "
        f"{dev.props['multiprocessors']} SMs), driver {dev.driver_version}, arch {arch}",
        flush=True,
    )
    slug = device_slug(dev.name)
    date = _dt.date.today().isoformat()
    suffix = ("-quick" if args.quick else "") + (
        "-only-" + "-".join(map(str, sorted(args.selected))) if len(args.selected) < len(PROBE_NAMES) else ""
    )
    json_path = log_path = None
    if not args.no_save:
        outdir = Path(args.out_dir)
        outdir.mkdir(parents=True, exist_ok=True)
        base = f"{date}-{slug}-gpu-limits{suffix}"
        json_path = outdir / f"{base}.json"
        log_path = outdir / f"{base}.log"
        open_log(log_path)
        print(f"writing {json_path} and {log_path.name}", flush=True)

    results: dict = {
        "schema": SCHEMA,
        "meta": {
            "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "device": dev.props,
            "device_slug": slug,
            "arch": arch,
            "versions": _versions(),
            "git": _git_rev(),
            "argv": sys.argv[1:],
            "quick": args.quick,
            "selected": args.selected,
            "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        },
        "kernels": {},
        "probes": {},
    }
    # watchdogs: a clean one that saves what there is, and faulthandler behind it
    max_s = args.max_seconds or B.total_s
    current = {"probe": None}
    done_evt = threading.Event()

    def on_watchdog():
        if done_evt.wait(max_s):
            return
        print(
            f"\n!! WATCHDOG: run exceeded {max_s:.0f} s during probe {current['probe']}; shutting down",
            flush=True,
        )
        shutdown_all()
        results["watchdog"] = {"fired_after_s": max_s, "probe": current["probe"]}
        if current["probe"]:
            key = current["probe"]
            results["probes"].setdefault(key, {"status": "timeout", "where": "whole-run watchdog"})
        try:
            print_table(results)
            save_json(json_path, results)
        finally:
            sys.stdout.flush()
            os._exit(2)

    threading.Thread(target=on_watchdog, daemon=True, name="watchdog").start()
    faulthandler.dump_traceback_later(max_s + 60, exit=True)
    atexit.register(shutdown_all)

    def _on_signal(signum, _frame):
        shutdown_all()
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(sig, _on_signal)
        except Exception:
            pass

    groups = compile_all(arch)
    summary = compile_summary(groups, arch)
    torch_mod, torch_err = (None, "not needed by the selected probes")
    if TORCH_PROBES & set(args.selected):
        torch_mod, torch_err = init_torch(args.device, dev)
        print(f"torch: {torch_mod.__version__ if torch_mod else torch_err}", flush=True)
        if torch_mod is not None:
            results["meta"]["versions"]["torch"] = torch_mod.__version__
    P = Probe(dev, args, B, groups, torch_mod, torch_err)
    P.load_modules()
    for k, a in P.func_attrs.items():
        summary["kernels"].setdefault(k, {})["driver_attributes"] = a
    for k, e in P.func_err.items():
        summary["kernels"].setdefault(k, {})["load_error"] = e
    results["kernels"] = summary
    print_kernel_table(summary, P.func_attrs)
    for k, e in P.func_err.items():
        print(f"  {k}: {e.splitlines()[0][:160]}")
    save_json(json_path, results)

    for num in args.selected:
        key = f"{num}_{PROBE_NAMES[num]}"
        current["probe"] = key
        print(f"\n== probe {num} {PROBE_NAMES[num]} ==", flush=True)
        if P.context_dead:
            results["probes"][key] = {"status": "skipped", "reason": f"context unusable: {P.context_dead}"}
            print(f"  skipped: {P.context_dead}")
            continue
        t0 = time.monotonic()
        timeout = B.t(B.probe_timeout[num])
        rec, th, box = run_in_thread(
            lambda n=num: PROBE_FUNCS[n](P), timeout, P.thread_init, name=f"probe{num}"
        )
        if rec["status"] == "blocked":
            shutdown_all()
            th.join(B.t(10))
            res = {"status": "timeout", "timeout_s": timeout, "finished_after_shutdown": not th.is_alive()}
            if th.is_alive():
                P.taint(f"probe {num} thread stuck after timeout")
            elif isinstance(box.get("value"), dict):
                res["late_result"] = box["value"]
        elif rec["status"] == "error":
            res = {"status": "error", "error": rec.get("error"), "traceback": rec.get("traceback")}
            if str(rec.get("error", "")).startswith("SkipProbe"):
                res = {"status": "skipped", "reason": rec["error"].split(": ", 1)[-1]}
        else:
            res = rec.get("result") or {"status": "error", "error": "probe returned nothing"}
        res["elapsed_s"] = round(time.monotonic() - t0, 2)
        results["probes"][key] = res
        print(
            f"  -> {res.get('status')} in {res['elapsed_s']} s"
            + (
                f": {res.get('error') or res.get('reason')}"
                if res.get("status") in ("error", "skipped")
                else ""
            ),
            flush=True,
        )
        for r in res.get("table") or []:
            print(f"     {r[0]}: {fmt(r[1])} / p99 {fmt(r[2])} {r[3]}  {r[4]}")
        if not P.tainted:
            bad = health_check(P)
            if bad:
                P.context_dead = bad
                results["context_dead"] = bad
                print(f"  !! {bad}; remaining probes are skipped", flush=True)
        save_json(json_path, results)

    current["probe"] = None
    results["meta"]["tainted"] = P.tainted
    results["meta"]["elapsed_s"] = round(time.monotonic() - t_start, 1)
    print_table(results)
    print(f"\ntotal {results['meta']['elapsed_s']} s" + (f"; TAINTED: {P.tainted}" if P.tainted else ""))
    if json_path:
        print(f"results: {json_path}\nlog:     {log_path}")
    save_json(json_path, results)
    done_evt.set()
    faulthandler.cancel_dump_traceback_later()
    shutdown_all()
    sys.stdout.flush()
    if P.tainted:
        # a kernel may still run: do not risk the exit path waiting on it
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
