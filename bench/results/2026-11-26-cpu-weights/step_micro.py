"""SmolLM2 decode steps outside the server: LlamaModel.step at 1, 8 and 16 rows (64-token
contexts), per weight form, on the thread that loaded the model and on a second thread before
and after the loading thread's OpenMP team is released (device/backends/cpu_runtime.py).

    python bench/results/2026-11-26-cpu-weights/step_micro.py fp32|quantized [--old-linear]

--old-linear runs the dense matrices through one F.linear each (before this change) instead of
the thread-split bmm."""

import sys
import threading
import time

import torch

from ringleader.bench.smollm2 import smollm2_path
from ringleader.device.backends.cpu_runtime import release_callers_openmp_team
from ringleader.device.model import LlamaModel, StepBatch

torch.set_num_threads(2)
form = {"fp32": "dense", "quantized": "quantized"}[sys.argv[1]]
model = LlamaModel.from_spec(str(smollm2_path()), weights=form)
if "--old-linear" in sys.argv:
    for m in model.modules():
        if hasattr(m, "splits"):
            m.splits = 1
    model._head_splits = 1


def steps(tag: str) -> None:
    with torch.inference_mode():
        for rows in (1, 8, 16):
            kv = model.new_kv_cache(rows, 256)
            model.step(StepBatch.from_segments([(s, list(range(100, 164)), 0) for s in range(rows)]), kv)
            times = []
            for i in range(12):
                t = time.perf_counter()
                model.step(StepBatch.from_segments([(s, [200], 64 + i) for s in range(rows)]), kv)
                times.append(time.perf_counter() - t)
            times = sorted(times[2:])
            print(f"{sys.argv[1]:9s} {tag:32s} {rows:2d} rows: p50 {times[5] * 1e3:6.1f} ms, min {times[0] * 1e3:6.1f} ms")


steps("loading thread")
t = threading.Thread(target=steps, args=("second thread",))
t.start()
t.join()
release_callers_openmp_team()
t = threading.Thread(target=steps, args=("second thread, team released",))
t.start()
t.join()
