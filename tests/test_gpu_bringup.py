"""The bring-up runner (bench/lab/gpu_bringup.py) with real processes and tiny stand-in stages:
order, dependencies, a hanging stage killed with everything it started, figures, logs, the two
runs (A, then B with --previous), the time budget, OUT holding three files after every stage and
after a SIGKILL, what a stage is told (its timeout, {run_budget_s}), the versions line; the
builtin table (run sums, GPU tests covered); and the wheel list against pyproject."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import tomllib

from ringleader.bench.lab.bringup_machine import versions_line
from ringleader.bench.lab.bringup_stages import (
    ALL_GPU_TESTS_NODES,
    CARRY_MODELS,
    CARRY_STASH,
    COVERED_BY_STAGE,
    RUN_LIMITS,
    SMOLLM2_FILE,
    TESTS_STAGE_NODES,
    builtin_stages,
)

REPO = Path(__file__).resolve().parents[1]
RUNNER = [sys.executable, str(REPO / "bench" / "lab" / "gpu_bringup.py")]
RUN_A = [
    "env",
    "module",
    "graphs-fp32",
    "graphs-bf16",
    "roofline",
    "backend-resident",
    "bubble-c1",
    "bubble-c64",
]
RUN_B = ["backend-host", "perf", "backend-pump", "tests", "gpu-limits"]
RUN_C = ["model-stash", "parity", "compare-256", "interference"]
RUN_D = ["model-join", "parity-smollm2", "compare-hf", "sweep", "gpu-limits-rest"]
RUN_E = ["tests-all", "goals-e", "roofline-profile"]
RUN_F = ["bubble-resident", "bubble-pingpong", "launch-probes", "interference-both", "open-loop-256"]
RUN_F += ["goals-layered", "goals-f"]
ALL_RUNS = {"A": RUN_A, "B": RUN_B, "C": RUN_C, "D": RUN_D, "E": RUN_E, "F": RUN_F}
DEVICE_ENV = {"CUDA_MODULE_LOADING": "EAGER", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}
THREE = ["artifacts.tar.gz", "bringup.json", "bringup.log"]


def py(code: str) -> list[str]:
    return ["{py}", "-c", code]


def runner_env(assume_gpu=True, **extra) -> dict:
    env = dict(os.environ)
    env.pop("RL_BRINGUP_ASSUME_GPU", None)
    if assume_gpu:
        env["RL_BRINGUP_ASSUME_GPU"] = "1"
    env.update(extra)
    return env


def run(tmp_path, stages, *extra, assume_gpu=True, timeout=60, out_name="out", env=None):
    table = tmp_path / "stages.json"
    table.write_text(json.dumps(stages))
    out = tmp_path / out_name
    t0 = time.monotonic()
    r = subprocess.run(
        RUNNER + ["--stages-file", str(table), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        env=env or runner_env(assume_gpu),
        timeout=timeout,
        cwd=REPO,
    )
    doc = json.loads((out / "bringup.json").read_text()) if (out / "bringup.json").exists() else None
    return r, doc, out, time.monotonic() - t0


def by_name(doc):
    return {s["name"]: s for s in doc["stages"]}


def tar_names(out: Path) -> list[str]:
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        return tar.getnames()


def start_runner_until(tmp_path, stages, pidfile):
    """Starts the runner on `stages` and returns (its process, OUT) once the stage that writes
    its pid into `pidfile` runs."""
    (tmp_path / "stages.json").write_text(json.dumps(stages))
    out = tmp_path / "out"
    proc = subprocess.Popen(
        RUNNER + ["--stages-file", str(tmp_path / "stages.json"), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=runner_env(),
        cwd=REPO,
    )
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError(f"the stage writing {pidfile.name} never started")
        time.sleep(0.05)
    return proc, out


def test_order_failures_and_dependencies(tmp_path):
    stages = [
        {"name": "a", "argv": py("print('alpha')"), "timeout": 30},
        {"name": "b", "argv": py("import sys; print('broken'); sys.exit(3)"), "timeout": 30},
        {"name": "c", "argv": py("print('independent')"), "timeout_s": 30},
        {"name": "d", "argv": py("print('n' + 'ever ran')"), "timeout": 30, "needs": ["a", "b"]},
        {"name": "e", "argv": py("print('after a')"), "timeout": 30, "needs": ["a"]},
    ]
    r, doc, out, _ = run(tmp_path, stages)
    assert r.returncode == 1
    assert [s["name"] for s in doc["stages"]] == ["a", "b", "c", "d", "e"]
    s = by_name(doc)
    assert [s[n]["status"] for n in "abcde"] == ["passed", "failed", "passed", "skipped", "passed"]
    assert s["b"]["returncode"] == 3 and "exit code 3" in s["b"]["reason"]
    assert "b" in s["d"]["reason"] and "a," not in s["d"]["reason"]  # names what did not pass
    assert "broken" in s["b"]["log_tail"] and "never ran" not in (out / "bringup.log").read_text()
    log = (out / "bringup.log").read_text()
    assert all(w in log for w in ("alpha", "broken", "independent", "after a"))
    assert doc["summary"] == {"passed": 3, "failed": 1, "timeout": 0, "skipped": 1, "killed": 0}
    assert doc["schema"] == "ringleader.bringup/1" and doc["finished"] and doc["running"] is None
    assert doc["budget_s"] == 540
    assert r.stdout.strip().splitlines()[-1].startswith("e ")  # the table comes last


def test_a_hanging_stage_is_killed_with_its_children(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    hang = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '600']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); print('hanging', flush=True); time.sleep(600)"
    )
    stages = [
        {"name": "hang", "argv": py(hang), "timeout": 2},
        {"name": "next", "argv": py("print('still ran')"), "timeout": 30},
    ]
    r, doc, _, took = run(tmp_path, stages)
    s = by_name(doc)
    assert s["hang"]["status"] == "timeout" and "killed after 2 s" in s["hang"]["reason"]
    assert "hanging" in s["hang"]["log_tail"]
    assert s["next"]["status"] == "passed"
    assert took < 15
    pid = int(pidfile.read_text())
    for _ in range(50):  # the group kill reaches the grandchild too
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the hanging stage's child {pid} survived the kill")


def test_figures_from_the_result_file_and_junit(tmp_path):
    write = (
        "import json, os; json.dump({'ok': True, 'bubble_us_p50': 2.5}, "
        "open(os.environ['RL_BRINGUP_RESULT'], 'w'))"
    )
    junit = (
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu_backend" name="test_gpu_a" />'
        '<testcase classname="tests.test_gpu_backend" name="test_gpu_b"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_gguf_quants" name="test_c[Q4_0]"><skipped message="y"/></testcase>'
        "</testsuite></testsuites>"
    )
    tests = f"import sys; open(sys.argv[1], 'w').write({junit!r}); sys.exit(1)"
    stages = [
        {"name": "m", "argv": py(write), "timeout": 30},
        {"name": "tests", "argv": [*py(tests), "{dir}/junit.xml"], "timeout": 30},
    ]
    _, doc, _, _ = run(tmp_path, stages)
    s = by_name(doc)
    assert s["m"]["figures"] == {"ok": True, "bubble_us_p50": 2.5}
    assert s["tests"]["figures"] == {
        "passed": 1,
        "failed": 1,
        "error": 0,
        "skipped": 1,
        "tests": {
            "tests/test_gpu_backend.py::test_gpu_a": "passed",
            "tests/test_gpu_backend.py::test_gpu_b": "failed",
            "tests/test_gguf_quants.py::test_c[Q4_0]": "skipped",
        },
    }


def test_previous_and_only(tmp_path):
    first = [{"name": "a", "argv": py("print(1)"), "timeout": 30}]
    _, doc1, out, _ = run(tmp_path, first)
    previous = tmp_path / "previous.json"
    previous.write_text((out / "bringup.json").read_text())
    stages = first + [
        {"name": "backend-x", "argv": py("print('x')"), "timeout": 5, "needs": ["a"]},
        {"name": "backend-y", "argv": py("print('y')"), "timeout": 5, "needs": ["b"]},
        {"name": "other", "argv": py("print('not selected')"), "timeout": 5},
    ]
    r, doc, _, _ = run(tmp_path, stages, "--previous", str(previous), "--only", "backend-*")
    s = by_name(doc)
    assert s["a"]["status"] == "passed" and s["a"]["seconds"] == by_name(doc1)["a"]["seconds"]  # carried
    assert s["backend-x"]["status"] == "passed"  # `needs` met by the earlier call
    assert s["backend-y"]["status"] == "skipped" and "needs b" in s["backend-y"]["reason"]
    assert "other" not in s
    assert r.returncode == 1


def test_the_budget_caps_a_run(tmp_path):
    """Four stages that would each hang, 2 s timeouts, a 5 s budget: two are killed, the rest
    skipped as out of time, and the whole run (its own work included) ends near the budget."""
    stages = [{"name": f"s{i}", "argv": py("import time; time.sleep(60)"), "timeout": 2} for i in range(4)]
    r, doc, _, took = run(tmp_path, stages, "--budget-s", "5")
    s = by_name(doc)
    assert s["s0"]["status"] == "timeout"
    assert s["s3"]["status"] == "skipped" and "out of time" in s["s3"]["reason"]
    assert sum(st["status"] == "timeout" for st in doc["stages"]) <= 2
    assert doc["seconds"] < 6.5 and took < 10
    assert r.returncode == 1


def test_runs_a_then_b(tmp_path):
    """--run A runs run A's stages only; --run B with A's records meets `needs` across runs."""
    stages = [
        {"name": "a1", "run": "A", "argv": py("print('a1')"), "timeout": 30},
        {"name": "a2", "run": "A", "argv": py("import sys; sys.exit(1)"), "timeout": 30},
        {"name": "b1", "run": "B", "argv": py("print('b1')"), "timeout": 30, "needs": ["a1"]},
        {"name": "b2", "run": "B", "argv": py("print('b2')"), "timeout": 30, "needs": ["a2"]},
        {"name": "b3", "run": "B", "argv": py("print('b3')"), "timeout": 30},
    ]
    r, doc_a, out_a, _ = run(tmp_path, stages, "--run", "A", out_name="a")
    assert [s["name"] for s in doc_a["stages"]] == ["a1", "a2"] and doc_a["run"] == "A"
    assert doc_a["budget_s"] == 540  # the run's own limit
    assert r.stdout.splitlines()[0].startswith("versions: ")  # before any stage
    r, doc_b, out_b, _ = run(
        tmp_path,
        stages,
        "--run",
        "B",
        "--previous",
        str(out_a / "bringup.json"),
        "--skip",
        "b3",
        out_name="b",
    )
    s = by_name(doc_b)
    assert [n["name"] for n in doc_b["stages"]] == ["a1", "a2", "b1", "b2"]  # A's records carried
    assert s["b1"]["status"] == "passed" and s["b1"]["run"] == "B"
    assert s["b2"]["status"] == "skipped" and "needs a2" in s["b2"]["reason"]
    assert tar_names(out_b) == ["b1/stage.log"]  # this run's stages only
    r = subprocess.run(
        RUNNER + ["--stages-file", str(tmp_path / "stages.json"), "--list", "--run", "B"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert [ln.split()[0] for ln in r.stdout.splitlines()[1:4]] == ["b1", "b2", "b3"]
    assert "run B: 3 stages, timeouts sum to 90 s" in r.stdout and "run A" not in r.stdout


def test_the_second_pass_runs_get_their_shorter_budget(tmp_path):
    stages = [{"name": "c1", "run": "C", "argv": py("print('c1')"), "timeout": 30}]
    r, doc, _, _ = run(tmp_path, stages, "--run", "C")
    assert r.returncode == 0 and doc["budget_s"] == 330 and by_name(doc)["c1"]["status"] == "passed"
    r, doc, _, _ = run(tmp_path, stages, "--run", "C", "--budget-s", "100", out_name="c2")
    assert doc["budget_s"] == 100


def test_a_stage_is_told_its_timeout_and_run_budget(tmp_path):
    show = "import os, sys; print('argv', sys.argv[1], 'env', os.environ['RL_BRINGUP_TIMEOUT_S'])"
    stages = [
        {"name": "long", "argv": [*py(show), "{run_budget_s}"], "timeout": 45},
        {"name": "short", "argv": [*py(show), "--x={run_budget_s}"], "timeout": 20},
    ]
    r, doc, _, _ = run(tmp_path, stages)
    s = by_name(doc)
    assert "argv 25 env 45" in s["long"]["log_tail"] and s["long"]["timeout_s"] == 45
    assert "argv --x=10 env 20" in s["short"]["log_tail"]  # max(10, timeout - 20)
    assert s["short"]["command"].endswith("--x=10")
    assert r.returncode == 0


def test_out_holds_three_files_after_every_stage(tmp_path):
    """Each stand-in stage lists OUT while it runs: never more than the three files, no stage
    folder, no temporary file; `--pack` is still accepted (and does nothing more)."""
    out = tmp_path / "out"
    look = f"import os; print('OUT:', sorted(os.listdir({str(out)!r})))"
    big = "import os; f = open(os.path.join(os.environ['RL_BRINGUP_RESULT'] + '.big'), 'wb'); f.truncate(20_000_001)"
    stages = [
        {"name": "a", "argv": py(look), "timeout": 30},
        {"name": "b", "argv": py(look + "; " + big), "timeout": 30},
        {"name": "c", "argv": py(look), "timeout": 30},
    ]
    r, doc, out, _ = run(tmp_path, stages, "--pack")
    assert r.returncode == 0
    s = by_name(doc)
    assert "OUT: ['bringup.json']" in s["a"]["log_tail"]  # the first stage: only the index yet
    assert f"OUT: {THREE}" in s["b"]["log_tail"] and f"OUT: {THREE}" in s["c"]["log_tail"]
    assert sorted(p.name for p in out.iterdir()) == THREE
    names = tar_names(out)
    assert {"a/stage.log", "b/stage.log", "c/stage.log"} <= set(names)
    assert "b/result.json.big" not in names  # over 20 MB: left out, and said so
    assert doc["archive_left_out"] == [
        {"path": "b/result.json.big", "bytes": 20_000_001, "why": "over 20000000 bytes"}
    ]
    assert (
        Path(doc["work_dir"]) == tmp_path / "out.work"
        and (tmp_path / "out.work" / "a" / "stage.log").exists()
    )


def test_a_runner_killed_mid_stage_leaves_what_finished(tmp_path):
    """SIGKILL during the third stage (the device limit): OUT has the index, the log and an
    archive of the first two stages, and the index names the stage that was running."""
    pidfile = tmp_path / "c.pid"
    hang = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    stages = [
        {"name": "a", "argv": py("print('in a')"), "timeout": 30},
        {"name": "b", "argv": py("print('in b')"), "timeout": 30},
        {"name": "c", "argv": py(hang), "timeout": 30},
        {"name": "d", "argv": py("print('in d')"), "timeout": 30},
    ]
    proc, out = start_runner_until(tmp_path, stages, pidfile)
    try:
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        if pidfile.exists() and pidfile.read_text():
            try:  # the stage, left behind by a SIGKILLed runner (its process group: its own pid)
                os.killpg(int(pidfile.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert sorted(p.name for p in out.iterdir()) == THREE
    doc = json.loads((out / "bringup.json").read_text())
    assert [s["name"] for s in doc["stages"]] == ["a", "b"]
    assert doc["running"]["name"] == "c"
    names = tar_names(out)
    assert {"a/stage.log", "b/stage.log"} <= set(names) and not any(n.startswith(("c", "d")) for n in names)
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        assert tar.extractfile("b/stage.log").read() == b"in b\n"
    assert "in b" in (out / "bringup.log").read_text()


def test_sigterm_kills_the_stage_and_records_it(tmp_path):
    pidfile = tmp_path / "b.pid"
    hang = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); print('b up', flush=True); time.sleep(60)"
    stages = [
        {"name": "a", "argv": py("print('in a')"), "timeout": 30},
        {"name": "b", "argv": py(hang), "timeout": 30},
        {"name": "c", "argv": py("print('in c')"), "timeout": 30},
    ]
    proc, out = start_runner_until(tmp_path, stages, pidfile)
    try:
        time.sleep(0.2)  # its first line reaches the log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    stage_pid = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(stage_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(stage_pid, signal.SIGKILL)
        pytest.fail("the running stage outlived its signalled runner")
    assert sorted(p.name for p in out.iterdir()) == THREE
    doc = json.loads((out / "bringup.json").read_text())
    s = by_name(doc)
    assert list(s) == ["a", "b"] and s["b"]["status"] == "killed" and doc["running"] is None
    assert {"a/stage.log", "b/stage.log"} <= set(tar_names(out))
    assert "b up" in (out / "bringup.log").read_text()


def test_versions_line_comes_first(tmp_path):
    """With a stand-in nvidia-smi on PATH; whatever this machine lacks prints as 'none'."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '580.65.06, NVIDIA H100 80GB HBM3'\n")
    smi.chmod(0o755)
    env = runner_env(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    r, doc, _, _ = run(tmp_path, [{"name": "a", "argv": py("print(1)"), "timeout": 30}], env=env)
    assert r.returncode == 0
    first = r.stdout.splitlines()[0]
    v = doc["versions"]
    assert first == versions_line(v)
    assert re.fullmatch(
        r"versions: nvrtc \S+ \(.+\), driver 580\.65\.06 \(CUDA \S+\), cuda-bindings \S+, torch \S+, triton \S+",
        first,
    ), first
    assert v["gpu"] == "NVIDIA H100 80GB HBM3"
    for key in ("torch", "triton", "cuda-bindings"):
        spec = importlib.util.find_spec(key.replace("-", "."))
        assert (v.get(key) is not None) == (spec is not None) or key == "cuda-bindings"
    assert versions_line({}) == (
        "versions: nvrtc none (none), driver none (CUDA none), cuda-bindings none, torch none, triton none"
    )


# ---- the builtin table -------------------------------------------------------------------------
def test_the_builtin_table_as_json():
    r = subprocess.run(RUNNER + ["--list", "--json"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    rows = doc["stages"]
    assert all(set(row) == {"name", "run", "timeout_s", "needs", "argv", "env"} for row in rows)
    assert [row["name"] for row in rows] == [name for names in ALL_RUNS.values() for name in names]
    assert [row["run"] for row in rows] == [run for run, names in ALL_RUNS.items() for _ in names]
    sums = {run: sum(row["timeout_s"] for row in rows if row["run"] == run) for run in ALL_RUNS}
    assert doc["totals"] == sums
    assert sums == RUN_LIMITS, sums  # each run uses its call to the full
    # the second pass in one session's 15 device minutes: two calls, a start, the transfers
    assert sums["C"] + sums["D"] + 2 * 30 + 90 <= 15 * 60
    assert sums["E"] + sums["F"] + 2 * 30 + 90 <= 15 * 60
    assert all(row["env"] == DEVICE_ENV for row in rows)
    seen = set()
    for row in rows:  # needs name a stage that comes earlier (in its run, or in run A)
        assert set(row["needs"]) <= seen, row
        seen.add(row["name"])
    named = {row["name"]: row for row in rows}
    for name in ("bubble-c1", "bubble-c64", "perf", "compare-256", "interference", "compare-hf", "sweep"):
        argv = named[name]["argv"]
        assert "--server-arg=--run-budget-s" in argv and "--server-arg={run_budget_s}" in argv
    # the SmolLM2 pieces: stashed outside the tree in C, joined in D where parity-smollm2 reads it
    assert named["model-stash"]["argv"][-3:] == [".carry/piece-1", "--to", CARRY_STASH]
    assert named["model-join"]["argv"][-4:] == [CARRY_STASH, ".carry/piece-2", "--out", CARRY_MODELS]
    assert named["parity-smollm2"]["argv"][-1] == f"{CARRY_MODELS}/{SMOLLM2_FILE}"
    assert named["graphs-bf16"]["argv"][-2:] == ["--embed", "llama-1b"]
    tests = named["tests"]["argv"]
    assert tests[:3] == ["{py}", "-m", "pytest"] and "{dir}/junit.xml" in tests
    assert tests[-len(TESTS_STAGE_NODES) :] == list(TESTS_STAGE_NODES)
    assert tests[-1].endswith("::test_gpu_free_while_the_kernel_runs_waits_and_stop_releases_it")  # last
    assert ("--timeout" in tests) == (importlib.util.find_spec("pytest_timeout") is not None)
    r = subprocess.run(
        RUNNER + ["--list", "--json", "--run", "A"], capture_output=True, text=True, timeout=30
    )
    assert [row["name"] for row in json.loads(r.stdout)["stages"]] == RUN_A


GPU_ONLY_PLUGIN = """
import json, os
REASONS = ("needs a CUDA GPU", "needs a CUDA device")

def pytest_collection_modifyitems(session, config, items):
    gpu_only = [
        item.nodeid
        for item in items
        if any(str(m.kwargs.get("reason", "")).startswith(REASONS) for m in item.iter_markers("skipif"))
    ]
    with open(os.environ["RL_GPU_ONLY_OUT"], "w") as f:
        json.dump({"all": [item.nodeid for item in items], "gpu_only": gpu_only}, f)
    items[:] = []
"""


def test_every_gpu_only_test_runs_in_some_stage(tmp_path):
    """pytest collects tests/; a test skipped for lack of a GPU (by its skipif reason, read
    without evaluating it, so this holds on a GPU too) must be in the tests stage's node list or
    in the table of tests other stages cover, and every listed node id must still exist."""
    (tmp_path / "rl_gpu_only.py").write_text(GPU_ONLY_PLUGIN)
    found = tmp_path / "found.json"
    env = dict(os.environ, RL_GPU_ONLY_OUT=str(found))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)] + [env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "rl_gpu_only",
        ]
        + ["tests"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode in (0, 5), r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(found.read_text())
    collected, gpu_only = doc["all"], doc["gpu_only"]
    assert len(gpu_only) >= 10, gpu_only  # the reasons still read as this test expects

    def listed(node: str, ids) -> bool:
        return any(node == i or node.startswith(i + "[") for i in ids)

    listed_ids = list(TESTS_STAGE_NODES) + list(COVERED_BY_STAGE)
    missing = [n for n in gpu_only if not listed(n, listed_ids)]
    assert not missing, f"GPU-only tests no bring-up stage runs (add them to TESTS_STAGE_NODES): {missing}"
    gone = [i for i in listed_ids if not any(listed(n, [i]) for n in collected)]
    assert not gone, f"listed in bench/lab/bringup_stages.py, no longer collected: {gone}"
    assert not set(TESTS_STAGE_NODES) & set(COVERED_BY_STAGE)
    stage_names = {s.name for s in builtin_stages()}
    assert set(COVERED_BY_STAGE.values()) <= stage_names
    every = list(ALL_GPU_TESTS_NODES)  # run E's one pytest process: the three modes' parity too
    assert set(TESTS_STAGE_NODES) <= set(every) and every[-1] == TESTS_STAGE_NODES[-1]
    assert all(listed(n, every) for n in gpu_only if "parity_timeline_and_stop" in n)


def test_list_and_no_gpu(tmp_path):
    r = subprocess.run(RUNNER + ["--list"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    n = sum(len(names) for names in ALL_RUNS.values())
    rows = [ln.split() for ln in lines[1 : 1 + n]]
    assert [row[0] for row in rows] == [name for names in ALL_RUNS.values() for name in names]
    assert [row[1] for row in rows] == [run for run, names in ALL_RUNS.items() for _ in names]
    assert rows[0][2] == "30s" and "run A: 8 stages, timeouts sum to 540 s" in r.stdout
    assert "run C: 4 stages, timeouts sum to 330 s (a run's limit: 330 s)" in r.stdout
    if subprocess.run(["which", "nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("this machine has nvidia-smi")
    r, doc, out, _ = run(tmp_path, [{"name": "a", "argv": py("print(1)"), "timeout": 30}], assume_gpu=False)
    assert r.returncode == 0 and "no CUDA GPU here" in r.stdout and "--list" in r.stdout
    assert doc is None and not out.exists() and not (tmp_path / "out.work").exists()  # nothing ran


# ---- the wheels the GPU machine lacks ----------------------------------------------------------
def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0])


def _listed(path: str) -> set[str]:
    lines = (REPO / path).read_text().splitlines()
    return {_requirement_name(ln) for ln in lines if ln.strip() and not ln.lstrip().startswith("#")}


def test_the_wheel_list_covers_every_dependency_the_image_lacks():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = {_requirement_name(r) for r in project["dependencies"]}
    for extra in ("test", "bench", "cuda"):
        wanted |= {_requirement_name(r) for r in extras.get(extra, [])}
    image, wheels = _listed("bench/lab/gpu_image_packages.txt"), _listed("bench/lab/gpu_wheels.txt")
    assert "pyzmq" in wheels and "pyzmq" not in image
    # Ray Serve's and lm-eval's tests run in CI on the CPU; no GPU stage runs them, and their
    # wheels would not fit a device call's carry
    cpu_only = {"ray", "lm-eval"}
    gpu_tests = {node.split("::")[0] for node in TESTS_STAGE_NODES} | {
        str(p.relative_to(REPO)) for p in REPO.glob("tests/test_gpu_*.py")
    }
    imports_ray = re.compile(r"^\s*(import|from) (ray|lm_eval)\b|importorskip\(\"(ray|lm_eval)", re.M)
    assert not any(imports_ray.search((REPO / test).read_text()) for test in gpu_tests)
    missing = wanted - image - wheels - cpu_only
    assert not missing, f"neither on the GPU image nor carried: {missing}"
    assert all(
        "==" in ln
        for ln in (REPO / "bench/lab/gpu_wheels.txt").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ), "carried wheels are pinned"


def test_gpu_wheels_script_dry_run_and_usage(tmp_path):
    script = str(REPO / "bench" / "lab" / "gpu_wheels.sh")
    r = subprocess.run(["bash", script, "--dry-run", str(tmp_path / "w")], capture_output=True, text=True)
    assert r.returncode == 0
    for flag in (
        "--python-version 3.12",
        "--only-binary=:all:",
        "--implementation cp",
        "--no-deps",
        "manylinux_2_28_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
    ):
        assert flag in r.stdout, flag
    pins = [
        ln
        for ln in (REPO / "bench/lab/gpu_wheels.txt").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert pins and all(p in r.stdout for p in pins)
    assert not (tmp_path / "w").exists()
    r = subprocess.run(["bash", script], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
