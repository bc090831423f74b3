"""The scheduler source compiles with NVRTC for sm_90 as device code (no GPU needed), and the
CPU build of the same text agrees with the layout."""

import pytest

from device.sched.build import CpuScheduler, scheduler_source
from ipc import layout


def test_scheduler_compiles_with_nvrtc_for_sm90():
    pytest.importorskip("cuda.bindings.nvrtc")
    from device.sched.build import compile_kernel

    build = compile_kernel("sm_90")
    assert build.cubin[:4] == b"\x7fELF"
    assert set(build.resources) == {
        "rl_scheduler_persistent",
        "rl_step_wait",
        "rl_step_begin",
        "rl_step_signal",
    }
    for r in build.resources.values():
        assert r.registers is not None and r.registers <= 255 and r.spill_bytes == 0
    assert build.shared_bytes > 0  # the scheduler's block-shared scratch


def test_nvrtc_reports_a_broken_source():
    pytest.importorskip("cuda.bindings.nvrtc")
    import device.sched.build as b

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
