"""What the bring-up runner learns and prepares before any stage, without importing torch or
touching CUDA itself: whether there is a GPU, the versions line (found in a child process), the
git revision, and the wheels every stage imports."""

from __future__ import annotations

import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ringleader.bench.lab.bringup_stages import LOG_TAIL, REPO, StageResult

VERSIONS_TIMEOUT_S = 30.0


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
from ringleader.device.doctor import package_versions
out = package_versions()
try:  # the NVRTC the stages will compile with ($RINGLEADER_NVRTC honoured), no GPU touched
    from ringleader.device.sched.build import nvrtc_library, nvrtc_version
    out["nvrtc"], out["nvrtc_path"] = "%d.%d" % nvrtc_version(), nvrtc_library()
except Exception as exc:
    out["nvrtc_error"] = repr(exc)[:300]
try:  # cuDriverGetVersion needs no cuInit and makes no context
    from ringleader.device.backends.cuda_driver import driver_version
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
