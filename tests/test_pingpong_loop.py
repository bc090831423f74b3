"""The ping-pong launch (cfg.plan_ahead) on host threads, as tests/test_persistent_loop.py runs the
resident one: one thread is the scheduler block (the kernel's own loop, sched_loop.h), two more
stand in for the two WHILE graphs, graph p running the steps whose seq has parity p:
[plan wait -> SWITCH(planned bucket) -> {gate -> step (a stand-in sampler)} -> signal].
Under random traffic (joins at random times, aborts, stop ids, a KV pool small enough to preempt)
every handed-over step runs once, on its graph, in seq order, in the bucket its graph's branch
chose; every request ends once with the stand-in's tokens; and every way out (a stop while a
graph is parked in its gate, the grace running out, a failed init) ends all three threads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ringleader.device.backends.device_timeline import complete_rows, timeline_summary
from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from tests.conftest import wait_until
from tests.sched_driver import Driver, scheduler, token_for
from tests.test_persistent_loop import ctl, start_loop

CFG = RingConfig(
    n_slots=4,
    max_ctx=64,
    token_budget=16,
    sq_size=16,
    cq_size=256,
    arena_size=2048,
    pending_cap=32,
    buckets=(1, 2, 4, 8, 16),
    page_size=8,
    n_pages=12,  # 8 pages hold one request of max_ctx: two long ones already run short
    plan_ahead=True,
)
N_BUCKETS = len(CFG.buckets)
JOIN_S = 5.0
# the loop looks at a stop every RL_STOP_POLL_ROUNDS polls of the turn (each a sched_yield here):
# on a loaded machine the grace's end is seen seconds late
DEADLINE_JOIN_S = 30.0


def published_plan(d: Driver, seq: int) -> tuple[int, int]:
    """(plan_seq, plan_bucket) as step `seq`'s graph reads them: the slot of its parity."""
    launch = d.a["launch"][0]
    return int(launch["plan_seq"][seq & 1]), int(launch["plan_bucket"][seq & 1])


def pingpong_driver(cfg: RingConfig = CFG) -> Driver:
    """A Driver whose launch words are what the host sets before starting anything: graph p's
    first step is seq p, nothing released or planned."""
    d = Driver(cfg)
    launch = d.a["launch"][0]
    launch["graph_seq"] = (0, 1)
    for name in ("released", "plan_seq", "plan_bucket", "idle"):
        launch[name] = 0
    return d


def journal_entry(d: Driver, parity: int, waits_for: int, branch: int) -> dict:
    """What the step handed over to graph `parity` (waiting for seq `waits_for`, in SWITCH
    branch `branch`) is, as its step starts: its seq, bucket, rows, samples and trace flags."""
    a, h = d.a, d.a["step"][0]
    seq, bucket = int(h["seq"]), int(h["bucket"])
    trace = a["trace"].reshape(-1, layout.TRACE_FIELDS)[seq % d.cfg.trace_len]
    return {
        "parity": parity,
        "waits_for": waits_for,
        "seq": seq,
        "branch": branch,
        "bucket": bucket,
        "n_tokens": int(h["n_tokens"]),
        "n_samples": int(h["n_samples"]),
        "slot_of": a["slot_of"][:bucket].tolist(),
        "flags": int(trace[layout.TraceField.FLAGS]),
    }


class PingPongGraph(threading.Thread):
    """Graph `parity`'s WHILE loop: plan wait -> (a branch: gate -> step -> signal | none: end).
    The step is a stand-in sampler writing next_token for the step's sample entries, as
    StepGraphStandIn's.  What each gate let through goes into the shared journal, in the order
    the steps ran.  hold: at this seq, wait for `release` before the step (a long step)."""

    def __init__(self, d: Driver, parity: int, journal: list, lock: threading.Lock, hold: int | None = None):
        super().__init__(daemon=True)
        self.d, self.parity, self.journal, self.lock, self.hold = d, parity, journal, lock, hold
        self.holding, self.release, self.in_gate = threading.Event(), threading.Event(), threading.Event()
        self.ended, self.gate_exits = False, []
        self.errors: list[str] = []

    def run(self) -> None:
        ctx, a, sched = self.d.mem.context_address, self.d.a, scheduler()
        while True:
            branch = sched.plan_wait(ctx, self.parity)
            if branch >= N_BUCKETS:
                self.ended = True
                return
            waits_for = int(a["launch"][0]["graph_seq"][self.parity])
            self.in_gate.set()
            turn = sched.step_gate(ctx, self.parity)
            self.in_gate.clear()
            h = a["step"][0]
            if turn != layout.Turn.COMPUTE:  # the loop ended: the step runs the all-pad layout
                if turn != layout.Turn.EXIT:
                    self.errors.append(f"gate answered {turn}")
                bucket = CFG.buckets[branch]
                self.gate_exits.append(
                    {
                        "seq": waits_for,
                        "n_samples": int(h["n_samples"]),
                        "slot_of": a["slot_of"][:bucket].tolist(),
                    }
                )
                sched.signal_pingpong(ctx, self.parity)  # nothing: turn is EXIT
                if len(self.gate_exits) > 1:  # the WHILE must end at the next plan wait
                    self.errors.append(f"the WHILE kept running after EXIT: {self.gate_exits[-1]}")
                    return
                continue
            entry = journal_entry(self.d, self.parity, waits_for, branch)
            seq = entry["seq"]
            with self.lock:
                self.journal.append(entry)
            if seq == self.hold:
                self.holding.set()
                self.release.wait(30)
            for q in range(entry["n_samples"]):
                s = int(a["sample_slot"][q])
                handle = int(a["slots"][s]["handle"])
                a["next_token"][s] = token_for(handle, int(a["sample_counter"][q]))
            sched.signal_pingpong(ctx, self.parity)


