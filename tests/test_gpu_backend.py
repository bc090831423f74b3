"""The CUDA backend on a real GPU (skipped without one or without cuda-bindings): every launch
mode asserted, parity with an eager reference, the device timeline filled, a bounded stop,
256 streams, abort, shutdown in flight, allocation and free while the persistent kernel runs,
and a kernel that ends on its own becoming engine_dead.  On a CPU only the timeline arithmetic
is checked.  Run each test in a process of its own on a first GPU run (bench/lab/gpu_bringup.py
does): a kernel left behind would hang the next test's device-wide synchronisation."""

from __future__ import annotations

import importlib.util
import json
import threading
import time

import numpy as np
import pytest
import torch

from ringleader.device.backends.cuda import default_buckets
from ringleader.device.backends.device_timeline import TimelineReader, timeline_summary, write_chrome_trace
from ringleader.ipc import layout

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cuda.bindings") is None,
    reason="needs a CUDA GPU and cuda-bindings",
)


def test_buckets_cover_the_budget():
    assert default_buckets(512)[-1] == 512 and default_buckets(512)[0] == 1
    assert len(default_buckets(10**6)) <= layout.MAX_BUCKETS


def _row(seq, sched_begin, sched_us, launch_us, step_us, overlap_us, chained):
    f, us = layout, 1_000
    r = np.zeros(f.TRACE_FIELDS, dtype=np.uint64)
    r[f.TraceField.SCHED_BEGIN] = sched_begin
    r[f.TraceField.SCHED_END] = sched_begin + sched_us * us
    r[f.TraceField.STEP_BEGIN] = r[f.TraceField.SCHED_END] + launch_us * us
    r[f.TraceField.STEP_END] = r[f.TraceField.STEP_BEGIN] + step_us * us
    r[f.TraceField.OVERLAP_BEGIN] = r[f.TraceField.SCHED_END] + 100
    r[f.TraceField.OVERLAP_END] = r[f.TraceField.OVERLAP_BEGIN] + overlap_us * us
    r[f.TraceField.FLAGS] = f.TraceFlag.CHAINED if chained else 0
    r[f.TraceField.SEQ] = seq + 1
    return r


def test_timeline_bubble_counts_only_chained_gaps(tmp_path):
    """Steps of 10 us, each built in 2 us and started 1 us after the hand-off, the scheduler
    waking 1 us after a step ends: a 4 us bubble.  After step 4 the scheduler goes idle for a
    millisecond (client think time): that gap is an idle gap, not a bubble.  Step 7's
    overlapped phase (15 us) outlasts its step."""
    t = np.zeros((16, layout.TRACE_FIELDS), dtype=np.uint64)
    at = 1_000_000
    for seq in range(10):
        chained = seq not in (0, 5)
        if seq == 5:
            at += 1_000_000
        t[seq + 3] = _row(seq, at, 2, 1, 10, 15 if seq == 7 else 3, chained)  # ring offset: rows sort by seq
        at = int(t[seq + 3][layout.TraceField.STEP_END]) + 1_000
        if seq == 7:
            at += 5_000  # the overrun delays the next critical phase: a real bubble
    t[15] = t[2]  # an all-zero row stays out
    t[14, layout.TraceField.SCHED_BEGIN] = 5  # a half-written row stays out
    summary = timeline_summary(t)
    assert summary["timeline_steps"] == 10
    assert summary["step_us_p50"] == pytest.approx(10.0)
    assert summary["device_sched_us_p50"] == pytest.approx(2.0)
    assert summary["bubble_gaps"] == 8 and summary["idle_gaps"] == 1
    assert summary["bubble_us_p50"] == pytest.approx(4.0)
    assert summary["bubble_us_p99"] > 8.0  # the gap after the overrun: 4 + 5 us
    assert summary["handoff_us_p50"] == pytest.approx(1.0) and summary["launch_us_p50"] == pytest.approx(1.0)
    assert summary["overlap_overruns"] == 1
    path = tmp_path / "trace.json"
    write_chrome_trace(str(path), t)
    events = json.loads(path.read_text())["traceEvents"]
    assert len(events) == 30
    assert {e["tid"] for e in events} == {"scheduler: critical", "scheduler: overlapped", "compute"}


