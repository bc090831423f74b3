#!/usr/bin/env python3
"""The staged bring-up of the CUDA path on a GPU machine, in one command.

    python3 bench/gpu_bringup.py --wheels .whl --out OUT --pack

Stages run in a fixed order (cheapest and most basic first, as the static review of the CUDA
path advised), each in its own process group under a hard kill timeout; a stage whose `needs`
did not pass is skipped, every other stage runs whatever failed before it.  OUT/bringup.json (per stage: status, seconds, key
figures, the tail of its log) and OUT/bringup.log (every log in full) are rewritten after each
stage, so a run cut short keeps what it learned.

This process never imports torch or touches CUDA: a persistent kernel that will not stop can
hang its own stage's process, never the runner.  Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import glob
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "ringleader.bringup/1"
EAGER = {"CUDA_MODULE_LOADING": "EAGER"}  # no lazy loading beside a spinning kernel on a first run
TEST_FILES = "tests/test_gpu_*.py"
LOG_TAIL = 4000


@dataclass
class Stage:
    name: str
    argv: list[str]
    timeout: float
    needs: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)


@dataclass
class StageResult:
    name: str
    status: str  # passed | failed | timeout | skipped | killed
    seconds: float = 0.0
    returncode: int | None = None
    command: str = ""
    needs: tuple[str, ...] = ()
    reason: str | None = None
    figures: dict | None = None
    log_tail: str = ""


def builtin_stages() -> list[Stage]:
    checks = ["{py}", "-m", "bench.bringup_checks"]
    return [
        Stage("env", ["{py}", "-m", "hostctl.cli", "doctor", "--json", "{dir}/doctor.json"], 180),
        Stage("probe", ["{py}", "-m", "bench.gpu_limits", "--quick", "--out-dir", "{dir}"], 420),
        Stage("module", checks + ["module"], 120, env=EAGER),
        Stage("graphs-fp32", checks + ["graphs", "--dtype", "float32"], 300, env=EAGER),
        Stage("graphs-bf16", checks + ["graphs", "--dtype", "bfloat16"], 300, env=EAGER),
        # llama-1b bf16 decode steps (1 and 32 rows) against the memory roofline
        Stage(
            "roofline",
            ["{py}", "-m", "bench.roofline", "--model", "llama-1b", "--rows", "1,32", "--ctx", "512"]
            + ["--json", "{dir}/result.json"],
            300,
            ("graphs-bf16",),
            EAGER,
        ),
        Stage("backend-host", checks + ["backend", "--scheduler", "host"], 240, ("graphs-fp32",), EAGER),
        Stage(
            "backend-resident",
            checks + ["backend", "--scheduler", "device", "--launch", "resident"],
            240,
            ("module", "graphs-fp32"),
            EAGER,
        ),
        Stage(
            "backend-pump",
            checks + ["backend", "--scheduler", "device", "--launch", "pump"],
            240,
            ("module", "graphs-fp32"),
            EAGER,
        ),
        Stage("tests", [], 240, ("graphs-fp32",)),  # expands into one stage per GPU test
        # the bubble at 1 and 64 streams, resident mode, each with its raw device timeline
        *(
            Stage(
                f"bubble-c{c}",
                [
                    "{py}",
                    "-m",
                    "hostctl.cli",
                    "bench",
                    "--device",
                    "cuda",
                    "--model",
                    "llama-1b",
                    "--compare",
                    "device",
                    "--launch",
                    "resident",
                    "--concurrency",
                    str(c),
                    "--requests",
                    str(n),
                    "--input-len",
                    "128",
                    "--output-len",
                    "128",
                    "--ignore-eos",
                    "--no-plots",
                    "--server-arg=--trace",
                    "--server-arg={dir}/device-trace.json",
                    "--out",
                    "{dir}",
                ],
                300,
                ("backend-resident",),
            )
            for c, n in ((1, 16), (64, 128))
        ),
        Stage(
            "perf",
            [
                "{py}",
                "-m",
                "hostctl.cli",
                "bench",
                "--device",
                "cuda",
                "--model",
                "llama-1b",
                "--compare",
                "device,host",
                "--concurrency",
                "1,32",
                "--requests",
                "64",
                "--input-len",
                "128",
                "--output-len",
                "128",
                "--ignore-eos",
                "--no-plots",
                "--out",
                "{dir}",
            ],
            540,
            ("backend-host", "backend-resident"),
        ),
    ]


def load_stages(path: str | None) -> list[Stage]:
    if path is None:
        return builtin_stages()
    rows = json.loads(Path(path).read_text())
    return [
        Stage(
            r["name"], list(r["argv"]), float(r["timeout"]), tuple(r.get("needs", ())), dict(r.get("env", {}))
        )
        for r in rows
    ]


def select(stages: list[Stage], only: list[str], skip: list[str]) -> list[Stage]:
    def hit(name, patterns):  # "tests*" also selects the tests::<node> stages it expands into
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    return [s for s in stages if (not only or hit(s.name, only)) and not hit(s.name, skip)]


def has_gpu() -> bool:
    if os.environ.get("RL_BRINGUP_ASSUME_GPU") == "1":
        return True
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and "GPU" in r.stdout


def git_rev() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


# ---- figures a stage leaves behind -------------------------------------------------------------
def probe_figures(stage_dir: Path) -> dict | None:
    """Per-probe status from the gpu_limits JSON the probe stage wrote."""
    files = sorted(glob.glob(str(stage_dir / "*gpu-limits*.json")))
    if not files:
        return None
    try:
        doc = json.loads(Path(files[-1]).read_text())
    except (OSError, ValueError):
        return None
    probes = doc.get("probes") if isinstance(doc, dict) else None
    if isinstance(probes, dict):
        return {str(k): (v.get("status") if isinstance(v, dict) else v) for k, v in probes.items()}
    return {"keys": sorted(doc)[:20]} if isinstance(doc, dict) else None


def perf_figures(stage_dir: Path) -> dict | None:
    try:
        doc = json.loads((stage_dir / "results.json").read_text())
    except (OSError, ValueError):
        return None
    out = {}
    for run in doc.get("runs", []) if isinstance(doc, dict) else []:
        key = f"{run.get('scheduler')} c={run.get('concurrency')} rate={run.get('request_rate')}"
        out[key] = {
            k: run.get(k) for k in ("output_tokens_per_s", "cpu_s_per_1k_tokens", "completed", "failed")
        }
        out[key]["tpot_ms_p50"] = (run.get("tpot_ms") or {}).get("p50")
        out[key]["launch"] = (run.get("backend") or {}).get("launch")
        dev = run.get("device_stats") or {}
        out[key].update(
            {
                k: dev.get(k)
                for k in (
                    "bubble_us_p50",
                    "bubble_us_p99",
                    "bubble_gaps",
                    "idle_gaps",
                    "handoff_us_p50",
                    "launch_us_p50",
                    "device_sched_us_p50",
                    "device_overlap_us_p50",
                    "overlap_overruns",
                    "step_us_p50",
                )
                if k in dev
            }
        )
    return out or None


def stage_figures(stage: Stage, stage_dir: Path, log_tail: str) -> dict | None:
    result = stage_dir / "result.json"
    if result.exists():
        try:
            doc = json.loads(result.read_text())
            if isinstance(doc, dict):
                return doc
        except ValueError:
            pass
    if stage.name == "probe":
        return probe_figures(stage_dir)
    if stage.name == "perf" or stage.name.startswith("bubble-"):
        return perf_figures(stage_dir)
    if stage.name.startswith("tests::"):
        lines = [ln for ln in log_tail.splitlines() if ln.strip()]
        return {"outcome": lines[-1] if lines else ""}
    return None


# ---- the runner ------------------------------------------------------------------------------
class Runner:
    def __init__(
        self,
        out: Path,
        stages: list[Stage],
        *,
        budget_s: float,
        timeout_scale: float,
        previous: list[dict],
        pythonpath: list[str],
        argv: list[str],
    ):
        self.out, self.stages = out, stages
        self.budget_s, self.scale = budget_s, timeout_scale
        self.started = time.monotonic()
        self.started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        self.previous = {r["name"]: r for r in previous}
        self.results: list[StageResult] = []
        self.pythonpath = pythonpath
        self.argv = argv
        self.current: subprocess.Popen | None = None

    # which stages passed, counting an earlier call's records (--previous)
    def passed(self, name: str) -> bool:
        mine = [r for r in self.results if r.name == name]
        if mine:
            return mine[-1].status == "passed"
        return self.previous.get(name, {}).get("status") == "passed"

    def run(self) -> int:
        for stage in self.stages:
            for s in self.expand_tests(stage) if stage.name == "tests" and not stage.argv else [stage]:
                self.results.append(self.run_stage(s))
                self.write()
        self.write()
        print_table(self.results)
        bad = [r for r in self.results if r.status != "passed"]
        return 1 if bad else 0

    def expand_tests(self, stage: Stage) -> list[Stage]:
        files = sorted(str(Path(p).relative_to(REPO)) for p in glob.glob(str(REPO / TEST_FILES)))
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
        try:
            r = subprocess.run(cmd, cwd=REPO, env=self.env({}), capture_output=True, text=True, timeout=120)
            nodes = [ln.strip() for ln in r.stdout.splitlines() if "::" in ln and not ln.startswith(" ")]
        except subprocess.TimeoutExpired:
            nodes = []
        if not nodes:
            return [
                Stage(
                    "tests",
                    [sys.executable, "-m", "pytest", "-q", *files],
                    stage.timeout * 4,
                    stage.needs,
                    stage.env,
                )
            ]
        return [
            Stage(
                f"tests::{n}",
                ["{py}", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", n],
                stage.timeout,
                stage.needs,
                stage.env,
            )
            for n in nodes
        ]

    def env(self, extra: dict, result_path: Path | None = None) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
        env["PYTHONPATH"] = os.pathsep.join(
            self.pythonpath + [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        if result_path is not None:
            env["RL_BRINGUP_RESULT"] = str(result_path)
        return env

    def run_stage(self, stage: Stage) -> StageResult:
        stage_dir = self.out / safe_name(stage.name)
        argv = [a.replace("{py}", sys.executable).replace("{dir}", str(stage_dir)) for a in stage.argv]
        res = StageResult(stage.name, "skipped", command=shlex.join(argv), needs=stage.needs)
        missing = [n for n in stage.needs if not self.passed(n)]
        if missing:
            res.reason = "needs " + ", ".join(missing) + ", which did not pass"
            return self.announce(res)
        left = self.budget_s - (time.monotonic() - self.started)
        timeout = min(stage.timeout * self.scale, left)
        if timeout < min(30.0, stage.timeout * self.scale):
            res.reason = f"out of time: {max(0.0, left):.0f} s of the run's budget left"
            return self.announce(res)
        stage_dir.mkdir(parents=True, exist_ok=True)
        log_path = stage_dir / "stage.log"
        print(f"=== {stage.name}: {res.command} (timeout {timeout:.0f} s)", flush=True)
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=self.env(stage.env, stage_dir / "result.json"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                text=True,
                errors="replace",
            )
            self.current = proc
            tee = threading.Thread(target=copy_lines, args=(proc.stdout, log, stage.name), daemon=True)
            tee.start()
            try:
                res.returncode = proc.wait(timeout=timeout)
                res.status = "passed" if res.returncode == 0 else "failed"
                if res.returncode != 0:
                    res.reason = f"exit code {res.returncode}"
            except subprocess.TimeoutExpired:
                kill_group(proc)
                res.status, res.reason = "timeout", f"killed after {timeout:.0f} s"
            finally:
                self.current = None
            tee.join(timeout=10)
        res.seconds = round(time.monotonic() - t0, 2)
        res.log_tail = log_path.read_text(errors="replace")[-LOG_TAIL:]
        res.figures = stage_figures(stage, stage_dir, res.log_tail)
        return self.announce(res)

    def announce(self, res: StageResult) -> StageResult:
        print(
            f"=== {res.name}: {res.status} in {res.seconds:.1f} s"
            + (f" ({res.reason})" if res.reason else ""),
            flush=True,
        )
        return res

    def interrupt(self) -> None:
        """SIGINT/SIGTERM: kill the running stage's group, record it, write what there is."""
        proc = self.current
        if proc is not None:
            kill_group(proc)
        self.results.append(StageResult("interrupted", "killed", reason="the runner was signalled"))
        self.write()

    def write(self) -> None:
        mine = {r.name for r in self.results}
        carried = [r for n, r in self.previous.items() if n not in mine]
        stages = carried + [asdict(r) for r in self.results]
        summary = {
            k: sum(1 for s in stages if s["status"] == k)
            for k in ("passed", "failed", "timeout", "skipped", "killed")
        }
        doc = {
            "schema": SCHEMA,
            "started": self.started_at,
            "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.monotonic() - self.started, 1),
            "host": {
                "node": platform.node(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "git_rev": git_rev(),
            "argv": self.argv,
            "stages": stages,
            "summary": summary,
        }
        tmp = self.out / "bringup.json.tmp"
        tmp.write_text(json.dumps(doc, indent=2, default=str))
        tmp.replace(self.out / "bringup.json")
        with open(self.out / "bringup.log", "w") as f:
            for r in self.results:
                f.write(
                    f"\n##### {r.name}: {r.status} in {r.seconds:.1f} s"
                    + (f" ({r.reason})" if r.reason else "")
                    + f"\n##### $ {r.command}\n"
                )
                log = self.out / safe_name(r.name) / "stage.log"
                if log.exists():
                    f.write(log.read_text(errors="replace"))


def safe_name(name: str) -> str:
    """A folder name the device tool brings back: letters, digits, '.', '_' and '-' only."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:120]


def copy_lines(stream, log, prefix: str) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        sys.stdout.write(f"[{prefix}] {line}")
    sys.stdout.flush()


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the stage and everything it started
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def install_wheels(wheel_dir: str) -> tuple[list[str], StageResult | None]:
    site = Path(tempfile.gettempdir()) / "ringleader-bringup-site"
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(site),
        *wheels,
    ]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True) if wheels else None
    if r is None or r.returncode != 0:
        why = f"no wheels in {wheel_dir}" if r is None else f"pip exit code {r.returncode}"
        return [], StageResult(
            "wheels",
            "failed",
            round(time.monotonic() - t0, 2),
            None if r is None else r.returncode,
            shlex.join(cmd),
            reason=why,
            log_tail="" if r is None else (r.stdout + r.stderr)[-LOG_TAIL:],
        )
    return [str(site)], None


def print_table(results: list[StageResult]) -> None:
    print("\nstage                                              status    seconds  reason")
    for r in results:
        print(f"{r.name[:50]:<50} {r.status:<9} {r.seconds:>7.1f}  {r.reason or ''}")


def list_stages(stages: list[Stage]) -> None:
    print(f"{'stage':<18} {'timeout':>7}  {'needs':<28} command")
    for s in stages:
        cmd = shlex.join(s.argv) if s.argv else f"one pytest process per test of {TEST_FILES}"
        env = " ".join(f"{k}={v}" for k, v in s.env.items())
        print(
            f"{s.name:<18} {s.timeout:>6.0f}s  {','.join(s.needs) or '-':<28} {(env + ' ') if env else ''}{cmd}"
        )


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="gpu_bringup.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", help="folder for bringup.json, bringup.log and each stage's files")
    p.add_argument("--list", action="store_true", help="print the stages and exit")
    p.add_argument("--only", default="", help="comma list of stage names or globs (tests* for the GPU tests)")
    p.add_argument("--skip", default="", help="comma list of stage names or globs to leave out")
    p.add_argument(
        "--previous",
        help="an earlier bringup.json: its records are kept and its passed "
        "stages satisfy `needs` (a bring-up split across device calls)",
    )
    p.add_argument("--budget-s", type=float, default=1500.0, help="whole-run wall clock (default 1500)")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every stage's timeout")
    p.add_argument("--wheels", help="install these wheels (pip --no-index --target) for every stage first")
    p.add_argument("--pack", action="store_true", help="pack the stage folders into artifacts.tar.gz")
    p.add_argument("--stages-file", help=argparse.SUPPRESS)  # a JSON stage table (tests, custom runs)
    return p.parse_args(argv)


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def pack(out: Path, results: list[StageResult]) -> None:
    with tarfile.open(out / "artifacts.tar.gz", "w:gz") as tar:
        for r in results:
            d = out / safe_name(r.name)
            if d.is_dir():
                tar.add(d, arcname=d.name)
    for r in results:
        d = out / safe_name(r.name)
        if d.is_dir():
            for f in sorted(d.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
            d.rmdir()


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    stages = load_stages(args.stages_file)
    if args.list:
        list_stages(stages)
        return 0
    if not args.out:
        print("gpu_bringup.py: --out DIR is required (or --list)", file=sys.stderr)
        return 2
    if not has_gpu():
        print(
            "gpu_bringup.py: no CUDA GPU here (nvidia-smi finds none); the bring-up needs an "
            "H100/H200. `python3 bench/gpu_bringup.py --list` shows its stages."
        )
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    previous = json.loads(Path(args.previous).read_text())["stages"] if args.previous else []
    pythonpath, wheel_failure = install_wheels(args.wheels) if args.wheels else ([], None)
    runner = Runner(
        out,
        select(stages, names(args.only), names(args.skip)),
        budget_s=args.budget_s,
        timeout_scale=args.timeout_scale,
        previous=previous,
        pythonpath=pythonpath,
        argv=sys.argv[1:] if argv is None else list(argv),
    )
    if wheel_failure is not None:
        runner.results.append(wheel_failure)

    def on_signal(signum, _frame):
        runner.interrupt()
        sys.exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    code = runner.run()
    if args.pack:
        pack(out, runner.results)
    return code


if __name__ == "__main__":
    sys.exit(main())
