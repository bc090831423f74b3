"""The GPU-limits probe's command (``python -m ringleader.bench.lab.gpu_limits``, bench/lab/gpu_limits/).

On any machine (CI has no GPU):
  * --compile-only compiles every kernel with NVRTC for sm_90 and says so;
  * without a CUDA driver the plain command exits 0 with the 'no CUDA device'
    message.
On a machine with a GPU (torch.cuda.is_available()):
  * the whole probe runs with --quick.

The helpers (cuda_driver's check, parse_ptxas, device_slug, summarize, --only) are
tests/test_gpu_limits_helpers.py's; every probe end to end against a simulated CUDA driver,
tests/test_gpu_limits_simulated.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gpu_limits_probe import N_KERNELS, ROOT, libcuda_present, load

COMMAND = [sys.executable, "-m", "ringleader.bench.lab.gpu_limits"]  # run from ROOT


def run_probe(*args: str, timeout: int):
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _torch_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _compile_line(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("GPU_LIMITS_COMPILE ")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0].split(" ", 1)[1])


def test_compile_only_builds_every_kernel():
    pytest.importorskip("cuda.bindings")
    r = run_probe("--compile-only", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    info = _compile_line(r.stdout)
    kernels = load("kernels")
    assert info["ok"] is True
    assert info["arch"] == "sm_90"
    assert info["n_expected"] == info["n_compiled"] == len(kernels.ALL_KERNELS) == N_KERNELS
    assert set(info["kernels"]) == set(kernels.ALL_KERNELS)
    for name, k in info["kernels"].items():
        assert k["ok"], name
        assert isinstance(k["regs"], int) and 0 < k["regs"] <= 64, (name, k)
        # one-thread control kernels: nothing may go to local memory
        assert k["stack_bytes"] == 0 and k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, (name, k)
    assert f"compiled {N_KERNELS} of {N_KERNELS} kernels for sm_90" in r.stdout


def test_every_kernel_compiles_with_the_gpu_images_nvrtc():
    """The device machine compiles with NVRTC 13.0: the hand-declared graph builtins
    (cudaGraphSetConditional, cudaGraphLaunch) and %current_graph_exec must compile there too."""
    pytest.importorskip("cuda.bindings")
    from ringleader.bench.lab import gpu_image_toolchain
    from ringleader.device.sched.build import NVRTC_ENV
    from tests.conftest import fetched

    toolchain = gpu_image_toolchain
    library = fetched(f"NVRTC {toolchain.NVRTC}", toolchain.cached_nvrtc, toolchain.fetch_nvrtc)
    r = subprocess.run(
        [*COMMAND, "--compile-only"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, NVRTC_ENV: str(library)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    info = _compile_line(r.stdout)
    assert info["nvrtc"] == ".".join(toolchain.NVRTC.split(".")[:2]), info["nvrtc"]
    assert info["ok"] and info["n_compiled"] == N_KERNELS, {k: v for k, v in info.items() if k != "kernels"}


@pytest.mark.skipif(libcuda_present(), reason="a CUDA driver is installed here")
def test_without_a_device_exits_zero_with_message():
    pytest.importorskip("cuda.bindings")
    r = run_probe(timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        f"no CUDA device: compiled {N_KERNELS} kernels for sm_90; measurements need an H100/H200" in r.stdout
    )
    assert _compile_line(r.stdout)["ok"] is True


@pytest.mark.skipif(not _torch_cuda(), reason="needs a CUDA GPU (torch.cuda.is_available())")
def test_quick_probe_on_gpu(tmp_path):
    r = run_probe("--quick", "--out-dir", str(tmp_path), timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-8000:]
    files = list(tmp_path.glob("*-gpu-limits-quick.json"))
    assert len(files) == 1, list(tmp_path.iterdir())
    res = json.loads(files[0].read_text())
    assert res["kernels"]["ok"], res["kernels"]
    probes = res["probes"]
    assert len(probes) == 10
    for key, p in probes.items():
        assert p["status"] in ("ok", "partial", "skipped"), (key, p.get("error"), p.get("where"))
    assert probes["1_doorbell"]["status"] == "ok", probes["1_doorbell"]
    assert probes["2_handoff"]["status"] == "ok", probes["2_handoff"]
    assert not res["meta"]["tainted"]
