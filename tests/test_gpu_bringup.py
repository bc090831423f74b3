"""The bring-up runner (bench/gpu_bringup.py) with real processes and tiny stand-in stages:
order, dependencies, a hanging stage killed with everything it started, figures, logs, a run
split across calls, the time budget, packing; and the wheel list against pyproject."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
RUNNER = [sys.executable, str(REPO / "bench" / "gpu_bringup.py")]
BUILTIN = [
    "env",
    "probe",
    "module",
    "graphs-fp32",
    "graphs-bf16",
    "roofline",
    "backend-host",
    "backend-resident",
    "backend-pump",
    "tests",
    "bubble-c1",
    "bubble-c64",
    "perf",
]


def py(code: str) -> list[str]:
    return ["{py}", "-c", code]


def run(tmp_path, stages, *extra, assume_gpu=True, timeout=60):
    table = tmp_path / "stages.json"
    table.write_text(json.dumps(stages))
    env = dict(os.environ)
    env.pop("RL_BRINGUP_ASSUME_GPU", None)
    if assume_gpu:
        env["RL_BRINGUP_ASSUME_GPU"] = "1"
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = subprocess.run(
        RUNNER + ["--stages-file", str(table), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )
    doc = json.loads((out / "bringup.json").read_text()) if (out / "bringup.json").exists() else None
    return r, doc, out, time.monotonic() - t0


def by_name(doc):
    return {s["name"]: s for s in doc["stages"]}


def test_order_failures_and_dependencies(tmp_path):
    stages = [
        {"name": "a", "argv": py("print('alpha')"), "timeout": 30},
        {"name": "b", "argv": py("import sys; print('broken'); sys.exit(3)"), "timeout": 30},
        {"name": "c", "argv": py("print('independent')"), "timeout": 30},
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
    assert doc["schema"] == "ringleader.bringup/1" and doc["finished"]
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


def test_figures_from_the_result_file(tmp_path):
    write = (
        "import json, os; json.dump({'ok': True, 'bubble_us_p50': 2.5}, "
        "open(os.environ['RL_BRINGUP_RESULT'], 'w'))"
    )
    _, doc, _, _ = run(tmp_path, [{"name": "m", "argv": py(write), "timeout": 30}])
    assert by_name(doc)["m"]["figures"] == {"ok": True, "bubble_us_p50": 2.5}


def test_previous_only_and_budget(tmp_path):
    first = [{"name": "a", "argv": py("print(1)"), "timeout": 30}]
    _, doc1, out, _ = run(tmp_path, first)
    previous = tmp_path / "previous.json"
    previous.write_text((out / "bringup.json").read_text())
    stages = first + [
        {"name": "backend-x", "argv": py("print('x')"), "timeout": 5, "needs": ["a"]},
        {"name": "backend-y", "argv": py("import time; time.sleep(3)"), "timeout": 5},
        {"name": "late", "argv": py("print('late')"), "timeout": 5},
        {"name": "other", "argv": py("print('not selected')"), "timeout": 5},
    ]
    r, doc, _, _ = run(
        tmp_path, stages, "--previous", str(previous), "--only", "backend-*,late", "--budget-s", "7"
    )
    s = by_name(doc)
    assert s["a"]["status"] == "passed" and s["a"]["seconds"] == by_name(doc1)["a"]["seconds"]  # carried
    assert s["backend-x"]["status"] == "passed"  # `needs` met by the earlier call
    assert s["backend-y"]["status"] == "passed"
    assert s["late"]["status"] == "skipped" and "out of time" in s["late"]["reason"]
    assert "other" not in s
    assert r.returncode == 1


def test_pack_leaves_three_files(tmp_path):
    stages = [
        {"name": "a", "argv": py("print('in a')"), "timeout": 30},
        {"name": "tests::tests/x.py::t[1]", "argv": py("print('1 passed')"), "timeout": 30},
    ]
    r, doc, out, _ = run(tmp_path, stages, "--pack")
    assert r.returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["artifacts.tar.gz", "bringup.json", "bringup.log"]
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        names = tar.getnames()
    assert "a/stage.log" in names and "tests__tests_x.py__t_1_/stage.log" in names
    assert by_name(doc)["tests::tests/x.py::t[1]"]["figures"] == {"outcome": "1 passed"}


def test_list_and_no_gpu(tmp_path):
    r = subprocess.run(RUNNER + ["--list"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    rows = [ln.split()[0] for ln in r.stdout.splitlines()[1:]]
    assert rows == BUILTIN
    if subprocess.run(["which", "nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("this machine has nvidia-smi")
    r, doc, out, _ = run(tmp_path, [{"name": "a", "argv": py("print(1)"), "timeout": 30}], assume_gpu=False)
    assert r.returncode == 0 and "no CUDA GPU here" in r.stdout and "--list" in r.stdout
    assert doc is None and not out.exists()  # nothing ran, nothing written


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
    image, wheels = _listed("bench/gpu_image_packages.txt"), _listed("bench/gpu_wheels.txt")
    assert "pyzmq" in wheels and "pyzmq" not in image
    assert not wanted - image - wheels, f"neither on the GPU image nor carried: {wanted - image - wheels}"
    assert all(
        "==" in ln
        for ln in (REPO / "bench/gpu_wheels.txt").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ), "carried wheels are pinned"


def test_gpu_wheels_script_dry_run_and_usage(tmp_path):
    script = str(REPO / "bench" / "gpu_wheels.sh")
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
        for ln in (REPO / "bench/gpu_wheels.txt").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert pins and all(p in r.stdout for p in pins)
    assert not (tmp_path / "w").exists()
    r = subprocess.run(["bash", script], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
