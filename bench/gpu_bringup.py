#!/usr/bin/env python3
"""The staged bring-up of the CUDA path on a GPU machine: two runs, value first, then a second
pass of two shorter runs that fits one session's 15 minutes of device time.

    python3 bench/gpu_bringup.py --wheels .whl --out OUT --run A
    python3 bench/gpu_bringup.py --wheels .whl --out OUT --run B --previous A/bringup.json
    python3 bench/gpu_bringup.py --wheels .whl --out OUT --work /tmp/wC --run C   # carry .carry/piece-1
    python3 bench/gpu_bringup.py --wheels .whl --out OUT --work /tmp/wD --run D   # at once; .carry/piece-2

Runs C and D (330 s each: parity on tiny, a transformers-made checkpoint and SmolLM2; device vs
host vs static at 256 streams; CPU interference; transformers' continuous batching; an open-loop
sweep; the gpu_limits probes not yet run) need two calls back to back on one warm machine: the
SmolLM2 GGUF travels half in each (bench/gpu_model_pieces.py), the first half kept in /tmp.

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
import datetime as dt
import fnmatch
import glob
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "ringleader.bringup/1"
# No lazy module loading beside a spinning kernel on a first run, and 32 hardware queues so no
# stream lands behind the never-ending persistent-kernel launch.
DEVICE_ENV = {"CUDA_MODULE_LOADING": "EAGER", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}
RUNS = ("A", "B", "C", "D")
RUN_LIMIT_S = 540.0  # each run's stage timeouts sum to at most this (a device call: 600 s)
# The second pass (C, D) fits a session's 15 minutes of device time: two calls back to back on one
# warm machine, the SmolLM2 GGUF carried half in each (bench/gpu_model_pieces.py).
RUN_LIMITS = {"A": RUN_LIMIT_S, "B": RUN_LIMIT_S, "C": 330.0, "D": 330.0}
CARRY_STASH = "/tmp/ringleader-carry"  # outside the working tree: kept from call C to call D
CARRY_MODELS = "/tmp/ringleader-models"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOG_TAIL = 4000
LOG_IN_FULL = 2_000_000  # characters of one stage's log in bringup.log (head and tail kept)
TAR_FILE_LIMIT = 20_000_000  # bytes: a bigger file stays out of artifacts.tar.gz
TAR_LIMIT = 15 * 2**20  # bytes: the device tool brings back files of up to 16 MiB
VERSIONS_TIMEOUT_S = 30.0

# The tests stage: the GPU-only tests no other stage already runs, in one pytest process.
# The cudaFree test comes last: cudaFree waits beside a persistent kernel (seen on the H100),
# and should the server's stop not release it, pytest-timeout ends the process there.
TESTS_STAGE_NODES = (
    "tests/test_gguf_quants.py::test_cuda_decode_matches_reference_bitwise",
    "tests/test_gpu_backend.py::test_gpu_256_streams_each_get_one_done",
    "tests/test_gpu_backend.py::test_gpu_allocation_while_the_kernel_runs",
    "tests/test_gpu_backend.py::test_gpu_kernel_that_ends_on_its_own_becomes_engine_dead",
    "tests/test_gpu_backend.py::test_gpu_abort_and_shutdown_in_flight",
    "tests/test_gpu_backend.py::test_gpu_free_while_the_kernel_runs_waits_and_stop_releases_it",
)
# Every other GPU-only test, and the stage that covers what it checks (a CPU test holds this
# table and TESTS_STAGE_NODES against the GPU-only tests pytest collects).
COVERED_BY_STAGE = {
    "tests/test_gpu_graphs.py::test_the_scheduler_module_loads_with_every_kernel": "module",
    "tests/test_gpu_graphs.py::test_captured_graphs_match_the_eager_step[float32]": "graphs-fp32",
    "tests/test_gpu_graphs.py::test_captured_graphs_match_the_eager_step[bfloat16]": "graphs-bf16",
    "tests/test_gpu_backend.py::test_gpu_mode_parity_timeline_and_stop[device-resident]": "backend-resident",
    "tests/test_gpu_backend.py::test_gpu_mode_parity_timeline_and_stop[device-pump]": "backend-pump",
    "tests/test_gpu_backend.py::test_gpu_mode_parity_timeline_and_stop[host-loop]": "backend-host",
    "tests/test_gpu_limits_build.py::test_quick_probe_on_gpu": "gpu-limits",
}


@dataclass
class Stage:
    name: str
    argv: list[str]
    timeout_s: float
    needs: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    run: str = "A"


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
    run: str | None = None
    timeout_s: float | None = None  # the timeout it was given (the budget may cut it)


def tests_stage_argv() -> list[str]:
    argv = ["{py}", "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "--junitxml", "{dir}/junit.xml"]
    if importlib.util.find_spec("pytest_timeout") is not None:  # on the GPU image; maybe not here
        argv += ["--timeout", "45", "--timeout-method", "thread"]  # a stuck CUDA call ends the process
    return argv + list(TESTS_STAGE_NODES)


def builtin_stages() -> list[Stage]:
    checks = ["{py}", "-m", "bench.bringup_checks"]
    budget = ["--server-arg=--run-budget-s", "--server-arg={run_budget_s}"]
    bench = ["{py}", "-m", "hostctl.cli", "bench", "--device", "cuda", "--model", "llama-1b"]
    lengths = ["--input-len", "128", "--output-len", "128", "--ignore-eos", "--no-plots"]
    pieces = ["{py}", "-m", "bench.gpu_model_pieces"]
    parity = ["{py}", "-m", "bench.parity", "--device", "cuda", "--json", "{dir}/parity.json"]

    def bubble(c: int, n: int) -> Stage:  # resident mode at c streams, with its raw device timeline
        argv = bench + ["--compare", "device", "--launch", "resident", "--concurrency", str(c)]
        argv += ["--requests", str(n), *lengths, "--server-arg=--trace"]
        argv += ["--server-arg={dir}/device-trace.json", *budget, "--out", "{dir}"]
        return Stage(f"bubble-c{c}", argv, 80, ("backend-resident",), dict(DEVICE_ENV), "A")

    def stage(name, argv, timeout, needs=(), run="A") -> Stage:
        return Stage(name, argv, timeout, tuple(needs), dict(DEVICE_ENV), run)

    def measured(name, flags: str, timeout, needs=(), run="A") -> Stage:
        """`ringleader bench` on llama-1b, 128 in / 128 out, the kernel's run budget, out to {dir}."""
        return stage(name, bench + flags.split() + [*lengths, *budget, "--out", "{dir}"], timeout, needs, run)

    return [
        # ---- run A: does the device path run at all, and what is its bubble -----------------
        stage("env", ["{py}", "-m", "hostctl.cli", "doctor", "--json", "{dir}/doctor.json"], 30),
        stage("module", checks + ["module"], 30),
        stage("graphs-fp32", checks + ["graphs", "--dtype", "float32"], 60),
        # llama-1b bf16 step graphs, and the resident launch graph instantiated around them
        stage("graphs-bf16", checks + ["graphs", "--dtype", "bfloat16", "--embed", "llama-1b"], 100),
        # llama-1b bf16 decode steps (1 and 32 rows) against the memory roofline
        stage(
            "roofline",
            ["{py}", "-m", "bench.roofline", "--model", "llama-1b", "--rows", "1,32", "--ctx", "512"]
            + ["--json", "{dir}/result.json"],
            40,
            ["graphs-bf16"],
        ),
        stage(
            "backend-resident",
            checks + ["backend", "--scheduler", "device", "--launch", "resident"],
            120,
            ["module", "graphs-fp32"],
        ),
        bubble(1, 16),
        bubble(64, 128),
        # ---- run B: the other modes, device vs host, the tests left over, three probes -------
        stage("backend-host", checks + ["backend", "--scheduler", "host"], 110, ["graphs-fp32"], "B"),
        measured(
            "perf",
            "--compare device,host --concurrency 1,32 --requests 64",
            150,
            ["backend-host", "backend-resident"],
            "B",
        ),
        stage(
            "backend-pump",
            checks + ["backend", "--scheduler", "device", "--launch", "pump"],
            110,
            ["module", "graphs-fp32"],
            "B",
        ),
        stage("tests", tests_stage_argv(), 110, ["graphs-fp32"], "B"),
        stage(
            "gpu-limits",
            ["{py}", "-m", "bench.gpu_limits", "--quick", "--only", "2,3,5", "--max-seconds", "50"]
            + ["--out-dir", "{dir}"],
            60,
            run="B",
        ),
        # ---- run C (second pass, call 1): parity on tiny and a transformers-made checkpoint,
        # device vs host vs static at 256 streams, CPU interference; half of SmolLM2 kept -----
        stage("model-stash", pieces + ["stash", ".carry/piece-1", "--to", CARRY_STASH], 10, run="C"),
        stage("parity", parity + ["--model", "tiny", "--model", "hf-random"], 150, run="C"),
        measured(
            "compare-256",
            "--compare device,host,static --concurrency 256 --slots 256 --requests 512",
            100,
            run="C",
        ),
        measured(
            "interference",
            "--compare device,host --concurrency 32 --requests 128 --cpu-interference 16",
            70,
            run="C",
        ),
        # ---- run D (call 2, the same warm machine): SmolLM2 whole again, its parity, transformers'
        # continuous batching beside ours, an open-loop sweep, the gpu_limits probes not yet run --
        stage(
            "model-join",
            pieces + ["join", CARRY_STASH, ".carry/piece-2", "--out", CARRY_MODELS],
            15,
            run="D",
        ),
        stage(
            "parity-smollm2", parity + ["--model", f"{CARRY_MODELS}/{SMOLLM2_FILE}"], 100, ["model-join"], "D"
        ),
        measured("compare-hf", "--compare device,hf --concurrency 1,32 --requests 64", 90, run="D"),
        measured("sweep", "--compare device,host --request-rate 50,150 --requests 128", 60, run="D"),
        stage(
            "gpu-limits-rest",
            [
                "{py}",
                "-m",
                "bench.gpu_limits",
                "--only",
                "1,4,6,7",
                "--max-seconds",
                "55",
                "--out-dir",
                "{dir}",
            ],
            65,
            run="D",
        ),
    ]