class _StandInCopies:
    """cuda_driver's part that TimelineReader uses, over host memory: while `hold` is set a copy
    lands only once `land()` is called, as a copy queued behind a never-ending launch would
    never land; otherwise at once."""

    class PinnedBuffer:
        def __init__(self, nbytes):
            self.array = np.zeros(nbytes, dtype=np.uint8)
            self.host_ptr = self.array.ctypes.data

    def __init__(self, source: np.ndarray):
        self.source, self.copies, self.landed, self.hold = source, 0, False, True
        self._pending = None

    def create_stream(self, highest_priority):
        return "timeline-stream"

    def copy_to_host(self, dst_ptr, src_ptr, nbytes, stream):
        self.copies += 1
        self._pending = (dst_ptr, src_ptr, nbytes)
        self.landed = False
        if not self.hold:
            self.land()

    def land(self):
        import ctypes

        dst, src, n = self._pending
        ctypes.memmove(dst, src, n)
        self.landed = True

    def stream_done(self, stream):
        return self.landed


def test_timeline_read_waits_a_bounded_time_and_never_copies_over_a_copy_in_flight():
    trace = np.arange(4 * layout.TRACE_FIELDS, dtype=np.uint64)
    memory = type(
        "StandInMemory",
        (),
        {"device_nbytes": {"trace": trace.nbytes}, "address": lambda self, name: trace.ctypes.data},
    )()
    drv = _StandInCopies(trace)
    reader = TimelineReader(memory, wait_s=0.05, driver=drv)
    t0 = time.monotonic()
    assert reader.read().shape == (0, layout.TRACE_FIELDS)  # the copy never landed: no rows, no hang
    assert time.monotonic() - t0 < 1.0 and reader.stalled_reads == 1 and drv.copies == 1
    assert len(reader.read()) == 0 and reader.stalled_reads == 2 and drv.copies == 1  # no second copy
    drv.land()
    rows = reader.read()  # the first copy landed since: its rows, without copying again
    assert drv.copies == 1 and np.array_equal(rows.ravel(), trace)
    drv.hold = False  # an ordinary read: one copy, landed at once
    rows = reader.read()
    assert drv.copies == 2 and reader.stalled_reads == 2
    reader.close()
    assert len(reader.read()) == 0 and drv.copies == 2


def _serve(**kw):
    from ringleader.device.backends.cuda import CudaBackend
    from tests.conftest import running_server

    kw.setdefault("n_slots", 256)
    kw.setdefault("max_ctx", 1024)
    kw.setdefault("token_budget", 512)
    kw.setdefault("run_budget_s", 300.0)  # a kernel left behind ends on its own
    return running_server(kw.pop("model", "tiny"), backend_cls=CudaBackend, **kw)


@gpu
@pytest.mark.parametrize(
    "scheduler,launch",
    [("device", "pingpong"), ("device", "resident"), ("device", "pump"), ("host", "auto")],
    ids=["device-pingpong", "device-resident", "device-pump", "host-loop"],
)
def test_gpu_mode_parity_timeline_and_stop(scheduler, launch):
    from ringleader.bench.lab.bringup_checks import check_backend

    f = check_backend(scheduler, launch)
    assert f["launch_running"] == ("host-loop" if scheduler == "host" else launch), f["description"]
    assert f["parity"], f"greedy tokens differ from the eager reference for prompts {f['mismatched_prompts']}"
    assert f["streams_one_done_each"] and f["streams_tokens_ok"], f
    timed = ["bubble_us_p50", "bubble_us_p99", "step_us_p50"]  # host mode: its stamp kernels
    if scheduler == "device":
        assert f["exit_reason"] == "shutdown" and f["state"] == "exited", f
        timed.append("device_sched_us_p50")
        d = f["description"]  # --step-signal auto: the signal in the step graphs, not a fallback
        assert d.get("step_signal") == "in-step", (d.get("step_signal"), d.get("step_signal_fallback"))
    else:  # the CPU's phases and the device's stamps are on two clocks: no mixed figure
        assert f["device"]["handoff_us_p50"] is None and f["device"]["launch_us_p50"] is None, f
    for k in timed:
        assert f["device"][k] is not None and f["device"][k] >= 0, (k, f["device"])
    assert f["stop_s"] < 5.0, f


