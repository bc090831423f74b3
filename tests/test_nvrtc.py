"""The scheduler source compiles with NVRTC for sm_90 as device code (no GPU needed), with the
installed NVRTC and with the GPU image's older one (bench/lab/gpu_image_toolchain.py), and the CPU
build of the same text agrees with the layout."""

import json
import os
import subprocess
import sys

import pytest

from ringleader.bench.lab import gpu_image_toolchain
from ringleader.device.sched.build import NVRTC_ENV, CpuScheduler, scheduler_source
from ringleader.ipc import layout
from tests.conftest import fetched

KERNEL_FUNCTIONS = {
    "rl_scheduler_persistent",
    "rl_step_wait",
    "rl_step_begin",
    "rl_step_signal",
    "rl_host_step_begin",
    "rl_host_step_end",
    "rl_plan_wait",
    "rl_step_gate",
    "rl_signal_pingpong",
}


@pytest.fixture(params=["installed", gpu_image_toolchain.NVRTC])
def nvrtc_release(request):
    """(libnvrtc path or None for the installed one, the version it must report)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    if request.param == "installed":
        return None, None
    toolchain = gpu_image_toolchain
    path = fetched(f"NVRTC {request.param}", toolchain.cached_nvrtc, toolchain.fetch_nvrtc)
    return path, tuple(int(x) for x in request.param.split(".")[:2])


def build_kernel(tmp_path, arch: str, library) -> dict:
    """`ringleader build-kernel` in a process of its own (a process uses one NVRTC for its life)."""
    out = tmp_path / f"build-{arch}.json"
    env = {k: v for k, v in os.environ.items() if k != NVRTC_ENV}
    cmd = [sys.executable, "-m", "ringleader.hostctl.cli", "build-kernel", "--arch", arch, "--json", str(out)]
    cmd += ["--nvrtc", str(library)] if library else []
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("arch", ["sm_90", "sm_87"])
def test_the_scheduler_compiles_with_every_nvrtc_release(tmp_path, nvrtc_release, arch):
    """sm_90: the H100/H200; sm_87: the Jetson Orin class of the edge appliances."""
    library, version = nvrtc_release
    report = build_kernel(tmp_path, arch, library)
    if version is not None:
        assert tuple(int(x) for x in report["nvrtc"].split(".")) == version
        assert os.path.realpath(report["nvrtc_library"]) == os.path.realpath(library)
    assert set(report["functions"]) == KERNEL_FUNCTIONS
    for name, r in report["functions"].items():
        assert r["registers"] is not None and r["registers"] <= 255, (name, r)
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0, (name, r)
    # __launch_bounds__(256, 1): the scheduler's block must fit one SM's 64K registers
    assert report["functions"]["rl_scheduler_persistent"]["registers"] * report["threads"] <= 65536


_WRONG_LAYOUT_PROBE = """
import json
from ringleader.device.sched.build import NvrtcError, nvrtc_compile, nvrtc_version, scheduler_source
from ringleader.ipc import layout
source = scheduler_source("kernel.cu")
options = ["--gpu-architecture=sm_90", "--std=c++17", "-default-device"]
right_offset = "RL_ASSERT_OFFSET(RlConfig, version, 4);"
right_size = '== %d, "RlConfig size"' % layout.CONFIG.size
assert right_offset in source and right_size in source
out = {"nvrtc": list(nvrtc_version())}
for name, wrong in (
    ("offset", source.replace(right_offset, right_offset.replace("4)", "8)"))),
    ("size", source.replace(right_size, right_size.replace(str(layout.CONFIG.size), "8"))),
):
    try:
        nvrtc_compile(wrong, name + ".cu", options)
        out[name] = "compiled"
    except NvrtcError as exc:
        out[name] = exc.log
print(json.dumps(out))
"""


def test_a_wrong_layout_fails_every_compiler_that_can_see_it(tmp_path, nvrtc_release):
    """The host build checks every offset and size; NVRTC checks sizes everywhere and offsets
    where it has __builtin_offsetof in constant expressions (13.4 and later)."""
    library, _ = nvrtc_release
    right = "RL_ASSERT_OFFSET(RlConfig, version, 4);"
    host = tmp_path / "header.cpp"
    host.write_text(layout.c_header().replace(right, right.replace("4)", "8)")))
    r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", str(host)], capture_output=True, text=True)
    assert r.returncode != 0 and "RlConfig.version" in r.stderr

    env = {k: v for k, v in os.environ.items() if k != NVRTC_ENV}
    if library:
        env[NVRTC_ENV] = str(library)
    r = subprocess.run(
        [sys.executable, "-c", _WRONG_LAYOUT_PROBE], capture_output=True, text=True, timeout=180, env=env
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "RlConfig size" in out["size"]
    if tuple(out["nvrtc"]) >= (13, 4):
        assert "RlConfig.version" in out["offset"]
    else:
        assert out["offset"] == "compiled"


def test_nvrtc_reports_a_broken_source():
    pytest.importorskip("cuda.bindings.nvrtc")
    import ringleader.device.sched.build as b

    original = b.scheduler_source
    b.scheduler_source = lambda entry: original(entry) + "\nthis is not C++;\n"
    try:
        with pytest.raises(RuntimeError, match="NVRTC could not compile"):
            b.compile_kernel("sm_90")
    finally:
        b.scheduler_source = original


def test_both_builds_share_one_source():
    cpu, gpu = scheduler_source("cpu_entry.cpp"), scheduler_source("kernel.cu")
    shared = cpu.split("// ---- cpu_entry.cpp")[0]  # header + primitives + sched_step
    assert gpu.startswith(shared) and len(shared) > 10_000
    assert "sched_step(" in cpu and "sched_step(" in gpu
    assert f"0x{layout.fingerprint():016X}" in cpu


def test_cpu_build_reports_the_layout_fingerprint():
    assert CpuScheduler()._lib.rl_layout_fingerprint() == layout.fingerprint()
