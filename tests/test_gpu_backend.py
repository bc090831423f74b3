"""The CUDA backend on a real GPU (skipped without one).  Evidence for the GPU backend issue:
parity device vs host vs transformers, 256 streams, abort, shutdown in flight, allocation while
the persistent kernel runs.  On CPU only the timeline arithmetic is checked."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from device.backends.cuda import default_buckets, timeline_summary, write_chrome_trace
from ipc import layout

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_buckets_cover_the_budget():
    assert default_buckets(512)[-1] == 512 and default_buckets(512)[0] == 1
    assert len(default_buckets(10**6)) <= layout.MAX_BUCKETS


def test_timeline_summary_and_chrome_trace(tmp_path):
    t = np.zeros((8, layout.RL_TRACE_FIELDS), dtype=np.uint64)
    base = 1_000_000
    for i in range(5):  # sched 2 us, step 10 us, bubble 3 us
        s = base + i * 15_000
        t[i] = (s, s + 2_000, s + 2_000, s + 12_000)
    summary = timeline_summary(t)
    assert summary["step_us_p50"] == pytest.approx(10.0)
    assert summary["device_sched_us_p50"] == pytest.approx(2.0)
    assert summary["bubble_us_p50"] == pytest.approx(5.0)  # 15 us period - 10 us step
    path = tmp_path / "trace.json"
    write_chrome_trace(str(path), t)
    events = json.loads(path.read_text())["traceEvents"]
    assert len(events) == 10 and {e["tid"] for e in events} == {"scheduler", "compute"}


def _serve(**kw):
    from tests.conftest import running_server
    from device.backends.cuda import CudaBackend
    kw.setdefault("n_slots", 256)
    kw.setdefault("max_ctx", 1024)
    kw.setdefault("token_budget", 512)
    return running_server(kw.pop("model", "tiny"), backend_cls=CudaBackend, **kw)


@gpu
@pytest.mark.parametrize("scheduler,launch", [("device", "resident"), ("device", "pump"), ("host", "resident")])
def test_gpu_greedy_parity_device_vs_host(scheduler, launch):
    from ipc.client import Client
    prompts = [[1, 2, 3], list(range(5, 60)), [7] * 9]
    with _serve(scheduler=scheduler, launch=launch, dtype=torch.float32) as bg:
        with Client(bg.address, timeout=120) as c:
            got = [c.complete(prompt_ids=p, max_tokens=24, ignore_eos=True).token_ids for p in prompts]
    from device.model import LlamaModel, generate_greedy
    ref = LlamaModel.from_preset("tiny", torch.float32, "cuda")
    assert got == [generate_greedy(ref, p, 24) for p in prompts]


@gpu
def test_gpu_256_streams_each_get_one_done():
    from tests.conftest import RawPeer
    from tests.test_server import collect
    with _serve() as bg:
        peer = RawPeer(bg.address)
        for i in range(256):
            peer.send({"op": "generate", "id": i, "prompt_ids": [1 + i % 200], "max_tokens": 8 + i % 32,
                       "ignore_eos": True})
        tokens, dones, ok = collect(peer, 256, timeout=300)
        peer.close()
    assert ok and len(dones) == 256 and all(len(v) == 1 for v in dones.values())
    assert all(len(tokens[i]) == 8 + i % 32 for i in range(256))


@gpu
def test_gpu_abort_shutdown_and_allocation_while_the_kernel_runs():
    from tests.conftest import RawPeer
    with _serve(server_options={"drain_timeout_s": 0.2}) as bg:
        peer = RawPeer(bg.address)
        peer.send({"op": "generate", "id": "a", "prompt_ids": [1], "max_tokens": 900, "ignore_eos": True})
        peer.recv_until(lambda m: m["op"] == "token")
        done = {}
        def alloc():  # a new size: the caching allocator must cudaMalloc while the kernel spins
            x = torch.empty(123_456_789, dtype=torch.uint8, device="cuda")
            done["ok"] = int(x.numel())
        t = threading.Thread(target=alloc)
        t.start()
        t.join(timeout=30)
        assert done.get("ok") == 123_456_789, "torch allocation hung while the scheduler kernel ran"
        peer.send({"op": "abort", "id": "a"})
        msgs = peer.recv_until(lambda m: m["op"] == "done")
        assert msgs[-1]["finish_reason"] == "abort"
        for i in range(4):
            peer.send({"op": "generate", "id": i, "prompt_ids": [1], "max_tokens": 900, "ignore_eos": True})
        peer.recv_until(lambda m: m["op"] == "token")
        stopper = threading.Thread(target=bg.stop)
        stopper.start()
        seen = {}
        deadline = time.monotonic() + 30
        while len(seen) < 4 and time.monotonic() < deadline:
            m = peer.recv(30)
            if m["op"] == "done":
                assert m["id"] not in seen
                seen[m["id"]] = m
        stopper.join()
        assert len(seen) == 4
