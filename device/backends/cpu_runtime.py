"""What the CPU backend asks of the process's runtime once the model is in: the OpenMP team of
the loading thread released, and the heap the load freed returned to the system.

torch runs its parallel CPU ops on an OpenMP team per calling thread. GNU OpenMP (the libgomp
torch ships) counts the workers of every team alive in the process, and once they outnumber the
cores it stops letting idle workers spin: each parallel region then wakes its workers through the
kernel. The CPU backend loads the model on the thread that builds it (so the team of that thread
exists) and runs every step on its engine thread (a second team): on 2 cores a SmolLM2 decode
step took 31 ms instead of 17 ms (bench/results/2026-11-26-cpu-weights/). Releasing the building
thread's team once loading is done leaves the engine thread's team the only one.

Loading decodes and repacks every matrix through temporaries that glibc's allocator keeps for
reuse after they are freed: ~170 MB of SmolLM2's resident memory, never needed again.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os

log = logging.getLogger("ringleader.cpu")

OMP_PAUSE_HARD = 2  # OpenMP 5.0: release the caller's threads and resources


def release_callers_openmp_team() -> bool:
    """Frees the calling thread's OpenMP team (omp_pause_resource_all); True when the runtime
    took it. A runtime without the call (OpenMP < 5.0, or none) is left as it is."""
    import torch

    candidates = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))
    for path in [*candidates, None]:  # None: whatever the process has loaded
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        done = pause(OMP_PAUSE_HARD) == 0
        log.debug("OpenMP team of the loading thread %s", "released" if done else "kept (refused)")
        return done
    log.debug("no omp_pause_resource_all in this process: the loading thread's OpenMP team is kept")
    return False


def return_freed_heap() -> bool:
    """glibc's malloc_trim(0): freed heap pages back to the system; True when some were. A libc
    without it (musl, macOS) keeps them."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim(0) == 1
