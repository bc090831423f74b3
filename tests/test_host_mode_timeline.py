"""Host-scheduled mode's bubble on the device's clock: the CPU scheduler's trace rows joined with
the rows its stamp kernels write around each replayed step (rl_host_step_begin/end, shared text
in sched_loop.h, run here by the CPU build), summarised by the one definition device mode uses."""

from __future__ import annotations

import numpy as np

from ringleader.device.backends.device_timeline import host_mode_rows, timeline_summary
from ringleader.device.backends.host_memory import HostMemory
from ringleader.ipc import layout
from tests.sched_driver import Driver, scheduler
from tests.test_persistent_loop import CFG  # the kernel loop's own tests' rings

F = layout.TraceField


def rows(arrays) -> np.ndarray:
    return arrays["trace"].reshape(-1, layout.TRACE_FIELDS)


def run_host_mode(n_requests: int = 3, max_tokens: int = 6):
    """The host loop's order: the CPU scheduler builds a step, the step layout goes up to the
    'device' (a second memory plan), the stamped graph's two kernels run around the step.
    Returns (host driver, device memory, steps run)."""
    host, device = Driver(CFG), HostMemory(CFG)
    for i in range(n_requests):
        host.submit(np.arange(1, 3 + i), max_tokens)
    steps = 0
    for _ in range(1000):
        status = host.step()
        if status == layout.StepStatus.RUN:
            device.arrays["step"][:] = host.a["step"]  # the packed layout copy's first array
            scheduler().host_step_stamp(device.context_address, end=False)
            scheduler().host_step_stamp(device.context_address, end=True)
            steps += 1
        elif host.rings.completions.pending() == 0:
            break
    return host, device, steps


def test_the_stamp_kernels_write_the_steps_device_row():
    host, device, steps = run_host_mode()
    assert steps > 5
    dev = rows(device.arrays)[:steps]
    assert list(dev[:, F.SEQ]) == list(range(1, steps + 1))  # the step's own seq, not a stale one
    assert (dev[:, F.STEP_END] >= dev[:, F.STEP_BEGIN]).all() and (dev[:, F.STEP_BEGIN] > 0).all()
    assert (dev[:, [F.SCHED_BEGIN, F.SCHED_END, F.FLAGS]] == 0).all()  # the host's row has those


def test_host_mode_rows_give_the_bubble_and_step_on_one_clock():
    host, device, steps = run_host_mode()
    merged = host_mode_rows(rows(host.a), rows(device.arrays))
    summary = timeline_summary(merged, one_clock=False)
    assert summary["timeline_steps"] == steps
    assert summary["bubble_gaps"] + summary["idle_gaps"] == steps - 1
    assert summary["bubble_gaps"] >= steps - 3  # decode steps follow each other: chained
    assert summary["bubble_us_p50"] >= 0 and summary["step_us_p50"] >= 0
    for mixed in ("handoff_us_p50", "launch_us_p50", "device_sched_us_p50", "overlap_overruns"):
        assert mixed not in summary  # host clock minus device clock would mean nothing
    assert timeline_summary(merged, after_seq=2, one_clock=False)["timeline_steps"] == steps - 2


def test_a_device_row_of_another_step_is_left_out():
    host, device, steps = run_host_mode()
    dev = rows(device.arrays)
    dev[3, F.SEQ] += 4096  # a row a later lap of the ring wrote
    merged = host_mode_rows(rows(host.a), dev)
    assert merged[3, F.STEP_BEGIN] == 0 and merged[3, F.STEP_END] == 0
    assert timeline_summary(merged, one_clock=False)["timeline_steps"] == steps - 1
    no_device = host_mode_rows(rows(host.a), np.zeros((0, layout.TRACE_FIELDS), dtype=np.uint64))
    assert timeline_summary(no_device, one_clock=False) == {}