@gpu
@pytest.mark.parametrize("scheduler", ["device", "host"])
def test_gpu_prefix_caching_serves_the_cpu_backends_tokens_and_hits(scheduler):
    """Prefix caching on the device: requests sharing a 48-token prefix, one after another so the
    later ones can reuse the first one's pages, get the greedy tokens of the CPU backend with
    prefix caching off, and the device counts the shared pages as hits."""
    from ringleader.ipc.client import Client
    from tests.conftest import running_server

    prefix = list(range(7, 55))
    asks = [dict(prompt_ids=prefix + [60 + i, 61 + i], max_tokens=8, ignore_eos=True) for i in range(4)]

    def answers(bg):
        with Client(bg.address, timeout=120) as c:
            return [c.complete(**a) for a in asks], c.stats()

    with _serve(dtype="float32", scheduler=scheduler, prefix_caching=True) as bg:
        (gpu_streams, stats) = answers(bg)
    with running_server("tiny", dtype="float32", n_slots=8, max_ctx=1024, prefix_caching=False) as bg:
        cpu_streams, _ = answers(bg)
    for got, want in zip(gpu_streams, cpu_streams):
        assert got.done.ok and got.choices[0].token_ids == want.choices[0].token_ids
    hits = stats["device"]["prefix_cache_hits"]
    assert hits >= 16 * (len(asks) - 1), stats["device"]  # at least a full page each after the first


@gpu
def test_gpu_256_streams_each_get_one_done():
    from tests.conftest import RawPeer
    from tests.test_server import collect

    with _serve() as bg:
        peer = RawPeer(bg.address)
        for i in range(256):
            peer.send(
                {
                    "op": "generate",
                    "id": i,
                    "prompt_ids": [1 + i % 200],
                    "max_tokens": 8 + i % 32,
                    "ignore_eos": True,
                }
            )
        tokens, dones, ok = collect(peer, 256, timeout=300)
        peer.close()
    assert ok and len(dones) == 256 and all(len(v) == 1 for v in dones.values())
    assert all(len(tokens[i]) == 8 + i % 32 for i in range(256))


def _while_streaming(bg, op, timeout: float = 30.0) -> bool:
    """Runs `op` on a thread while a request streams; True if it finished within `timeout`."""
    done = threading.Event()

    def run():
        op()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout)


@gpu
@pytest.mark.parametrize("launch", ["resident", "pingpong"])
def test_gpu_allocation_while_the_kernel_runs(launch):
    from tests.conftest import RawPeer

    with _serve(launch=launch) as bg:
        peer = RawPeer(bg.address)
        peer.send({"op": "generate", "id": "a", "prompt_ids": [1], "max_tokens": 900, "ignore_eos": True})
        peer.recv_until(lambda m: m["op"] == "token")
        # a size never asked before: the caching allocator must cudaMalloc beside the kernel
        ok = _while_streaming(bg, lambda: torch.empty(123_456_789, dtype=torch.uint8, device="cuda"))
        assert ok, "a new torch allocation hung while the scheduler kernel ran"
        peer.send({"op": "abort", "id": "a"})
        assert peer.recv_until(lambda m: m["op"] == "done")[-1]["finish_reason"] == "abort"


@gpu
@pytest.mark.parametrize("launch", ["resident", "pingpong"])
def test_gpu_free_while_the_kernel_runs_waits_and_stop_releases_it(launch):
    """cudaFree synchronises the device, so it waits while the persistent kernel runs (seen on an
    H100 on 2026-11-25: bench/results/2026-11-25-h100-bringup); the server therefore frees no device
    memory before the kernel has ended.  This checks that a free someone else started beside the
    kernel deadlocks nothing: the request in flight still streams to its one done (the kernel and
    the step graphs go on), stop ends the kernel, and the free returns then."""
    from tests.conftest import RawPeer

    freed = threading.Event()

    def alloc_then_free():
        x = torch.empty(98_765_432, dtype=torch.uint8, device="cuda")
        del x
        torch.cuda.empty_cache()  # frees the cached block the allocation left
        freed.set()

    with _serve(launch=launch) as bg:
        peer = RawPeer(bg.address)
        peer.send({"op": "generate", "id": "a", "prompt_ids": [1], "max_tokens": 900, "ignore_eos": True})
        peer.recv_until(lambda m: m["op"] == "token")
        threading.Thread(target=alloc_then_free, daemon=True).start()
        print(f"cudaFree beside the running kernel returned within 2 s: {freed.wait(2.0)}")
        peer.send({"op": "abort", "id": "a"})  # on an H100 the 900 tokens may be done already
        msgs = peer.recv_until(lambda m: m["op"] == "done")
        assert msgs[-1]["finish_reason"] in ("abort", "length"), msgs[-1]
        assert not [m for m in peer.quiet_for(0.3) if m["op"] == "done"], "a second done"
        bg.stop()
    assert freed.wait(30), "torch.cuda.empty_cache() (cudaFree) still waited after the server stopped"


