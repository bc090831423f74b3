"""The model step captured as one CUDA graph per token-count bucket, before anything persistent
runs (capture may synchronise).

Largest bucket first into one shared memory pool: the graphs only ever run one at a time on
one stream, so the smaller ones can reuse the largest one's intermediates instead of each
holding a private copy (at 256 slots and a 128k vocabulary the sampling scratch alone is about
a gigabyte per bucket).  The serving path never reads a graph's returned logits, so they are
dropped unless a check asks to keep them.
"""

from __future__ import annotations

import logging

import torch

from ringleader.device.backends import cuda_driver as drv
from ringleader.device.backends.cuda_graph_rules import GraphReport, check_conditional_body

log = logging.getLogger("ringleader.cuda")


class StepGraphs:
    def __init__(self, step, layout, buckets, stream: torch.cuda.Stream, keep_outputs: bool = False):
        self.buckets = tuple(sorted(buckets))
        self.step = step  # what the backend describes (its kernels); the graphs hold its memory anyway
        self._stream = stream
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> logits its replays write (checks only)
        with torch.cuda.stream(stream):
            step.warmup(layout, self.buckets)  # compiles kernels, initialises libraries
            stream.synchronize()
            pool = torch.cuda.graph_pool_handle()
            for b in sorted(self.buckets, reverse=True):
                g = torch.cuda.CUDAGraph(keep_graph=True)
                g.capture_begin(pool=pool, capture_error_mode="thread_local")
                logits = step.run(b, layout)
                g.capture_end()
                if keep_outputs:
                    self.outputs[b] = logits
                self._graphs[b] = g
            stream.synchronize()
        self.reports: dict[int, GraphReport] = {}

    def __getitem__(self, bucket: int) -> torch.cuda.CUDAGraph:
        return self._graphs[bucket]

    def raw(self, bucket: int):
        """The cudaGraph_t of a bucket (torch keeps it alive as long as this object lives)."""
        return self._graphs[bucket].raw_cuda_graph()

    def read(self, bucket: int):
        """The bucket's graph as the driver holds it: (GraphNode list, programmatic edges)."""
        return drv.read_graph(self.raw(bucket))

    def check_embeddable(self) -> dict[int, GraphReport]:
        """Reads every bucket's graph back from the driver and refuses, naming the bucket and
        the node types, anything a conditional body cannot hold."""
        for b in self.buckets:
            nodes, programmatic = self.read(b)
            self.reports[b] = check_conditional_body(nodes, b, programmatic)
            log.info("step graph of bucket %d: %s", b, self.reports[b].summary())
        return self.reports

    def describe(self) -> dict[str, str]:
        """Node counts per bucket, as check_embeddable() read them (for stats and the bring-up),
        keyed by the bucket as a string: the wire's map keys are strings."""
        return {str(b): r.summary() for b, r in self.reports.items()}

    def replay_each_once(self) -> None:
        """Replays each graph once on the all-pad layout the warm-up left (no samples; pad rows
        write the scratch page): a first replay instantiates and uploads the graph, so neither
        happens later, inside a measured run or beside a running kernel."""
        with torch.cuda.stream(self._stream):
            for b in self.buckets:
                self._graphs[b].replay()
            self._stream.synchronize()

    def replay(self, bucket: int) -> None:
        self._graphs[bucket].replay()
