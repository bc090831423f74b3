"""A load point's own device timeline (protocol 1.6): `stats.timeline_after_seq` on the wire (its
decoding, its refusal by name on a real server that then keeps serving), through the clients and
the server to Backend.stats, timeline_summary over the rows after it (synthetic trace rows, no
GPU), and the benchmark asking, after each run, for the steps after the `steps` counter it read
before, and recording what the timeline covered."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest

from ringleader.bench.client_loadgens import measure_python_async, measure_python_sync
from ringleader.bench.loadgen import Load, LoadGenerator, RunResult, SendOptions, measure, timeline_after_seq
from ringleader.bench.report import make_run_entry, timeline_warnings
from ringleader.bench.servers import device_deltas
from ringleader.bench.workloads import RequestSpec
from ringleader.device.backends.cpu import CpuBackend
from ringleader.device.backends.device_timeline import timeline_summary, write_chrome_trace
from ringleader.ipc import layout
from ringleader.ipc import protocol as P
from ringleader.ipc.client import AsyncClient, Client
from tests.conftest import RawPeer, running_server

F = layout.TraceField
BAD_VALUES = [-1, 1.5, True, "3", [1], {"a": 1}, 2**63]


class TimelineRecorder(CpuBackend):
    """The CPU backend (no device timeline), keeping every timeline_after_seq stats() is given
    and reporting, as CUDA's does, the steps after it (timeline_steps)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[int] = []

    def stats(self, timeline_after_seq: int = 0) -> dict:
        self.asked.append(timeline_after_seq)
        out = super().stats(timeline_after_seq)
        out["timeline_steps"] = max(0, out["steps"] - timeline_after_seq)
        return out


@pytest.fixture(scope="module")
def recorder():
    with running_server("null", backend_cls=TimelineRecorder) as bg:
        yield bg


# ---------------------------------------------------------------- the wire


def test_the_field_decodes_and_is_optional():
    decode = lambda msg: P.decode_request(P.encode(msg))  # noqa: E731
    assert decode({"op": "stats"}) == P.StatsRequest(0)
    assert decode({"op": "stats", "timeline_after_seq": None}) == P.StatsRequest(0)
    assert decode({"op": "stats", "timeline_after_seq": 4096}) == P.StatsRequest(4096)
    assert decode({"op": "stats", "timeline_after_seq": 2**63 - 1}).timeline_after_seq == 2**63 - 1
    assert P.stats_request_msg() == P.stats_request_msg(0) == {"op": "stats"}  # the 1.5 frame
    assert P.stats_request_msg(7) == {"op": "stats", "timeline_after_seq": 7}
    for req in (P.StatsRequest(), P.StatsRequest(12)):
        assert P.decode_request(P.encode_request(req)) == req


@pytest.mark.parametrize("bad", BAD_VALUES, ids=repr)
def test_a_bad_value_is_a_frame_error_naming_the_field(bad):
    with pytest.raises(P.FrameError) as info:
        P.decode_request(P.encode({"op": "stats", "timeline_after_seq": bad}))
    assert str(info.value).startswith("stats: timeline_after_seq: must be an int in [0, 2^63), got ")
    assert P.reject_msg(info.value)["code"] == P.ERR_BAD_REQUEST


# ---------------------------------------------------------------- a real server


def test_the_server_passes_the_field_to_the_backend(recorder):
    backend = recorder.server.backend
    peer = RawPeer(recorder.address)
    try:
        peer.send({"op": "stats", "timeline_after_seq": 3})
        reply = peer.recv_until(lambda m: m["op"] == "stats")[-1]
        assert backend.asked[-1] == 3 and reply["protocol"] == "1.10"
        peer.send({"op": "stats"})  # an older client's frame
        peer.recv_until(lambda m: m["op"] == "stats")
        assert backend.asked[-1] == 0
    finally:
        peer.close()


def test_a_bad_value_is_refused_by_name_and_the_server_keeps_serving(recorder):
    peer = RawPeer(recorder.address)
    try:
        for bad in BAD_VALUES:
            peer.send({"op": "stats", "timeline_after_seq": bad})
            err = peer.recv()
            assert err["op"] == "error" and err["code"] == "bad_request" and err["id"] is None
            assert err["message"].startswith("stats: timeline_after_seq: "), err
        # the same connection: a stats with a good value, a generate, a ping
        peer.send({"op": "stats", "timeline_after_seq": 1})
        assert peer.recv()["op"] == "stats"
        peer.send({"op": "generate", "id": "after", "prompt_ids": [5, 40], "max_tokens": 3})
        done = peer.recv_until(lambda m: m["op"] == "done")[-1]
        assert done["id"] == "after" and done["finish_reason"] == "length"
        peer.ping()
    finally:
        peer.close()
    assert recorder.server.stats()["bad_frames"] >= len(BAD_VALUES)


