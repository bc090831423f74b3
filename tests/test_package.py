"""What a wheel built from this checkout installs: ringleader/ and its dist-info only, the scheduler's
sources as package data, importable from anywhere once installed; and the house rule that keeps
every source file readable in one sitting (no file over 600 lines)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600


def test_no_source_file_is_over_600_lines():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    paths = [p for p in tracked.stdout.split() if not p.startswith("bench/results/")]
    long = {p: n for p in paths if (n := len((ROOT / p).read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by role: {long}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, ROOT],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (path,) = out.glob("ringleader-*.whl")
    return path


def test_the_wheel_holds_ringleader_and_its_dist_info_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"ringleader", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for sub in ("ipc", "hostctl", "device", "bench"):
        assert f"ringleader/{sub}/__init__.py" in names
    # the scheduler's one source for two compilers, and the probe kernels, travel as data
    assert "ringleader/device/sched/kernel.cu" in names and "ringleader/device/sched/sched_step.h" in names
    assert "ringleader/bench/gpu_limits/kernels.cu" in names
    assert not [n for n in names if "/results/" in n or n.startswith("ringleader/tests")]


def test_an_installed_wheel_imports_from_its_own_folder(wheel, tmp_path):
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    code = (
        "import ringleader.ipc, ringleader.hostctl, ringleader.device, ringleader.bench\n"
        "from ringleader.ipc.client import Client\n"
        "from ringleader.device.sched.build import scheduler_source\n"
        "assert 'rl_sched_init' in scheduler_source('cpu_entry.cpp')\n"
        "print(ringleader.__file__)"
    )
    # from an empty folder, with the wheel's folder first: the checkout is not what gets imported
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(target / "ringleader" / "__init__.py")
