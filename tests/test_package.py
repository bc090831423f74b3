"""What a wheel built from this checkout installs: ringleader/ and its dist-info only (no lab, no
results), the scheduler's sources as package data, importable from anywhere once installed; the
package list in pyproject.toml against the folders; and the house rules that keep every source file
readable in one sitting (no file over 600 lines) and the committed results small."""

import os
import shutil
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


def _tracked(*patterns: str) -> list[str]:
    """The checkout's files (committed or not, ignored ones left out)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", *patterns], cwd=ROOT, capture_output=True, text=True
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return [p for p in listed.stdout.split() if (ROOT / p).is_file()]


def test_committed_results_keep_raw_artifacts_compressed():
    """bench/results/ holds summaries, small JSON and figures; a raw artifact over 256 KiB
    (traces, logs, stage folders) is committed compressed."""
    big = {
        p: size
        for p in _tracked("bench/results")
        if (size := (ROOT / p).stat().st_size) > 256 * 1024 and not p.endswith((".gz", ".xz", ".zst", ".png"))
    }
    assert not big, big


def test_the_package_list_names_every_shipped_folder_and_no_lab():
    """pyproject.toml lists the packages (its package-dir maps ringleader.X to the folder X): every
    folder of ipc/, hostctl/, device/ and bench/ that holds Python is listed, bench/lab/ and
    bench/results/ are not."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = tool["package-dir"]
    assert mapping == {
        "ringleader": "ringleader",
        **{f"ringleader.{d}": d for d in ("ipc", "hostctl", "device", "bench")},
    }
    folders = {
        "ringleader." + ".".join(Path(p).parent.parts)
        for p in _tracked("ipc", "hostctl", "device", "bench")
        if p.endswith(".py") and not p.startswith(("bench/lab/", "bench/results/"))
    }
    assert set(tool["packages"]) == folders | {"ringleader"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the checkout's files: setuptools reuses a build/ folder it finds, which
    would carry modules this tree no longer has."""
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    for p in _tracked():
        (source / p).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / p, source / p)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, source],
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
    # the scheduler's one source for two compilers travels as data; the lab stays in the repository
    assert "ringleader/device/sched/kernel.cu" in names and "ringleader/device/sched/sched_step.h" in names
    assert "ringleader/bench/cli.py" in names
    assert not [n for n in names if "/results/" in n or "/lab/" in n or n.startswith("ringleader/tests")]


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
