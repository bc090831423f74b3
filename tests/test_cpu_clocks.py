"""The host's CPU clocks (hostctl/serving/metrics.py): a thread's CPU from its schedstat and the
process's from CLOCK_PROCESS_CPUTIME_ID, both in nanoseconds, so a benchmark run of a second
reads more than a few 10-ms ticks; the clock-tick fallbacks where those are missing.

The spins are timed on the spinning thread's own CPU clock (time.thread_time), not the wall
clock, so a loaded machine makes them take longer but not burn less: the checks are about the
resolution and what is counted, never about speed."""

import os
import subprocess
import sys
import threading
import time

import pytest

from ringleader.hostctl.serving import metrics
from ringleader.hostctl.serving.metrics import pid_cpu_seconds, process_cpu_seconds, thread_cpu_seconds

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads Linux's /proc")

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def spin_cpu(seconds: float) -> None:
    """Burns `seconds` of this thread's own CPU."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def off_the_tick(seconds: float) -> bool:
    """Not a whole number of clock ticks: a tick-based reading of a delta always is."""
    ticks = seconds / TICK_S
    return abs(ticks - round(ticks)) > 1e-6


class Spinner:
    """A thread that burns what it is asked to and is parked (waiting on an event) in between,
    so readings taken while it waits are settled."""

    def __init__(self):
        self._go = threading.Event()
        self._done = threading.Event()
        self._seconds = 0.0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        while self._thread.native_id is None:
            time.sleep(0.001)
        self.tid = self._thread.native_id

    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            spin_cpu(self._seconds)
            self._done.set()

    def spin(self, seconds: float) -> None:
        self._seconds = seconds
        self._done.clear()
        self._go.set()
        assert self._done.wait(60)

    def close(self) -> None:
        self._stop = True
        self._go.set()
        self._thread.join(10)


@pytest.fixture
def spinner():
    s = Spinner()
    yield s
    s.close()


def test_a_thread_that_spins_30_ms_shows_about_30_ms(spinner):
    before = thread_cpu_seconds(spinner.tid)
    spinner.spin(0.030)
    used = thread_cpu_seconds(spinner.tid) - before
    assert 0.020 <= used <= 0.5, used


def test_a_thread_reading_resolves_a_2_ms_spin(spinner):
    """A tick-based reading would give 0 or 10 ms; schedstat gives about 2 ms."""
    before = thread_cpu_seconds(spinner.tid)
    spinner.spin(0.002)
    used = thread_cpu_seconds(spinner.tid) - before
    assert 0 < used < 0.010, used
    assert off_the_tick(used), used


def test_a_thread_can_read_itself():
    tid = threading.get_native_id()
    before = thread_cpu_seconds(tid)
    spin_cpu(0.003)
    used = thread_cpu_seconds(tid) - before
    assert 0 < used < 0.5 and off_the_tick(used), used


def test_a_thread_that_is_not_there_reads_none():
    assert thread_cpu_seconds(None) is None
    assert thread_cpu_seconds(2**31 + 12345) is None  # no such task: neither schedstat nor stat
    assert thread_cpu_seconds(-1) is None


def test_without_schedstat_a_thread_falls_back_to_its_stat_ticks(monkeypatch, spinner):
    spinner.spin(0.050)
    precise = thread_cpu_seconds(spinner.tid)
    real_open = open

    def no_schedstat(path, *args, **kwargs):
        if str(path).endswith("/schedstat"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(metrics, "open", no_schedstat, raising=False)
    ticks = thread_cpu_seconds(spinner.tid)
    assert ticks is not None and not off_the_tick(ticks), ticks
    assert abs(ticks - precise) <= 0.030, (ticks, precise)  # the same time, to a tick or two
    assert thread_cpu_seconds(2**31 + 12345) is None


def test_the_process_clock_grows_by_a_sub_tick_amount():
    before = process_cpu_seconds()
    spin_cpu(0.002)
    used = process_cpu_seconds() - before
    assert used >= 0.0018 and off_the_tick(used), used


def test_the_process_clock_counts_what_os_times_did():
    """Every thread of the process, ended ones included; not its child processes (those are
    os.times' children_user and children_system)."""
    t0, p0 = os.times(), process_cpu_seconds()
    worker = threading.Thread(target=spin_cpu, args=(0.100,))
    worker.start()
    worker.join()
    t1, p1 = os.times(), process_cpu_seconds()
    ours = p1 - p0
    assert ours >= 0.100
    assert abs(ours - ((t1.user + t1.system) - (t0.user + t0.system))) <= 0.030

    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    t2, p2 = os.times(), process_cpu_seconds()
    assert (t2.children_user + t2.children_system) - (t1.children_user + t1.children_system) >= 0.25
    assert p2 - p1 < 0.1, p2 - p1  # the fork and the wait, not the child's 0.3 s


def test_another_process_cpu_clock(monkeypatch):
    code = (
        "import sys, time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.05: pass\n"
        "print(time.process_time(), flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        own = float(child.stdout.readline())  # the child now waits on its stdin
        seen = pid_cpu_seconds(child.pid)
        assert own <= seen <= own + 0.05 and off_the_tick(seen), (own, seen)
        monkeypatch.setattr(metrics, "_cpu_clock_of", lambda pid: None)  # no CPU clock: /proc ticks
        ticks = pid_cpu_seconds(child.pid)
        assert ticks is not None and not off_the_tick(ticks) and abs(ticks - seen) <= 0.030
    finally:
        child.communicate("", timeout=60)
    assert pid_cpu_seconds(child.pid) is None  # reaped: gone