def load_stages(path: str | None) -> list[Stage]:
    if path is None:
        return builtin_stages()
    rows = json.loads(Path(path).read_text())
    return [
        Stage(
            r["name"],
            list(r["argv"]),
            float(r["timeout_s"] if "timeout_s" in r else r["timeout"]),
            tuple(r.get("needs", ())),
            dict(r.get("env", {})),
            str(r.get("run", "A")),
        )
        for r in rows
    ]


def select(stages: list[Stage], run: str | None, only: list[str], skip: list[str]) -> list[Stage]:
    def hit(name, patterns):
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    return [
        s
        for s in stages
        if (run is None or s.run == run) and (not only or hit(s.name, only)) and not hit(s.name, skip)
    ]


def run_totals(stages: list[Stage]) -> dict:
    runs = sorted({s.run for s in stages})
    return {r: sum(s.timeout_s for s in stages if s.run == r) for r in runs}


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


# ---- versions, found in a child process (no torch, no CUDA context here) ----------------------
VERSIONS_CODE = r"""
import json, subprocess
from device.doctor import package_versions
out = package_versions()
try:  # the NVRTC the stages will compile with ($RINGLEADER_NVRTC honoured), no GPU touched
    from device.sched.build import nvrtc_library, nvrtc_version
    out["nvrtc"], out["nvrtc_path"] = "%d.%d" % nvrtc_version(), nvrtc_library()
except Exception as exc:
    out["nvrtc_error"] = repr(exc)[:300]
try:  # cuDriverGetVersion needs no cuInit and makes no context
    from device.backends.cuda_driver import driver_version
    out["driver_cuda"] = "%d.%d" % driver_version()
except Exception as exc:
    out["libcuda_error"] = repr(exc)[:300]
try:
    r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=15)
    first = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    if first:
        driver, _, name = first.partition(",")
        out["driver"], out["gpu"] = driver.strip() or None, name.strip() or None
except Exception as exc:
    out["nvidia_smi_error"] = repr(exc)[:300]
print("RL_VERSIONS " + json.dumps(out))
"""


