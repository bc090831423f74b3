"""The bring-up runner: each selected stage in its own process group under a hard kill timeout
within the run's budget, skipped when what it needs did not pass; after every stage OUT holds
bringup.json, bringup.log and artifacts.tar.gz, each replaced whole."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from ringleader.bench.lab.bringup_archive import pack_stage_folders, write_stage_logs
from ringleader.bench.lab.bringup_figures import stage_figures
from ringleader.bench.lab.bringup_machine import git_rev
from ringleader.bench.lab.bringup_stages import LOG_TAIL, REPO, Stage, StageResult

SCHEMA = "ringleader.bringup/1"


class Runner:
    """One invocation's stages, run in order, and the three files OUT holds after each."""

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
        write_stage_logs(path, self.results, self.stage_dir)

    def pack(self, path: Path) -> None:
        self.left_out = pack_stage_folders(path, self.results, self.stage_dir)


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


def print_table(results: list[StageResult]) -> None:
    print("\nstage                                              status    seconds  reason")
    for r in results:
        print(f"{r.name[:50]:<50} {r.status:<9} {r.seconds:>7.1f}  {r.reason or ''}")
