"""device/backends/cpu_runtime.py: the loading thread's OpenMP team released, and the load's
freed heap returned, leave torch computing as before on every thread."""

from __future__ import annotations

import threading

import torch

from ringleader.device.backends.cpu_runtime import release_callers_openmp_team, return_freed_heap


def test_released_team_leaves_torch_computing_on_every_thread():
    x = torch.arange(1 << 18, dtype=torch.float32)
    want = float(x.exp().log().sum())  # a parallel region on this thread: its team exists
    # torch's own libgomp implements OpenMP 5.0's pause: a False here means the engine thread's
    # steps run at half speed again beside this thread's team (cpu_runtime's docstring)
    assert release_callers_openmp_team()
    assert float(x.exp().log().sum()) == want  # this thread's next region builds a new team
    got: list[float] = []
    worker = threading.Thread(target=lambda: got.append(float(x.exp().log().sum())))
    worker.start()
    worker.join()
    assert got == [want]


def test_freed_heap_is_returned_without_harm():
    blocks = [torch.ones(1 << 20) for _ in range(32)]  # 128 MiB, then freed
    del blocks
    assert isinstance(return_freed_heap(), bool)
    assert float(torch.ones(1 << 20).sum()) == float(1 << 20)