class Run:
    """The scheduler thread and both graph threads over one Driver."""

    def __init__(self, d: Driver, holds=(None, None), start_loop_first: bool = True):
        self.d = d
        self.journal: list[dict] = []
        lock = threading.Lock()
        self.graphs = [PingPongGraph(d, p, self.journal, lock, hold=holds[p]) for p in (0, 1)]
        self.loop = start_loop(d) if start_loop_first else None
        for g in self.graphs:
            g.start()

    def join(self) -> None:
        if self.loop is not None:
            self.loop.join(DEADLINE_JOIN_S)
            assert not self.loop.is_alive(), "the scheduler loop did not end"
        for g in self.graphs:
            g.join(JOIN_S)
            assert not g.is_alive(), f"graph {g.parity} did not end"
            assert g.ended and not g.errors, (g.parity, g.errors)


def check_steps(run: Run) -> dict:
    """Every handed-over seq ran once, on its parity's graph, in seq order, in its branch's
    bucket; void steps carry pad rows only."""
    d, journal = run.d, run.journal
    handed_over = int(d.a["sched"][0]["step"])
    assert [e["seq"] for e in journal] == list(range(handed_over))
    assert int(d.a["launch"][0]["released"]) == handed_over
    void = 0
    for e in journal:
        assert e["parity"] == e["seq"] % 2 and e["waits_for"] == e["seq"], e
        assert CFG.buckets[e["branch"]] == e["bucket"] >= e["n_tokens"], e
        if e["flags"] & layout.TraceFlag.VOID:
            void += 1
            assert e["n_tokens"] == e["n_samples"] == 0 and e["slot_of"] == [-1] * e["bucket"], e
        else:
            assert e["n_tokens"] > 0 and e["n_samples"] <= e["n_tokens"], e  # a mid-prompt chunk: none
            assert all(s >= 0 for s in e["slot_of"][: e["n_tokens"]]), e
            assert e["slot_of"][e["n_tokens"] :] == [-1] * (e["bucket"] - e["n_tokens"]), e
    # graph p stands at its next step: two seqs past its last
    for p in (0, 1):
        ran = [e["seq"] for e in journal if e["parity"] == p]
        assert int(d.a["launch"][0]["graph_seq"][p]) == (ran[-1] + 2 if ran else p)
    return {"steps": handed_over, "void": void}


def check_requests(d: Driver, aborted: set[int]) -> None:
    for handle, rec in d.records.items():
        assert len(rec.done) == 1, (handle, rec.done)
        assert rec.tokens == [token_for(handle, k) for k in range(len(rec.tokens))], handle
        assert rec.indices == list(range(len(rec.tokens))), handle
        why = rec.done[0]
        if why == layout.Finish.LENGTH:
            assert len(rec.tokens) == rec.max_tokens or len(rec.prompt) + len(rec.tokens) >= CFG.max_ctx
        elif why == layout.Finish.ABORT:
            assert handle in aborted
        else:
            assert why == layout.Finish.STOP and rec.tokens[-1] == rec.stop_id, handle


