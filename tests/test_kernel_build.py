"""The scheduler's module build: CUBIN plus PTX, and the rule for falling back to the PTX when a
driver refuses the CUBIN (only PTX no newer than the driver accepts)."""

import pytest

from ringleader.device.backends.device_memory import LAYOUT_RUN, PINNED
from ringleader.device.sched.build import ptx_loadable
from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig, plan_memory


def test_build_carries_ptx_with_its_isa_and_the_nvrtc_version():
    pytest.importorskip("cuda.bindings.nvrtc")
    from ringleader.device.sched.build import compile_kernel, nvrtc_version

    build = compile_kernel("sm_90")
    assert (
        build.ptx.endswith(b"\x00")
        and build.ptx.rstrip(b"\x00").rstrip().endswith(b"}")
        and b".target sm_90" in build.ptx
    )
    assert build.nvrtc_version == nvrtc_version() and build.nvrtc_version >= (13, 0)
    major, minor = (int(x) for x in build.ptx_isa.split("."))
    assert major >= 9  # CUDA 13's PTX ISA
    assert b"rl_scheduler_persistent" in build.ptx and b"rl_step_wait" in build.ptx


@pytest.mark.parametrize(
    "nvrtc,driver,ok",
    [
        ((13, 0), (13, 0), True),
        ((13, 0), (13, 5), True),
        ((13, 5), (13, 0), False),
        ((12, 8), (13, 0), True),
        ((13, 1), (12, 9), False),
    ],
)
def test_ptx_fallback_needs_a_driver_at_least_as_new_as_nvrtc(nvrtc, driver, ok):
    allowed, why = ptx_loadable(nvrtc, driver)
    assert allowed is ok
    assert "%d.%d" % nvrtc in why and "%d.%d" % driver in why
    if not ok:
        assert "cuda-toolkit[nvrtc]==%d.%d.*" % driver in why


def test_the_layout_run_uploads_in_one_copy():
    """The host-scheduled baseline copies LAYOUT_RUN as one byte range: the run must be
    contiguous in ARRAYS order and sit at the same relative offsets in the all-host plan and in
    the device plan (everything but the pinned rings)."""
    names = [n for n, _, _ in layout.ARRAYS]
    i = names.index(LAYOUT_RUN[0])
    assert tuple(names[i : i + len(LAYOUT_RUN)]) == LAYOUT_RUN
    for cfg in (RingConfig(), RingConfig(n_slots=256, token_budget=512, pending_cap=1024)):
        host = plan_memory(cfg, set(names))
        dev = plan_memory(cfg, set(names) - set(PINNED))
        for n in LAYOUT_RUN:
            assert (
                host.offsets[n] - host.offsets[LAYOUT_RUN[0]] == dev.offsets[n] - dev.offsets[LAYOUT_RUN[0]]
            )
    assert "next_token" not in LAYOUT_RUN  # the step writes it; it comes back, not up


def test_every_ring_the_host_shares_is_pinned():
    """The host reaches these through pinned memory; cfg alone is copied up once, read-only."""
    assert set(PINNED) == set(layout.HOST_SHARED) - {"cfg"}
