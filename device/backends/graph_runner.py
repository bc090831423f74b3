"""CUDA's host-scheduled StepRunner (engine_loop.py, `--scheduler host`): the packed layout copied
up in one async copy from pinned memory, the bucket's step graph replayed between its two stamp
kernels (launch_graph.HostStampedGraphs: the device trace gets each step's start and end), and
next_token (with logprobs when asked) copied back into pinned memory; all queued on the compute
stream, then one wait on a blocking-sync event (no spinning core)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ringleader.device.backends import cuda_driver as drv
from ringleader.device.backends.device_memory import PackedLayoutCopy
from ringleader.device.backends.device_timeline import TimelineReader, host_mode_rows
from ringleader.device.backends.launch_graph import HostStampedGraphs
from ringleader.ipc import layout


class GraphStepRunner:
    overlaps_host = True  # the overlapped phase runs on the CPU while the GPU computes

    def __init__(
        self, host_memory, device_memory, graphs, functions: dict, cu_ctx, compute: torch.cuda.Stream
    ):
        self._host_trace = host_memory.arrays["trace"]
        self._step_header = host_memory.arrays["step"]
        self._io = PackedLayoutCopy(host_memory, device_memory)
        self._cu_ctx, self._compute = cu_ctx, compute
        self._stream = drv.cu.CUstream(compute.cuda_stream)
        self._stamped = HostStampedGraphs(graphs, functions, device_memory.context_bytes(), self._stream)
        self._timeline = TimelineReader(device_memory)

    @contextlib.contextmanager
    def bound(self):
        drv.bind_context(self._cu_ctx)
        with torch.cuda.stream(self._compute):
            yield

    def launch(self) -> None:
        self._io.upload(self._stream)
        self._stamped.replay(int(self._step_header[0]["bucket"]), self._stream)
        self._io.download(self._stream)

    def finish(self) -> None:
        self._io.wait()

    def cancel(self) -> None:
        self._io.wait()  # queued device work cannot be dropped; the memory it uses is freed after

    def timeline(self) -> np.ndarray:
        """The CPU scheduler's rows (host clock) with each step's start and end from the device
        trace (the stamp kernels)."""
        return host_mode_rows(self._host_trace.reshape(-1, layout.TRACE_FIELDS), self._timeline.read())

    @property
    def stalled_reads(self) -> int:
        return self._timeline.stalled_reads

    def release(self) -> None:
        """Only once the engine thread has ended: nothing of ours is queued any more."""
        self._stamped.destroy()
        self._timeline.close()