def test_the_clients_send_it_and_refuse_a_bad_value_before_sending(recorder):
    backend = recorder.server.backend
    with Client(recorder.address, timeout=30) as c:
        c.stats(timeline_after_seq=5)
        assert backend.asked[-1] == 5
        c.stats()
        assert backend.asked[-1] == 0
        for bad in (-1, 1.5, True, "3"):
            with pytest.raises(ValueError, match="timeline_after_seq"):
                c.stats(timeline_after_seq=bad)
        assert c.ping() > 0  # no waiter was left behind: the next calls are answered
        assert "steps" in c.stats(timeout=10)["device"]

    async def go():
        async with AsyncClient(recorder.address, timeout=30) as c:
            await c.stats(timeline_after_seq=9)
            assert backend.asked[-1] == 9
            with pytest.raises(ValueError, match="timeline_after_seq"):
                await c.stats(timeline_after_seq=-2)
            await c.stats()
            assert backend.asked[-1] == 0

    asyncio.run(go())

    async def loadgen():
        async with LoadGenerator(recorder.address) as gen:
            await gen.stats(timeline_after_seq=11)
            assert backend.asked[-1] == 11
            await gen.stats(timeline_after_seq=None)
            assert backend.asked[-1] == 0

    asyncio.run(loadgen())