def find_versions(env: dict) -> dict:
    try:
        r = subprocess.run(
            [sys.executable, "-c", VERSIONS_CODE],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=VERSIONS_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the versions probe ran past {VERSIONS_TIMEOUT_S:.0f} s"}
    except OSError as exc:
        return {"error": repr(exc)}
    for line in r.stdout.splitlines():
        if line.startswith("RL_VERSIONS "):
            try:
                return json.loads(line[len("RL_VERSIONS ") :])
            except ValueError:
                break
    return {"error": f"exit code {r.returncode}: {(r.stdout + r.stderr)[-500:]}"}


def versions_line(v: dict) -> str:
    def g(k):
        return v.get(k) or "none"

    return (
        f"versions: nvrtc {g('nvrtc')} ({g('nvrtc_path')}), driver {g('driver')} (CUDA {g('driver_cuda')}), "
        f"cuda-bindings {g('cuda-bindings')}, torch {g('torch')}, triton {g('triton')}"
    )


# ---- figures a stage leaves behind -------------------------------------------------------------
def probe_figures(stage_dir: Path) -> dict | None:
    """Per-probe status from the gpu_limits JSON the gpu-limits stage wrote."""
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


def junit_figures(path: Path) -> dict | None:
    """Counts and each test's outcome from a pytest --junitxml file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    tests = {}
    for case in root.iter("testcase"):
        module = (case.get("classname") or "").replace(".", "/")
        node = f"{module}.py::{case.get('name')}" if module else str(case.get("name"))
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = "failed" if tag == "failure" else tag
                break
        tests[node] = outcome
    counts = {k: sum(1 for o in tests.values() if o == k) for k in ("passed", "failed", "error", "skipped")}
    return {**counts, "tests": tests}


def stage_figures(stage: Stage, stage_dir: Path, log_tail: str) -> dict | None:
    result = stage_dir / "result.json"
    if result.exists():
        try:
            doc = json.loads(result.read_text())
            if isinstance(doc, dict):
                return doc
        except ValueError:
            pass
    if stage.name == "gpu-limits":
        return probe_figures(stage_dir)
    if stage.name == "perf" or stage.name.startswith("bubble-"):
        return perf_figures(stage_dir)
    if stage.name == "tests":
        figures = junit_figures(stage_dir / "junit.xml")
        if figures is None:  # no junit.xml: pytest-timeout ended the process, say
            lines = [ln for ln in log_tail.splitlines() if ln.strip()]
            figures = {"outcome": lines[-1] if lines else ""}
        return figures
    return None


# ---- the runner ------------------------------------------------------------------------------
class Runner:
    def __init__(
        self,
        out: Path,
        work: Path,
        stages: list[Stage],
        *,
        budget_s: float,
        timeout_scale: float,
        previous: list[dict],
        pythonpath: list[str],
        argv: list[str],
        started: float,
        run: str | None = None,
    ):
        self.out, self.work, self.stages = out, work, stages
        self.budget_s, self.scale = budget_s, timeout_scale
        self.started = started  # time.monotonic() when main() began: its own work counts too
        self.started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        self.previous = {r["name"]: r for r in previous}
        self.results: list[StageResult] = []
        self.pythonpath = pythonpath
        self.argv = argv
        self.run_name = run
        self.versions: dict = {}
        self.left_out: list[dict] = []
        self.running: dict | None = None
        self.current: subprocess.Popen | None = None
        self.git_rev = git_rev()
        self.writes = 0
        # temporary files go where os.replace can move them into OUT: the work folder when it
        # shares OUT's file system (OUT then never holds a fourth file), else OUT itself
        same_fs = os.stat(work).st_dev == os.stat(out).st_dev
        self.tmp_dir = work if same_fs else out

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    # which stages passed, counting an earlier call's records (--previous)
    def passed(self, name: str) -> bool:
        mine = [r for r in self.results if r.name == name]
        if mine:
            return mine[-1].status == "passed"
        return self.previous.get(name, {}).get("status") == "passed"

    def run(self) -> int:
        self.write(pack=False)
        for stage in self.stages:
            res = self.run_stage(stage)
            self.results.append(res)
            self.write(pack=res.status != "skipped")
        print_table(self.results)
        bad = [r for r in self.results if r.status != "passed"]
        return 1 if bad else 0

    def env(self, extra: dict) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
        env["PYTHONPATH"] = os.pathsep.join(
            self.pythonpath + [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        return env

    def stage_dir(self, name: str) -> Path:
        return self.work / safe_name(name)

    def run_stage(self, stage: Stage) -> StageResult:
        stage_dir = self.stage_dir(stage.name)
        res = StageResult(stage.name, "skipped", needs=stage.needs, run=stage.run)
        res.command = shlex.join(expand(stage.argv, stage_dir, stage.timeout_s * self.scale))
        missing = [n for n in stage.needs if not self.passed(n)]
        if missing:
            res.reason = "needs " + ", ".join(missing) + ", which did not pass"
            return self.announce(res)
        left = self.left()
        timeout = min(stage.timeout_s * self.scale, left)
        if timeout < min(30.0, stage.timeout_s * self.scale):
            res.reason = f"out of time: {max(0.0, left):.0f} s of the run's budget left"
            return self.announce(res)
        res.timeout_s = round(timeout, 1)
        argv = expand(stage.argv, stage_dir, timeout)
        res.command = shlex.join(argv)
        if stage_dir.exists():
            shutil.rmtree(stage_dir, ignore_errors=True)
        stage_dir.mkdir(parents=True, exist_ok=True)
        log_path = stage_dir / "stage.log"
        print(f"=== {stage.name}: {res.command} (timeout {timeout:.0f} s)", flush=True)
        self.running = {"name": stage.name, "timeout_s": res.timeout_s, "started": now_iso()}
        self.write(pack=False)  # a kill during this stage still leaves its name in bringup.json
        env = self.env(stage.env)
        env["RL_BRINGUP_RESULT"] = str(stage_dir / "result.json")
        env["RL_BRINGUP_TIMEOUT_S"] = num(res.timeout_s)
        # a process group of its own (killpg reaches everything it starts), in this session, so
        # whoever ends this runner's session ends a stage left behind too
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                **group,
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
                self.running = None
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
        name = (self.running or {}).get("name")
        if proc is not None:
            kill_group(proc)
        self.running = None
        self.results.append(
            StageResult(
                name or "interrupted",
                "killed",
                reason="the runner was signalled" + ("" if name else " between stages"),
                run=self.run_name,
            )
        )
        self.write(pack=True)

    # ---- OUT: bringup.json, bringup.log, artifacts.tar.gz, each replaced whole ----------------
    def replace_into_out(self, name: str, write) -> None:
        # a name of its own per write: a signal handler's write never shares a file with the
        # write it interrupted (whose late close would then land in OUT's copy)
        self.writes += 1
        tmp = self.tmp_dir / f".{name}.{os.getpid()}.{self.writes}.tmp"
        write(tmp)
        os.replace(tmp, self.out / name)

    def write(self, pack: bool) -> None:
        if pack:
            self.replace_into_out("artifacts.tar.gz", self.pack)
            self.replace_into_out("bringup.log", self.write_log)
        mine = {r.name for r in self.results}
        carried = [r for n, r in self.previous.items() if n not in mine]
        stages = carried + [asdict(r) for r in self.results]
        summary = {
            k: sum(1 for s in stages if s["status"] == k)
            for k in ("passed", "failed", "timeout", "skipped", "killed")
        }
        doc = {
            "schema": SCHEMA,
            "run": self.run_name,
            "started": self.started_at,
            "finished": now_iso(),
            "seconds": round(time.monotonic() - self.started, 1),
            "budget_s": self.budget_s,
            "host": {
                "node": platform.node(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "versions": self.versions,
            "git_rev": self.git_rev,
            "argv": self.argv,
            "work_dir": str(self.work),
            "running": self.running,
            "stages": stages,
            "summary": summary,
            "archive_left_out": self.left_out,
        }
        self.replace_into_out("bringup.json", lambda p: p.write_text(json.dumps(doc, indent=2, default=str)))

    def write_log(self, path: Path) -> None:
        with open(path, "w") as f:
            for r in self.results:
                f.write(
                    f"\n##### {r.name}: {r.status} in {r.seconds:.1f} s"
                    + (f" ({r.reason})" if r.reason else "")
                    + f"\n##### $ {r.command}\n"
                )
                log = self.stage_dir(r.name) / "stage.log"
                if log.exists() and r.status != "skipped":
                    text = log.read_text(errors="replace")
                    if len(text) > LOG_IN_FULL:
                        cut = len(text) - LOG_IN_FULL
                        head = LOG_IN_FULL // 20
                        text = (
                            text[:head]
                            + f"\n##### [{cut} characters left out here; the whole log is in artifacts.tar.gz]\n"
                            + text[head + cut :]
                        )
                    f.write(text)

    def pack(self, path: Path) -> None:
        """Every stage folder of this run, files over TAR_FILE_LIMIT left out; then, while the
        archive is over TAR_LIMIT, the biggest file still in it left out too."""
        files: list[tuple[Path, str]] = []
        seen = set()
        for r in self.results:
            d = self.stage_dir(r.name)
            if r.status == "skipped" or d.name in seen or not d.is_dir():
                continue
            seen.add(d.name)
            for f in sorted(d.rglob("*")):
                if f.is_file() and not f.is_symlink():
                    files.append((f, f"{d.name}/{f.relative_to(d)}"))
        left_out = []
        keep = []
        for f, arc in files:
            size = f.stat().st_size
            if size > TAR_FILE_LIMIT:
                left_out.append({"path": arc, "bytes": size, "why": f"over {TAR_FILE_LIMIT} bytes"})
            else:
                keep.append((f, arc, size))
        while True:
            with tarfile.open(path, "w:gz", compresslevel=6) as tar:
                for f, arc, _ in keep:
                    try:
                        tar.add(f, arcname=arc)
                    except OSError as exc:  # vanished or unreadable: say so, go on
                        left_out.append({"path": arc, "bytes": None, "why": repr(exc)[:200]})
            if path.stat().st_size <= TAR_LIMIT or not keep:
                break
            biggest = max(keep, key=lambda k: k[2])
            keep.remove(biggest)
            left_out.append(
                {"path": biggest[1], "bytes": biggest[2], "why": f"the archive was over {TAR_LIMIT} bytes"}
            )
        self.left_out = left_out


def expand(argv: list[str], stage_dir: Path, timeout: float) -> list[str]:
    run_budget = f"{max(10, int(timeout) - 20)}"
    return [
        a.replace("{py}", sys.executable)
        .replace("{dir}", str(stage_dir))
        .replace("{run_budget_s}", run_budget)
        for a in argv
    ]


def num(x: float) -> str:
    """30.0 -> "30", 37.45 -> "37.5": no exponent, no trailing zeros."""
    return f"{x:.1f}".rstrip("0").rstrip(".")


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


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


def list_stages(stages: list[Stage], as_json: bool) -> None:
    totals = run_totals(stages)
    if as_json:
        rows = [
            {
                "name": s.name,
                "run": s.run,
                "timeout_s": s.timeout_s,
                "needs": list(s.needs),
                "argv": s.argv,
                "env": s.env,
            }
            for s in stages
        ]
        print(json.dumps({"stages": rows, "totals": totals}, indent=2))
        return
    print(f"{'stage':<17} {'run':<3} {'timeout':>7}  {'needs':<30} command")
    for s in stages:
        env = "" if s.env == DEVICE_ENV else " ".join(f"{k}={v}" for k, v in s.env.items())
        print(
            f"{s.name:<17} {s.run:<3} {s.timeout_s:>6.0f}s  {','.join(s.needs) or '-':<30} "
            f"{(env + ' ') if env else ''}{shlex.join(s.argv)}"
        )
    for r, total in totals.items():
        n = sum(1 for s in stages if s.run == r)
        print(f"run {r}: {n} stages, timeouts sum to {total:.0f} s (a run's limit: {RUN_LIMITS[r]:.0f} s)")
    device = " ".join(f"{k}={v}" for k, v in DEVICE_ENV.items())
    print(f"every stage runs with {device} unless its line says otherwise")


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
            "H100/H200. `python3 bench/gpu_bringup.py --list` shows its stages."
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