def check_timeline(d: Driver) -> dict:
    trace = d.a["trace"].reshape(-1, layout.TRACE_FIELDS)
    rows = complete_rows(trace)
    f = layout.TraceField
    prev, cur = rows[:-1], rows[1:]
    chained = (cur[:, f.SEQ] == prev[:, f.SEQ] + 1) & ((cur[:, f.FLAGS] & layout.TraceFlag.CHAINED) != 0)
    gaps = cur[chained, f.STEP_BEGIN] - prev[chained, f.STEP_END]
    assert (gaps >= 0).all(), gaps[gaps < 0]  # a step begins after the one before it ended
    assert (rows[:, f.STEP_END] >= rows[:, f.STEP_BEGIN]).all()
    assert (rows[:, f.STEP_BEGIN] >= rows[:, f.SCHED_END]).all()  # after its critical phase
    summary = timeline_summary(trace)
    assert summary["bubble_gaps"] == int(chained.sum()) > 0 and summary["bubble_us_p50"] >= 0
    return summary


def submit(d: Driver, rng, prompt_len: int, max_tokens: int, stop_at: int | None = None) -> int | None:
    stop = () if stop_at is None else (token_for(d._next, stop_at),)
    handle = d.submit(rng.integers(1, 1000, prompt_len), max_tokens, stop_ids=stop)
    if handle is not None:
        d.records[handle].stop_id = stop[0] if stop else None
        d.rings.submissions.publish()
    return handle


def traffic(d: Driver, rng, wanted: int, check=lambda: None) -> set[int]:
    """Long requests at once (the KV pool runs short: someone is preempted), then joins at random
    times (now and then after the loop went idle), stop ids and aborts, until `wanted` requests
    were sent; check() between joins.  Returns the aborted handles."""
    aborted: set[int] = set()
    for _ in range(3):
        submit(d, rng, 20, 40)
    deadline = time.monotonic() + 6
    while len(d.records) < wanted and time.monotonic() < deadline:
        time.sleep(0.02 if rng.random() < 0.1 else float(rng.uniform(0, 0.004)))
        d.drain_cq()
        check()
        stop_at = int(rng.integers(0, 8)) if rng.random() < 0.4 else None
        submit(d, rng, int(rng.integers(1, 30)), int(rng.integers(1, 30)), stop_at)
        live = [h for h, r in d.records.items() if not r.done and h not in aborted]
        if live and rng.random() < 0.1:
            h = live[int(rng.integers(0, len(live)))]
            if d.abort(h):
                aborted.add(h)
                d.rings.aborts.publish()
    return aborted


class Watch:
    """Fails fast, saying where each side stands, when requests wait and no step has run for
    `stall_s` (a lost hand-over hangs the launch for good: no need to wait out a timeout)."""

    def __init__(self, d: Driver, run: Run, stall_s: float = 1.5):
        self.d, self.run, self.stall_s = d, run, stall_s
        self.seen, self.since = -1, time.monotonic()

    def check(self) -> None:
        ran = len(self.run.journal)
        if ran != self.seen or all(r.done for r in self.d.records.values()):
            self.seen, self.since = ran, time.monotonic()
        elif time.monotonic() - self.since > self.stall_s:
            launch = self.d.a["launch"][0]
            raise AssertionError(
                f"stuck after {ran} steps: turn {int(self.d.a['turn'][0])}, sched.step "
                f"{int(self.d.a['sched'][0]['step'])}, released {int(launch['released'])}, plan_seq "
                f"{launch['plan_seq']}, plan_bucket {launch['plan_bucket']}, graph_seq "
                f"{launch['graph_seq'].tolist()}, parked in gate {[g.in_gate.is_set() for g in self.run.graphs]}"
            )

    def served(self, pred, timeout: float) -> bool:
        def done():
            self.d.drain_cq()
            self.check()
            return pred()

        return wait_until(done, timeout)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_traffic_runs_every_step_once_on_its_graph_in_its_planned_bucket(seed):
    rng = np.random.default_rng(seed)
    d = pingpong_driver()
    ctl(d)["stop_grace_ns"] = 1_000_000_000
    run = Run(d)
    watch = Watch(d, run)
    wanted = 40
    try:
        assert wait_until(lambda: int(ctl(d)["state"]) == layout.SchedulerState.RUNNING, 5)
        aborted = traffic(d, rng, wanted, watch.check)
        assert watch.served(lambda: all(r.done for r in d.records.values()), 6)
        # a lone request whose second sample is its stop id: the plan for the step after names
        # its row, which ends first, so that step goes out void
        lone = submit(d, rng, 5, 10, stop_at=1)
        assert watch.served(lambda: d.records[lone].done, 5)
    finally:
        d.rings.request_shutdown()
    run.join()
    assert int(ctl(d)["state"]) == layout.SchedulerState.EXITED
    assert int(ctl(d)["exit_reason"]) == layout.ExitReason.SHUTDOWN
    assert int(d.a["turn"][0]) == layout.Turn.EXIT
    assert not any(g.gate_exits for g in run.graphs)  # the stop came while idle: no plan left
    assert len(d.records) >= wanted
    check_requests(d, aborted)
    steps = check_steps(run)
    summary = check_timeline(d)
    assert steps["void"] >= 1 and d.records[lone].done == [layout.Finish.STOP]
    assert int(d.a["sched"][0]["preemptions"]) > 0
    assert {e["parity"] for e in run.journal} == {0, 1}
    print(f"seed {seed}: {steps}, {len(d.records)} requests, {summary['bubble_gaps']} chained gaps")