@gpu
@pytest.mark.parametrize("launch", ["resident", "pingpong"])
def test_gpu_kernel_that_ends_on_its_own_becomes_engine_dead(launch):
    """The run budget (3 s) ends the kernel while requests keep coming: on an H100 one
    1000-token request on `tiny` finishes well inside 3 s, so requests follow one another until
    one ends with engine_dead naming the budget; each gets exactly one done."""
    from tests.conftest import RawPeer

    with _serve(launch=launch, run_budget_s=3.0, server_options={"watchdog_s": 2.0}) as bg:
        peer = RawPeer(bg.address)
        deadline = time.monotonic() + 30
        dones: list[dict] = []
        while time.monotonic() < deadline and not (dones and "error" in dones[-1]):
            rid = len(dones)
            peer.send(
                {"op": "generate", "id": rid, "prompt_ids": [1], "max_tokens": 1000, "ignore_eos": True}
            )
            msgs = peer.recv_until(lambda m: m["op"] == "done", timeout=30)
            assert [m["id"] for m in msgs if m["op"] == "done"] == [rid], msgs[-1]
            dones.append(msgs[-1])
        last = dones[-1]
        assert last.get("error", {}).get("code") == "engine_dead", last
        assert "exited on its own" in last["error"]["message"] and "budget" in last["error"]["message"], last
        assert all(d["finish_reason"] == "length" for d in dones[:-1]), dones


@gpu
def test_gpu_abort_and_shutdown_in_flight():
    from tests.conftest import RawPeer

    with _serve(server_options={"drain_timeout_s": 0.2}) as bg:
        peer = RawPeer(bg.address)
        peer.send({"op": "generate", "id": "a", "prompt_ids": [1], "max_tokens": 900, "ignore_eos": True})
        peer.recv_until(lambda m: m["op"] == "token")
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


@gpu
@pytest.mark.parametrize("scheduler", ["device", "host"])
def test_gpu_logprobs_and_choices_match_the_cpu_backend(scheduler):
    """The CUDA graph's Triton logprobs kernel and the n fan-out against the CPU backend's torch
    forms, fp32: the same greedy tokens, the same logprobs to 1e-3, the same seeded choices."""
    from ringleader.ipc.client import Client
    from tests.conftest import running_server

    prompt = list(range(5, 45))
    asks = [
        dict(prompt_ids=prompt, max_tokens=12, ignore_eos=True, logprobs=5),
        dict(prompt_ids=prompt, max_tokens=8, ignore_eos=True, n=3, seed=9, temperature=1.0, logprobs=0),
        dict(prompt_ids=prompt, max_tokens=8, ignore_eos=True, repetition_penalty=1.3, logprobs=20),
    ]

    def answers(bg):
        with Client(bg.address, timeout=120) as c:
            return [c.complete(**a) for a in asks]

    with _serve(dtype="float32", scheduler=scheduler) as bg:
        gpu_streams = answers(bg)
    with running_server("tiny", dtype="float32", n_slots=8, max_ctx=1024) as bg:
        cpu_streams = answers(bg)
    for got, want in zip(gpu_streams, cpu_streams):
        assert got.done.ok and len(got.choices) == len(want.choices)
        for g, w in zip(got.choices, want.choices):
            assert g.token_ids == w.token_ids
            for eg, ew in zip(g.logprobs, w.logprobs):
                assert abs(eg.logprob - ew.logprob) < 1e-3
                np.testing.assert_allclose(eg.top_logprobs, ew.top_logprobs, atol=1e-3)


