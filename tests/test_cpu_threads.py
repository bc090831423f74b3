"""device/backends/cpu_threads.py and cpu_features.py: the CPU step's team follows the cores other
processes leave free, measured from /proc/stat, on the engine thread; the machine is named."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import ClassVar

import pytest
import torch

from ringleader.device.backends.cpu import CpuBackend
from ringleader.device.backends.cpu_features import cgroup_quota, cpu_features, usable_cores
from ringleader.device.backends.cpu_threads import CoreSample, ProcStatSampler, ThreadGovernor, threads_for
from ringleader.device.backends.eager_runner import EagerStepRunner
from ringleader.ipc.client import Client
from tests.conftest import running_server

needs_proc_stat = pytest.mark.skipif(not ProcStatSampler().available, reason="no /proc/stat here")


@pytest.mark.parametrize(
    "cores, others, current, most, want",
    [
        (2, 0.05, 2, 2, 2),  # a quiet machine keeps every core
        (2, 0.7, 2, 2, 1),  # one busy process beside a 2-thread team: give a core up
        (2, 1.0, 1, 2, 1),  # ... and stay there while it runs
        (2, 0.3, 1, 2, 1),  # hysteresis: 0.3 of a core still in use, the core stays given up
        (2, 0.3, 2, 2, 2),  # ... and is no reason to give one up
        (2, 0.05, 1, 2, 2),  # the neighbour is gone: the core is taken back
        (2, 1.4, 2, 2, 1),  # two busy processes: never fewer than one thread
        (8, 2.6, 8, 8, 5),  # 2.6 cores' worth of others on 8 cores: 3 given up
        (8, 0.0, 4, 4, 4),  # never above max_threads
    ],
)
def test_threads_for_gives_up_the_cores_others_use(cores, others, current, most, want):
    assert threads_for(cores, others, current, most) == want


class ScriptedSampler:
    """CoreSamples in the order given: the machine's use, as /proc/stat would report it."""

    available = True
    cores: ClassVar[set[int]] = {0, 1}

    def __init__(self, others_per_window: list[float], own_per_window: float = 1.5, wall: float = 1.0):
        self.samples = [CoreSample(0.0, 0.0, 0.0)]
        for others in others_per_window:
            last = self.samples[-1]
            self.samples.append(
                CoreSample(
                    last.busy_s + others + own_per_window, last.own_s + own_per_window, last.wall_s + wall
                )
            )

    def sample(self) -> CoreSample | None:
        return self.samples.pop(0) if self.samples else None


def test_the_governor_drops_and_takes_back_a_core_as_the_neighbour_comes_and_goes():
    applied: list[int] = []
    gov = ThreadGovernor(
        2, sampler=ScriptedSampler([0.02, 0.9, 1.0, 0.3, 0.05]), set_threads=applied.append, period_s=0
    )
    seen = []
    for _ in range(6):
        gov.before_step()
        seen.append(gov.threads)
    assert seen == [2, 2, 1, 1, 1, 2]  # first call: the team sized on this thread, no window yet
    assert applied == [2, 1, 2] and gov.changes == 2
    assert gov.figures()["cpu_threads"] == 2 and gov.describe() == "adaptive 1-2"


def test_a_fixed_team_and_a_period_not_yet_over_change_nothing():
    applied: list[int] = []
    fixed = ThreadGovernor(
        2, fixed=True, sampler=ScriptedSampler([1.0, 1.0]), set_threads=applied.append, period_s=0
    )
    for _ in range(3):
        fixed.before_step()
    assert applied == [2] and fixed.threads == 2 and fixed.describe() == "fixed 2"
    slow = ThreadGovernor(2, sampler=ScriptedSampler([1.0, 1.0]), set_threads=applied.append, period_s=3600)
    for _ in range(5):
        slow.before_step()
    assert slow.threads == 2 and slow.changes == 0  # one sample taken, the next an hour away


@needs_proc_stat
def test_the_sampler_sees_another_process_busy_and_not_our_own_work():
    sampler = ProcStatSampler()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the child is running
        a = sampler.sample()
        end = time.monotonic() + 0.6
        x = 0
        while time.monotonic() < end:  # our own work: counted as ours, not as others'
            x += 1
        b = sampler.sample()
    finally:
        busy.kill()
        busy.wait()
    assert a is not None and b is not None
    wall = b.wall_s - a.wall_s
    own = (b.own_s - a.own_s) / wall
    others = ((b.busy_s - a.busy_s) - (b.own_s - a.own_s)) / wall
    assert own > 0.3  # this thread spun for most of the window
    # on two cores the child gets at least a third of one; /proc/stat counts in 10 ms ticks
    assert others > 0.3, (own, others)


class ThreadsSeen(EagerStepRunner):
    """Records the team size torch reports on the thread that runs each step."""

    seen: ClassVar[list[int]] = []

    def finish(self) -> None:
        super().finish()
        type(self).seen.append(torch.get_num_threads())


class ObservedBackend(CpuBackend):
    runner_class = ThreadsSeen


@needs_proc_stat
@pytest.mark.skipif(usable_cores() < 2, reason="one core: the team is one thread already")
def test_the_engine_threads_team_shrinks_beside_a_busy_process():
    ThreadsSeen.seen = []
    with running_server("tiny", backend_cls=ObservedBackend, n_slots=2) as bg:
        gov = bg.server.backend.thread_governor
        gov.period_s = 0.1
        assert gov.max_threads == usable_cores() and gov.describe().startswith("adaptive")
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            with Client(bg.address, timeout=120) as c:
                deadline = time.monotonic() + 20
                while gov.threads == gov.max_threads and time.monotonic() < deadline:
                    c.generate(prompt_ids=[1, 5, 17], max_tokens=16, ignore_eos=True).wait()
                stats = c.stats()["device"]
        finally:
            busy.kill()
            busy.wait()
    # at least the busy child's core given up (more where other work shares the machine too)
    assert stats["cpu_threads"] < gov.max_threads and stats["cpu_thread_changes"] >= 1
    assert stats["cpu_others_cores"] > 0.4
    assert ThreadsSeen.seen[-1] == stats["cpu_threads"]  # the engine thread's own team, as torch says


def test_the_machine_is_named_with_its_extensions_and_cores():
    cpu = cpu_features()
    assert cpu.cores >= 1 and cpu.online >= 1 and cpu.model
    line = cpu.summary()
    assert cpu.model in line and f"{cpu.cores} of {cpu.online} cores" in line
    if "avx2" in cpu.flags and "fma" in cpu.flags:
        assert cpu.has("avx2") and "avx2" in line
    assert not cpu.has("no-such-extension")


def test_a_cgroup_quota_caps_the_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota(str(tmp_path)) == 1.5
    assert usable_cores(1.5) == min(2, usable_cores())
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(str(tmp_path)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(str(v1)) == 0.5 and usable_cores(0.5) == 1