def _parked_in_gate(run: Run, d: Driver, held_seq: int) -> None:
    """Waits until graph held_seq % 2 holds step held_seq and the other graph, its branch taken
    from the plan of step held_seq + 1, is parked in its gate."""
    holder, parked = run.graphs[held_seq % 2], run.graphs[(held_seq + 1) % 2]
    assert holder.holding.wait(10), "the held step never came"
    assert wait_until(
        lambda: published_plan(d, held_seq + 1)[0] == held_seq + 2 and parked.in_gate.is_set(), 5
    ), "the next step's graph never parked in its gate"


def test_a_stop_while_a_graph_is_parked_in_its_gate_runs_that_step_and_ends_all():
    d = pingpong_driver()
    ctl(d)["stop_grace_ns"] = 5_000_000_000
    run = Run(d, holds=(4, None))
    submit(d, np.random.default_rng(0), 5, 50)
    _parked_in_gate(run, d, 4)
    d.rings.request_shutdown()
    time.sleep(0.05)  # the scheduler waits for the held step's turn with the stop seen
    assert run.loop.is_alive()
    run.graphs[0].release.set()
    run.join()
    # the planned step was handed over as planned and ran; the stop ended the loop after it
    assert [e["seq"] for e in run.journal] == list(range(6))
    assert not any(g.gate_exits for g in run.graphs)
    check_steps(run)
    assert int(ctl(d)["exit_reason"]) == layout.ExitReason.SHUTDOWN
    assert int(ctl(d)["state"]) == layout.SchedulerState.EXITED
    assert int(d.a["turn"][0]) == layout.Turn.EXIT
    rec = next(iter(d.records.values()))
    d.drain_cq()
    assert rec.tokens == [token_for(rec.handle, k) for k in range(len(rec.tokens))]


def test_a_graph_parked_in_its_gate_when_the_grace_runs_out_runs_an_all_pad_step():
    d = pingpong_driver()
    ctl(d)["stop_grace_ns"] = 50_000_000  # 50 ms
    run = Run(d, holds=(4, None))
    submit(d, np.random.default_rng(1), 5, 50)
    _parked_in_gate(run, d, 4)
    planned = published_plan(d, 5)[1]
    t0 = time.monotonic()
    d.rings.request_shutdown()
    try:
        run.loop.join(DEADLINE_JOIN_S)  # the held step keeps the turn past the grace
        assert not run.loop.is_alive() and time.monotonic() - t0 >= 0.05
        run.graphs[1].join(JOIN_S)  # the gate's EXIT let it through to the pad step, then out
        assert not run.graphs[1].is_alive()
    finally:
        run.graphs[0].release.set()
    run.join()
    assert int(ctl(d)["exit_reason"]) == layout.ExitReason.DEADLINE
    assert int(ctl(d)["state"]) == layout.SchedulerState.EXITED
    assert int(d.a["turn"][0]) == layout.Turn.EXIT
    assert [e["seq"] for e in run.journal] == list(range(5))  # step 5 was never handed over
    assert run.graphs[1].gate_exits == [{"seq": 5, "n_samples": 0, "slot_of": [-1] * planned}]
    assert not run.graphs[0].gate_exits
    # the held step's late signal found the loop over: nothing moved on
    launch = d.a["launch"][0]
    assert int(launch["released"]) == 5 and launch["graph_seq"].tolist() == [4, 5]


def test_a_failed_init_ends_both_graphs_already_waiting_for_a_plan():
    d = pingpong_driver()
    d.a["cfg"][0]["magic"] = 0  # the scheduler rejects its configuration
    run = Run(d, start_loop_first=False)  # the graphs are launched first
    time.sleep(0.02)
    run.loop = start_loop(d)
    run.join()
    assert run.journal == [] and not any(g.gate_exits for g in run.graphs)
    assert int(ctl(d)["state"]) == layout.SchedulerState.FAILED
    assert int(ctl(d)["error_code"]) == layout.InitError.BAD_MAGIC
    assert int(d.a["turn"][0]) == layout.Turn.EXIT


