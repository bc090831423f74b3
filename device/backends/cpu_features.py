"""What this CPU offers the CPU backend: its model, the vector extensions its kernels use, and how
many cores this process may run on (affinity and a cgroup's CPU quota), read once at start.

Every CPU figure the project reports names these (the start-up line, `ringleader doctor`, the
bench's machine record): the same build is 2-3x apart between an AVX2-only machine and one with
AVX-512 VNNI/BF16. Reads /proc and /sys only; imports nothing heavy.
"""

from __future__ import annotations

import functools
import math
import os
import platform
from dataclasses import dataclass

# the extensions the quantized and dense CPU kernels choose between, in the order a reader wants
# them named: (label, /proc/cpuinfo flags that must all be present)
ISA_FEATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("avx2", ("avx2", "fma")),
    ("f16c", ("f16c",)),
    ("avx_vnni", ("avx_vnni",)),
    ("avx512", ("avx512f", "avx512bw", "avx512vl")),
    ("avx512_vnni", ("avx512_vnni",)),
    ("avx512_bf16", ("avx512_bf16",)),
    ("amx", ("amx_tile", "amx_int8")),
    ("neon", ("asimd",)),
    ("dotprod", ("asimddp",)),
    ("i8mm", ("i8mm",)),
)


@dataclass(frozen=True)
class CpuFeatures:
    model: str  # "AMD EPYC", "Intel(R) Xeon(R) ...", or the platform's processor string
    machine: str  # x86_64, aarch64, ...
    flags: frozenset[str]  # the kernel's flag words (x86 "flags", ARM "Features")
    cores: int  # cores this process may run on: affinity, capped by the cgroup quota
    online: int  # cores the machine has online
    quota: float | None  # the cgroup's CPU quota in cores (None: no quota)

    @property
    def isa(self) -> list[str]:
        """The ISA_FEATURES labels this CPU has."""
        return [label for label, needs in ISA_FEATURES if all(f in self.flags for f in needs)]

    def has(self, label: str) -> bool:
        return label in self.isa

    def summary(self) -> str:
        """One line: `AMD EPYC (x86_64; avx2 f16c avx512 avx512_vnni avx512_bf16; 2 of 2 cores)`."""
        quota = f", quota {self.quota:g}" if self.quota is not None else ""
        isa = " ".join(self.isa) or "no vector extensions known here"
        return f"{self.model} ({self.machine}; {isa}; {self.cores} of {self.online} cores{quota})"

    def as_description(self) -> dict:
        return {
            "model": self.model,
            "machine": self.machine,
            "isa": self.isa,
            "cores": self.cores,
            "online": self.online,
            "quota": self.quota,
        }


def _cpuinfo() -> dict[str, str]:
    """The first processor's entry of /proc/cpuinfo (a machine's are alike); {} elsewhere."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cgroup_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in cores (v2 cpu.max, else v1 cfs quota/period);
    None without one."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, _, period = f.read().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def usable_cores(quota: float | None = None) -> int:
    """Cores this process may run on: its affinity set, capped by a quota (rounded up: a 1.5-core
    quota still runs two threads part of the time)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


@functools.cache
def cpu_features() -> CpuFeatures:
    info = _cpuinfo()
    flags = frozenset((info.get("flags") or info.get("Features") or "").split())
    model = info.get("model name") or info.get("Model") or platform.processor() or "unknown CPU"
    quota = cgroup_quota()
    return CpuFeatures(
        model=" ".join(model.split()),
        machine=platform.machine() or "unknown",
        flags=flags,
        cores=usable_cores(quota),
        online=os.cpu_count() or 1,
        quota=quota,
    )
