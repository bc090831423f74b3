"""The completion thread's routing of one step's CQ batch, in isolation: 256 started streams, ids
only, one connection (batched where the server knows how) and 256 connections."""
import sys, time, numpy as np
from ringleader.hostctl.serving.completions import CompletionRouter
from ringleader.hostctl.serving.inflight import RequestTable
from ringleader.hostctl.serving.metrics import ServerMetrics
from ringleader.ipc import layout
from ringleader.ipc.sampling_params import SamplingParams

def bench(connections: int) -> float:
    table = RequestTable()
    reqs = [table.add(b"c%d" % (i % connections), i, prompt_ids=np.zeros(4, np.int32), sampling=SamplingParams(seed=1), priority=0) for i in range(256)]
    for r in reqs:
        r.completion_tokens = 3; r.last_token_ns = time.perf_counter_ns()
        if hasattr(table, "make_hot"): table.make_hot(r)
    class Outbox:
        def wants_batch(self, c): return True
        def put_many(self, f): self.last = f
    r = CompletionRouter.__new__(CompletionRouter)
    r._table = table; r._outbox = Outbox(); r._metrics = ServerMetrics()
    ev = np.zeros(256, dtype=layout.CQ_EVENT.numpy_dtype())
    ev["handle"] = [q.handle for q in reqs]; ev["kind"] = layout.EventKind.TOKEN; ev["token"] = np.arange(256)
    best = 1e9
    for _ in range(5):
        N = 400
        t0 = time.thread_time()
        for _ in range(N): r._route(ev)
        best = min(best, (time.thread_time() - t0) / N)
    return best * 1e6, len(r._outbox.last)

for c in (1, 256):
    us, frames = bench(c)
    print(f"{sys.argv[1]} connections={c}: {us:.1f} us per step of 256 tokens ({us/256:.2f} us/token), {frames} frames")