def test_a_stop_before_any_request_ends_both_graphs_waiting_for_a_plan():
    d = pingpong_driver()
    run = Run(d)
    assert wait_until(lambda: int(ctl(d)["state"]) == layout.SchedulerState.RUNNING, 5)
    d.rings.request_shutdown()
    run.join()
    assert run.journal == [] and not np.any(d.a["launch"][0]["plan_seq"])
    assert int(ctl(d)["exit_reason"]) == layout.ExitReason.SHUTDOWN


def _first_step_out_and_next_plan(d: Driver) -> None:
    """The scheduler alone: one request, step 0 handed over (nobody runs it) and the plan of
    step 1 published."""
    d.submit(np.arange(1, 6), 20)
    d.rings.submissions.publish()
    launch = d.a["launch"][0]
    assert wait_until(lambda: int(launch["released"]) == 1 and published_plan(d, 1)[0] == 2, 5)


def test_a_graph_that_reaches_its_plan_wait_after_its_step_was_handed_over_still_gets_it():
    # Graph 0 comes to its plan wait late (a WHILE re-arm, a thread descheduled): the scheduler
    # has handed over step 0 and already published the plan of step 1.  Step 0
    # must still run: the turn is COMPUTE and only graph 0 can hand it back.
    d = pingpong_driver()
    ctl(d)["stop_grace_ns"] = 200_000_000
    ctx, sched = d.mem.context_address, scheduler()
    loop = start_loop(d)
    got: list[int] = []
    try:
        _first_step_out_and_next_plan(d)
        late = threading.Thread(target=lambda: got.append(sched.plan_wait(ctx, 0)), daemon=True)
        late.start()
        late.join(2)
        assert got, "graph 0 never got the branch of step 0, which is out: the loop is stuck"
        bucket = int(d.a["step"][0]["bucket"])
        assert got == [CFG.buckets.index(bucket)] and int(d.a["step"][0]["seq"]) == 0
        assert sched.step_gate(ctx, 0) == layout.Turn.COMPUTE
        h = d.a["step"][0]
        for q in range(int(h["n_samples"])):
            s = int(d.a["sample_slot"][q])
            d.a["next_token"][s] = token_for(int(d.a["slots"][s]["handle"]), int(d.a["sample_counter"][q]))
        sched.signal_pingpong(ctx, 0)
        run = Run(d, start_loop_first=False)  # both graphs from here on: the request finishes
        run.loop = loop
        assert wait_until(lambda: d.drain_cq() >= 0 and all(r.done for r in d.records.values()), 5)
    finally:
        d.rings.request_shutdown()
        loop.join(DEADLINE_JOIN_S)
    run.join()
    rec = next(iter(d.records.values()))
    assert rec.done == [layout.Finish.LENGTH] and rec.tokens == [token_for(rec.handle, k) for k in range(20)]
    assert int(ctl(d)["exit_reason"]) == layout.ExitReason.SHUTDOWN


def test_after_an_exit_with_a_plan_outstanding_the_planned_graph_leaves_its_while():
    # The grace runs out while step 0 keeps the turn (nobody runs it here) and the plan of step
    # 1 is outstanding: the scheduler voids that step and writes EXIT.  Graph 1 may still take
    # the planned branch once (its gate answers EXIT, the pad step runs, the signal does
    # nothing), but its next plan wait must end the WHILE: a graph that never ends hangs the
    # host's stop.
    d = pingpong_driver()
    ctl(d)["stop_grace_ns"] = 50_000_000
    ctx, sched = d.mem.context_address, scheduler()
    loop = start_loop(d)
    _first_step_out_and_next_plan(d)
    d.rings.request_shutdown()
    loop.join(DEADLINE_JOIN_S)
    assert not loop.is_alive() and int(ctl(d)["exit_reason"]) == layout.ExitReason.DEADLINE
    assert int(d.a["turn"][0]) == layout.Turn.EXIT
    assert sched.plan_wait(ctx, 0) == N_BUCKETS  # its step never ran; the turn says EXIT
    branches = []
    for _ in range(3):
        branch = sched.plan_wait(ctx, 1)
        branches.append(branch)
        if branch == N_BUCKETS:
            break
        assert sched.step_gate(ctx, 1) == layout.Turn.EXIT
        bucket = CFG.buckets[branch]
        assert int(d.a["step"][0]["n_samples"]) == 0 and (d.a["slot_of"][:bucket] == -1).all()
        sched.signal_pingpong(ctx, 1)
        assert d.a["launch"][0]["graph_seq"].tolist() == [0, 1]
    assert branches[-1] == N_BUCKETS and len(branches) <= 2, f"plan waits answered {branches}"
