"""How many threads the CPU step runs on, decided from what the machine can give now.

torch runs a step's parallel ops on an OpenMP team of the engine thread. Its workers spin at
every op's barrier; when another process wants one of the cores, a worker (or the engine thread)
is descheduled mid-step and every op waits a scheduler time slice for it. Measured on 2 cores
(bench/results/2026-11-29-cpu-shared/): SmolLM2 fp32 at one stream made 40 tok/s alone and
1 tok/s beside one busy process with a 2-thread team (TPOT x68), against 25 tok/s beside it with
one thread. The team should hold only the cores nobody else is using.

`ThreadGovernor` samples, every `period_s`, the busy time of the cores this process may use
(/proc/stat, steal included: a VM's neighbours count too) less this process's own CPU time:
what the other processes used, in cores. It sizes the team to the cores left, with hysteresis,
from the engine thread between steps (torch.set_num_threads sets the calling thread's team).
Sampling costs ~30 us per period; between periods a check is one clock read.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("ringleader.cpu")

PERIOD_S = 0.5  # how often the cores' use is sampled: a change is followed within ~2 periods
DROP_AT = 0.4  # another process's use, in cores above the ones already given up, that takes a core
RAISE_AT = 0.15  # ... and below which a core given up is taken back (hysteresis: no flapping)


@dataclass(frozen=True)
class CoreSample:
    """Cumulative seconds at one instant: the busy time of the cores we may use, ours, the clock."""

    busy_s: float
    own_s: float
    wall_s: float


class ProcStatSampler:
    """CoreSample from /proc/stat (the rows of the cores in this process's affinity set) and this
    process's CPU clock. `available` is False where there is no /proc/stat."""

    def __init__(self, cores: set[int] | None = None, path: str = "/proc/stat"):
        try:
            self.cores = cores if cores is not None else set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cores = set(range(os.cpu_count() or 1))
        self.path = path
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.available = self._busy() is not None

    def _busy(self) -> float | None:
        try:
            with open(self.path) as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        ticks = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in self.cores:
                continue
            fields = [int(x) for x in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
            ticks += sum(fields) - fields[3] - fields[4]
        return ticks / self._tick

    def sample(self) -> CoreSample | None:
        busy = self._busy()
        if busy is None:
            return None
        return CoreSample(busy, time.process_time(), time.monotonic())


def threads_for(cores: int, others: float, current: int, max_threads: int) -> int:
    """The team size for `others` cores' worth of other processes' use on `cores` cores, given
    the team now has `current` threads: a core is given up once another process uses more than
    DROP_AT of it, and taken back once that use falls below RAISE_AT."""
    drop = cores - math.ceil(max(0.0, others - DROP_AT))
    keep = cores - math.ceil(max(0.0, others - RAISE_AT))
    target = drop if drop < current else max(current, keep)
    return max(1, min(max_threads, target))


class ThreadGovernor:
    """Keeps the engine thread's torch team at the cores other processes leave free."""

    def __init__(
        self,
        max_threads: int,
        *,
        fixed: bool = False,
        cores: int | None = None,
        sampler: ProcStatSampler | None = None,
        set_threads: Callable[[int], None] | None = None,
        period_s: float = PERIOD_S,
    ):
        self.max_threads = max(1, max_threads)
        self.fixed = fixed  # --threads N: the team stays at N
        self.sampler = sampler or ProcStatSampler()
        self.cores = cores if cores is not None else len(self.sampler.cores)
        self.period_s = period_s
        self._set_threads = set_threads
        self.threads = self.max_threads
        self.others = 0.0  # the last sample's other processes' use, in cores
        self.changes = 0
        self._last: CoreSample | None = None
        self._next_s = 0.0
        self._applied = False

    @property
    def adaptive(self) -> bool:
        return not self.fixed and self.sampler.available and self.max_threads > 1

    def before_step(self) -> None:
        """On the engine thread, before each step: re-sizes the team once a period has passed."""
        if not self._applied:  # the team belongs to the calling thread: size it there first
            self._applied = True
            self.apply()
        now = time.monotonic()
        if now < self._next_s or not self.adaptive:
            return
        self._next_s = now + self.period_s
        sample = self.sampler.sample()
        last, self._last = self._last, sample
        if sample is None or last is None or sample.wall_s - last.wall_s <= 0:
            return
        wall = sample.wall_s - last.wall_s
        self.others = max(0.0, (sample.busy_s - last.busy_s) - (sample.own_s - last.own_s)) / wall
        threads = threads_for(self.cores, self.others, self.threads, self.max_threads)
        if threads != self.threads:
            log.info(
                "other processes use %.2f of %d cores: the step's threads %d -> %d",
                self.others,
                self.cores,
                self.threads,
                threads,
            )
            self.threads = threads
            self.changes += 1
            self.apply()

    def apply(self) -> None:
        """Sets the calling thread's team to `threads` (the engine thread calls it first)."""
        if self._set_threads is not None:
            self._set_threads(self.threads)
            return
        import torch

        torch.set_num_threads(self.threads)

    def figures(self) -> dict:
        return {
            "cpu_threads": self.threads,
            "cpu_thread_changes": self.changes,
            "cpu_others_cores": round(self.others, 3),
        }

    def describe(self) -> str:
        if not self.adaptive:
            return f"fixed {self.threads}"
        return f"adaptive 1-{self.max_threads}"