@gpu
@pytest.mark.parametrize("scheduler", ["device", "host"])
def test_gpu_structured_output_matches_the_cpu_backend(scheduler):
    """Constrained requests on CUDA (the grammar array in device memory, the masks in the Triton
    samplers, fused and layered, the scheduler kernel's automaton walk) give the CPU backend's
    tokens, fp32, greedy and seeded, and every answer obeys its constraint."""
    pytest.importorskip("outlines_core")
    import re

    from ringleader.ipc.client import Client
    from tests.conftest import running_server

    name_rx = "[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}"
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
    }
    asks = [
        dict(prompt="Name:", structured={"regex": name_rx}, max_tokens=24),
        dict(
            prompt="Pick:",
            structured={"choice": ["alpha", "beta", "gamma"]},
            max_tokens=8,
            n=3,
            seed=5,
            temperature=1.0,
        ),
        dict(prompt="JSON:", structured={"json": schema}, max_tokens=64, temperature=0.8, seed=3, logprobs=2),
        dict(prompt_ids=list(range(5, 45)), max_tokens=8, ignore_eos=True),  # beside them, unconstrained
    ]

    def answers(bg):
        with Client(bg.address, timeout=120) as c:
            streams = [c.generate(**a) for a in asks]  # all in flight together
            for stream in streams:
                stream.wait()
            return streams

    with _serve(dtype="float32", scheduler=scheduler) as bg:
        gpu_streams = answers(bg)
    with running_server("tiny", dtype="float32", n_slots=8, max_ctx=1024) as bg:
        cpu_streams = answers(bg)
    for got, want in zip(gpu_streams, cpu_streams):
        assert got.done.ok and [g.token_ids for g in got.choices] == [w.token_ids for w in want.choices]
    assert re.fullmatch(name_rx, gpu_streams[0].text) and gpu_streams[0].done.finish_reason == "stop"
    assert {c.text for c in gpu_streams[1].choices} <= {"alpha", "beta", "gamma"}
    doc = json.loads(gpu_streams[2].text)
    assert list(doc) == ["id", "ok"] and 0 <= doc["id"] <= 99 and isinstance(doc["ok"], bool)


@gpu
@pytest.mark.parametrize(
    "scheduler,launch",
    [("device", "pingpong"), ("device", "resident"), ("device", "pump"), ("host", "auto")],
    ids=["device-pingpong", "device-resident", "device-pump", "host-loop"],
)
def test_gpu_null_model_in_every_mode(scheduler, launch):
    """--model null on CUDA: its step graph is one kernel node per bucket (device scheduler), its
    tokens follow the pattern in every mode with the CPU backend's logprobs records, 256 streams
    each end once, and --null-step-us holds each step at least that long on the device."""
    from ringleader.device.null.null_model import pattern_table, record_logprobs
    from ringleader.device.text.tokenizer import ByteTokenizer
    from ringleader.ipc.client import Client

    with _serve(model="null", scheduler=scheduler, launch=launch, null_step_us=50.0) as bg:
        with Client(bg.address, timeout=120) as c:
            streams = [
                c.generate(prompt_ids=[1 + i, 10 + i], max_tokens=8 + i % 24, ignore_eos=True)
                for i in range(256)
            ]
            for s in streams:
                list(s)
            probe = c.complete(prompt_ids=[300], max_tokens=4, logprobs=3)
            stats = c.stats()
    vocab = stats["model_info"]["vocab_size"]
    follows = pattern_table("next", vocab, [ByteTokenizer.EOS]).tolist()  # t+1, skipping the EOS id
    skips = 0
    for i, s in enumerate(streams):
        want, last = [], 10 + i
        for _ in range(8 + i % 24):
            last = follows[last]
            want.append(last)
        assert s.done.ok and s.token_ids == want, i
        skips += want[-1] - want[0] >= len(want)  # this stream stepped over the EOS id
    assert skips > 0
    token_lp, _ = record_logprobs(vocab)
    assert probe.token_ids == [301, 302, 303, 304] and probe.logprobs[0].top_ids == [301, 0, 1]
    assert probe.logprobs[0].logprob == pytest.approx(token_lp, abs=1e-6)
    backend = stats["backend"]
    assert backend["launch"] == ("host-loop" if scheduler == "host" else launch), backend
    if scheduler == "device":
        assert set(backend["step_graph_nodes"].values()) == {"1 kernel"}, backend["step_graph_nodes"]
        assert stats["device"]["step_us_p50"] >= 50.0, stats["device"]
