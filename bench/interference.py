"""CPU interference: N busy processes competing with the server for the host's cores.

Each one is a pure-Python spin loop in its own process (multiprocessing, spawn start method so
it inherits none of this process's threads or sockets). They are started before a run and
stopped after it; the CPU time they got is read back from the operating system (each one's CPU
clock, in nanoseconds: hostctl.serving.metrics.pid_cpu_seconds), so a report can show that they
really were busy.

    with CpuInterference(2) as busy:
        ...run...
    busy.cpu_s  # CPU-seconds the spinners burned
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import time

from ringleader.hostctl.serving.metrics import pid_cpu_seconds

_CHECK_EVERY = 200_000  # spin iterations between looks at the stop flag (~10 ms of CPU)


def _spin(stop, started) -> None:
    started.set()
    x = 0
    while not stop.is_set():
        for i in range(_CHECK_EVERY):
            x ^= i
    os._exit(0)  # skip interpreter teardown: nothing to flush


_live: set[CpuInterference] = set()


@atexit.register
def _stop_all() -> None:
    for busy in list(_live):
        busy.stop()


class CpuInterference:
    """Context manager keeping `n` spin processes running; n = 0 does nothing."""

    def __init__(self, n: int, *, start_timeout_s: float = 30.0):
        if n < 0:
            raise ValueError("the number of busy processes must be >= 0")
        self.n = n
        self.start_timeout_s = start_timeout_s
        self.cpu_s: float | None = None  # CPU time the spinners used while running
        self.wall_s: float | None = None
        self._procs: list = []
        self._stop = None
        self._t0 = 0.0

    def start(self) -> CpuInterference:
        if self.n == 0:
            return self
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        started = [ctx.Event() for _ in range(self.n)]
        self._procs = [
            ctx.Process(target=_spin, args=(self._stop, ev), daemon=True, name=f"rl-bench-busy-{i}")
            for i, ev in enumerate(started)
        ]
        _live.add(self)
        for p in self._procs:
            p.start()
        for ev in started:  # they count only once they spin
            if not ev.wait(self.start_timeout_s):
                self.stop()
                raise RuntimeError("a busy process did not start")
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> None:
        _live.discard(self)
        if not self._procs:
            return
        self.wall_s = time.perf_counter() - self._t0
        cpu = [pid_cpu_seconds(p.pid) for p in self._procs]
        self.cpu_s = sum(c for c in cpu if c is not None) if all(c is not None for c in cpu) else None
        self._stop.set()
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
        self._procs = []

    def describe(self) -> dict:
        return {"busy_processes": self.n, "busy_cpu_s": self.cpu_s, "busy_wall_s": self.wall_s}

    def __enter__(self) -> CpuInterference:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
