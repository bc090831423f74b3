"""How the scheduler loop ends, on the CPU build of the same source the kernel runs: the stop
decision is read once per step (the GPU form broadcasts it to the block), recorded as
ctl.exit_reason, and published as state EXITED; a run budget ends it on its own."""

import threading
import time

import numpy as np

from ringleader.device.backends.host_memory import HostMemory
from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from tests.sched_driver import Driver, scheduler

CFG = RingConfig(
    n_slots=4, max_ctx=64, token_budget=16, sq_size=16, cq_size=256, arena_size=1024, pending_cap=32
)


def test_shutdown_ends_the_loop_with_reason_shutdown_and_state_exited():
    d = Driver(CFG)
    h = d.submit(np.arange(1, 6), 50)
    for _ in range(3):
        assert d.step() == layout.StepStatus.RUN
    ctl = d.a["ctl"][0]
    assert (
        int(ctl["state"]) == layout.SchedulerState.RUNNING
        and int(ctl["exit_reason"]) == layout.ExitReason.NONE
    )
    d.rings.request_shutdown()
    assert d.step() == layout.StepStatus.SHUTDOWN
    assert int(ctl["exit_reason"]) == layout.ExitReason.SHUTDOWN
    assert int(ctl["state"]) == layout.SchedulerState.EXITED
    assert d.rings.counters()["exit_reason_name"] == "shutdown"
    assert d.records[h].done == []  # the host, not the device, ends what was in flight


def _started(run_budget_ns: int) -> HostMemory:
    mem = HostMemory(CFG)
    mem.arrays["ctl"][0]["run_budget_ns"] = run_budget_ns
    mem.arrays["ctl"][0]["stop_grace_ns"] = 123
    assert scheduler().init(mem.context_address) == layout.InitError.NONE
    return mem


def test_run_budget_ends_the_loop_on_its_own():
    mem = _started(run_budget_ns=20_000_000)  # 20 ms
    assert scheduler().step(mem.context_address) == layout.StepStatus.IDLE
    assert int(mem.arrays["sched"][0]["stop_grace_ns"]) == 123  # copied once at init
    time.sleep(0.05)
    assert scheduler().step(mem.context_address) == layout.StepStatus.SHUTDOWN
    ctl = mem.arrays["ctl"][0]
    assert (
        int(ctl["exit_reason"]) == layout.ExitReason.BUDGET
        and int(ctl["state"]) == layout.SchedulerState.EXITED
    )


def test_no_budget_means_no_limit():
    mem = _started(run_budget_ns=0)
    time.sleep(0.02)
    assert scheduler().step(mem.context_address) == layout.StepStatus.IDLE
    assert int(mem.arrays["ctl"][0]["state"]) == layout.SchedulerState.RUNNING


def test_shutdown_reaches_a_scheduler_waiting_for_cq_room():
    cfg = RingConfig(
        n_slots=4, max_ctx=512, token_budget=16, sq_size=16, cq_size=64, arena_size=1024, pending_cap=32
    )
    d = Driver(cfg)
    for _ in range(4):
        d.submit(np.arange(1, 4), 400)
    while d.rings.completions.pending() + 4 <= cfg.cq_size:  # never drained: the CQ fills up
        assert d.step(drain=False) == layout.StepStatus.RUN
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("status", d.step(drain=False)))
    waiter.start()  # the GIL is released inside sched_step
    waiter.join(0.2)
    assert waiter.is_alive(), "with no CQ room the scheduler must wait, never drop events"
    assert int(d.a["ctl"][0]["cq_stalls"]) >= 1
    d.rings.request_shutdown()
    waiter.join(5)
    assert not waiter.is_alive() and result["status"] == layout.StepStatus.SHUTDOWN
    assert int(d.a["ctl"][0]["exit_reason"]) == layout.ExitReason.SHUTDOWN
    assert d.rings.completions.pending() <= cfg.cq_size  # nothing was written past the head