def test_the_stats_command_takes_it(recorder):
    cli = [sys.executable, "-m", "ringleader.hostctl.cli", "stats", "--connect", recorder.address]
    r = subprocess.run(cli + ["--timeline-after-seq", "4"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "steps" in json.loads(r.stdout)["device"] and recorder.server.backend.asked[-1] == 4
    r = subprocess.run(cli + ["--timeline-after-seq", "-4"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--timeline-after-seq: must be a step number >= 0" in r.stderr


# ---------------------------------------------------------------- timeline_summary


def trace_ring(steps, trace_len: int = 8) -> np.ndarray:
    """Step k at row k % trace_len with SEQ k + 1, chained, step k lasting (10 + k) us, the next
    one beginning 1 us after it ends."""
    trace = np.zeros((trace_len, layout.TRACE_FIELDS), dtype=np.uint64)
    t = 1_000_000
    for k in steps:
        row = trace[k % trace_len]
        row[F.SCHED_BEGIN], row[F.SCHED_END] = t, t + 500
        row[F.STEP_BEGIN], row[F.STEP_END] = t + 1_000, t + 1_000 + (10 + k) * 1_000
        row[F.OVERLAP_BEGIN], row[F.OVERLAP_END] = t + 600, t + 900
        row[F.FLAGS] = layout.TraceFlag.CHAINED
        row[F.SEQ] = k + 1
        t = int(row[F.STEP_END])  # the next critical phase starts at once
    return trace


def test_the_summary_counts_only_the_rows_after_the_seq():
    trace = trace_ring(range(8))
    whole = timeline_summary(trace)
    assert whole == timeline_summary(trace, after_seq=0)
    assert whole["timeline_steps"] == 8 and whole["bubble_gaps"] == 7
    assert whole["bubble_us_p50"] == pytest.approx(1.0)
    assert whole["step_us_p50"] == pytest.approx(np.median([10 + k for k in range(8)]))

    last3 = timeline_summary(trace, after_seq=5)  # steps 5, 6, 7: SEQ 6, 7, 8
    assert last3["timeline_steps"] == 3 and last3["bubble_gaps"] == 2  # step 5's gap is before it
    assert last3["step_us_p50"] == pytest.approx(16.0)
    assert last3["step_us_p99"] == pytest.approx(np.percentile([15, 16, 17], 99))
    assert timeline_summary(trace, after_seq=7)["timeline_steps"] == 1
    assert timeline_summary(trace, after_seq=8) == {}  # nothing after the last step
    assert timeline_summary(trace, after_seq=10**9) == {}


def test_a_run_longer_than_the_ring_shows_as_fewer_timeline_steps():
    trace = trace_ring(range(12))  # an 8-row ring: steps 4..11 remain
    s = timeline_summary(trace, after_seq=2)  # the run was steps 2..11: 10 steps
    assert s["timeline_steps"] == 8 and s["step_us_p50"] == pytest.approx(np.median(range(14, 22)))


def test_void_steps_are_counted_and_their_gaps_stay_bubble(tmp_path):
    trace = trace_ring(range(8))
    plain = timeline_summary(trace)
    assert plain["void_steps"] == 0
    void = int(layout.TraceFlag.CHAINED | layout.TraceFlag.VOID)
    trace[[3, 6], F.FLAGS] = void  # steps 3 and 6: handed over with pad rows only
    s = timeline_summary(trace)
    assert s["void_steps"] == 2
    # real GPU time: the gaps before and after a void step are still the bubble's, its time a step's
    for key in ("bubble_gaps", "idle_gaps", "timeline_steps", "bubble_us_p50", "step_us_p50"):
        assert s[key] == plain[key], key
    assert timeline_summary(trace, after_seq=4)["void_steps"] == 1  # only the rows after the seq
    write_chrome_trace(str(tmp_path / "t.json"), trace)
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sorted(e["args"]["seq"] for e in events if e["name"] == "void step") == [3, 6]


# ---------------------------------------------------------------- the benchmark


def test_timeline_after_seq_is_the_steps_counter_read_before():
    assert timeline_after_seq({"device": {"steps": 120}}) == 120
    assert timeline_after_seq({"device": {"steps": 0}}) == 0
    for before in ({}, {"device": {}}, {"device": {"steps": True}}, {"device": {"steps": -1}}):
        assert timeline_after_seq(before) is None
    assert timeline_after_seq({"device": {"steps": 2.0}}) is None


def _stats(steps: int, **device) -> dict:
    return {"output_tokens": 10 * steps, "device": {"steps": steps, **device}}


def test_device_deltas_record_what_the_timeline_covered():
    before = _stats(1000)
    after = _stats(1300, timeline_steps=300, bubble_us_p50=4.5, step_us_p50=80.0)
    d = device_deltas(before, after)
    assert d["steps"] == 300 and d["timeline_steps"] == 300 and d["timeline_after_seq"] == 1000
    assert d["bubble_us_p50"] == 4.5
    assert "timeline_steps" not in device_deltas(before, _stats(1300))  # no timeline (the CPU)


def _entry(before: dict, after: dict) -> dict:
    result = RunResult([], before, after, loadgen_cpu_s=0.1, wall_s=1.0)
    return make_run_entry(
        scheduler="device", device="cuda", model="m", load=Load(concurrency=4), result=result, burstiness=None
    )


def test_the_run_entry_and_a_warning_when_the_ring_did_not_hold_the_run():
    whole = _entry(_stats(1000), _stats(1300, timeline_steps=300, bubble_us_p50=4.5))
    assert whole["device_steps"] == 300 and whole["timeline_steps"] == 300
    assert whole["device_stats"]["timeline_after_seq"] == 1000 and whole["bubble_us_p50"] == 4.5
    cut = _entry(_stats(1000), _stats(9000, timeline_steps=4096))
    assert cut["device_steps"] == 8000 and cut["timeline_steps"] == 4096
    assert timeline_warnings([whole]) == []
    (warning,) = timeline_warnings([whole, cut])
    assert "held 4096 of the run's 8000 steps" in warning
    cpu = _entry(_stats(1000), _stats(1300))  # no timeline: nothing to warn about
    assert cpu["timeline_steps"] is None and timeline_warnings([cpu]) == []


SPECS = [RequestSpec([5 + i, 40, 41], 4 + i % 3) for i in range(6)]


@pytest.mark.parametrize(
    "measure_with",
    [measure, measure_python_sync, measure_python_async],
    ids=["zmq-loadgen", "python-sync", "python-async"],
)
def test_a_measured_run_asks_for_the_steps_after_its_start(recorder, measure_with):
    backend = recorder.server.backend
    result = measure_with(
        recorder.address, SPECS, Load(concurrency=3), warmup=SPECS[:2], options=SendOptions()
    )
    assert all(r.ok for r in result.records)
    start = result.stats_before["device"]["steps"]
    assert start > 0  # the warm-up ran steps: the run's are after them
    assert backend.asked[-1] == start  # the stats read after the run
    entry = _entry(result.stats_before, result.stats_after)
    assert entry["device_stats"]["timeline_after_seq"] == start
    assert entry["device_steps"] == entry["timeline_steps"] > 0
