"""The persistent kernel's own loop (device/sched/sched_loop.h), run by the CPU build on host
threads: one thread is the scheduler block, another stands in for the step graph (its wait,
begin and signal nodes, with a stand-in sampler).  So the hand-over, the stop, the deadline and
every failure path that must end the step graph's wait are tested as the GPU runs them."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from ringleader.device.backends.device_timeline import timeline_summary
from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from tests.conftest import wait_until
from tests.sched_driver import Driver, scheduler, token_for

CFG = RingConfig(
    n_slots=4,
    max_ctx=128,
    token_budget=16,
    sq_size=16,
    cq_size=256,
    arena_size=1024,
    pending_cap=32,
    buckets=(1, 2, 4, 8, 16),
)


GONE = (layout.SchedulerState.EXITED, layout.SchedulerState.FAILED, layout.SchedulerState.INIT)


class StepGraphStandIn(threading.Thread):
    """What the resident launch graph does per WHILE iteration: wait for the turn, begin, the
    step (a stand-in sampler writes next_token), signal; ends when the wait says EXIT.
    hold_turn: after this many steps, take the turn and never hand it back (a hung step)."""

    def __init__(self, d: Driver, hold_turn: int | None = None):
        super().__init__(daemon=True)
        self.d, self.hold_turn = d, hold_turn
        self.steps, self.branches, self.exit_seen = 0, [], False

    def run(self) -> None:
        ctx, a = self.d.mem.context_address, self.d.a
        while True:
            branch = scheduler().step_wait(ctx)
            if branch >= len(self.d.cfg.buckets):  # no branch: the WHILE ends (the scheduler's EXIT)
                assert int(a["turn"][0]) == layout.Turn.EXIT or int(ctl(self.d)["state"]) in GONE
                self.exit_seen = True
                return
            assert int(a["turn"][0]) == layout.Turn.COMPUTE
            self.branches.append(branch)
            if self.hold_turn is not None and self.steps >= self.hold_turn:
                return  # keeps COMPUTE: the scheduler never gets its turn back
            scheduler().step_begin(ctx)
            ns = int(a["step"][0]["n_samples"])
            for q in range(ns):
                s = int(a["sample_slot"][q])
                handle = int(a["slots"][s]["handle"])
                a["next_token"][s] = token_for(handle, int(a["sample_counter"][q]))
            self.steps += 1
            scheduler().step_signal(ctx)


def start_loop(d: Driver) -> threading.Thread:
    loop = threading.Thread(target=scheduler().persistent, args=(d.mem.context_address,), daemon=True)
    loop.start()  # ctypes releases the GIL for the loop's whole life
    return loop


def ctl(d: Driver):
    return d.a["ctl"][0]


def test_the_kernel_loop_serves_requests_and_stops_on_shutdown():
    d = Driver(CFG)
    ctl(d)["stop_grace_ns"] = 2_000_000_000
    loop, graph = start_loop(d), StepGraphStandIn(d)
    graph.start()
    wait_until(lambda: int(ctl(d)["state"]) == layout.SchedulerState.RUNNING, 5)
    handles = [d.submit(np.arange(1, 2 + 3 * i), 5 + i) for i in range(6)]
    d.rings.submissions.publish()
    wait_until(lambda: d.drain_cq() >= 0 and all(d.records[h].done for h in handles), 20)
    for h in handles:
        rec = d.records[h]
        assert rec.done == [layout.Finish.LENGTH] and len(rec.tokens) == rec.max_tokens
        assert rec.tokens == [token_for(h, i) for i in range(rec.max_tokens)]
    d.rings.request_shutdown()
    loop.join(5)
    graph.join(5)
    assert not loop.is_alive() and not graph.is_alive() and graph.exit_seen
    assert int(ctl(d)["state"]) == layout.SchedulerState.EXITED
    assert int(ctl(d)["exit_reason"]) == layout.ExitReason.SHUTDOWN
    assert int(d.a["turn"][0]) == layout.Turn.EXIT
    assert set(graph.branches) <= set(range(len(CFG.buckets)))  # every step had its bucket
    summary = timeline_summary(d.a["trace"].reshape(-1, layout.TRACE_FIELDS))
    assert summary["step_us_p50"] >= 0 and graph.steps >= max(5 + i for i in range(6))


def test_a_failed_init_writes_exit_so_a_launched_step_graph_ends():
    d = Driver(CFG)
    d.a["cfg"][0]["magic"] = 0  # the scheduler rejects its configuration
    graph = StepGraphStandIn(d)
    graph.start()  # the graph is launched first, as CudaBackend.start does
    loop = start_loop(d)
    loop.join(5)
    graph.join(5)
    assert not loop.is_alive() and not graph.is_alive() and graph.exit_seen and graph.steps == 0
    assert int(ctl(d)["state"]) == layout.SchedulerState.FAILED
    assert int(ctl(d)["error_code"]) == layout.InitError.BAD_MAGIC
    assert int(d.a["turn"][0]) == layout.Turn.EXIT


@pytest.mark.parametrize(
    "state,shutdown,ends",
    [
        (layout.SchedulerState.FAILED, 0, True),  # a scheduler that failed without writing EXIT
        (layout.SchedulerState.EXITED, 0, True),
        (layout.SchedulerState.INIT, 1, True),  # its launch failed, and the host asked to stop
        (layout.SchedulerState.INIT, 0, False),  # it may still start
        (layout.SchedulerState.RUNNING, 1, False),  # it will answer with EXIT itself
    ],
)
def test_the_step_wait_ends_when_no_scheduler_is_left_to_answer(state, shutdown, ends):
    d = Driver(CFG)
    ctl(d)["state"] = state
    ctl(d)["shutdown"] = shutdown
    graph = StepGraphStandIn(d)
    graph.start()
    graph.join(5 if ends else 0.5)
    assert graph.is_alive() is not ends
    if not ends:  # the turn still ends it: the scheduler's EXIT
        d.a["turn"][0] = layout.Turn.EXIT
        graph.join(5)
        assert not graph.is_alive()
    assert graph.exit_seen and graph.steps == 0


def test_a_step_that_keeps_the_turn_past_the_grace_ends_the_loop_with_deadline():
    d = Driver(CFG)
    ctl(d)["stop_grace_ns"] = 50_000_000  # 50 ms
    loop, graph = start_loop(d), StepGraphStandIn(d, hold_turn=2)
    graph.start()
    d.submit(np.arange(1, 4), 50)
    d.rings.submissions.publish()
    graph.join(10)  # took the third step and kept it
    assert not graph.is_alive() and graph.steps == 2 and int(d.a["turn"][0]) == layout.Turn.COMPUTE
    t0 = time.monotonic()
    d.rings.request_shutdown()
    loop.join(5)
    assert not loop.is_alive() and time.monotonic() - t0 >= 0.05
    assert int(ctl(d)["exit_reason"]) == layout.ExitReason.DEADLINE
    assert int(ctl(d)["state"]) == layout.SchedulerState.EXITED
    assert int(d.a["turn"][0]) == layout.Turn.EXIT


class LayoutLog(threading.Thread):
    """The resident graph's side, recording every step's layout (rows, tokens, positions and
    sample entries) before its stand-in sampler runs."""

    def __init__(self, d: Driver):
        super().__init__(daemon=True)
        self.d, self.steps = d, []

    def run(self) -> None:
        ctx = self.d.mem.context_address
        while scheduler().step_wait(ctx) < len(self.d.cfg.buckets):
            self.steps.append(step_layout(self.d))
            stand_in_sampler(self.d)
            scheduler().step_signal(ctx)


def step_layout(d: Driver) -> tuple:
    a, h = d.a, d.a["step"][0]
    n, ns = int(h["n_tokens"]), int(h["n_samples"])
    return (
        a["slot_of"][:n].tolist(),
        a["token_ids"][:n].tolist(),
        a["positions"][:n].tolist(),
        a["sample_slot"][:ns].tolist(),
        a["sample_counter"][:ns].tolist(),
    )


def stand_in_sampler(d: Driver) -> None:
    a = d.a
    for q in range(int(a["step"][0]["n_samples"])):
        s = int(a["sample_slot"][q])  # its place: its slot's, or a draft row's
        handle = int(a["slots"][d.slot_of_place(s)]["handle"])
        a["next_token"][s] = d.token_fn(handle, int(a["sample_counter"][q]))


WIDE = dataclasses.replace(
    CFG, n_slots=40, token_budget=64, buckets=(1, 2, 4, 8, 16, 32, 64), pending_cap=64, sq_size=64,
    cq_size=4096, arena_size=8192, n_pages=400,
)  # fmt: skip


def submit_all(d: Driver, n: int, spread: int, stop_every: int) -> list[int]:
    """n requests, published at once: prompts of 3 to 2 + spread tokens, ending by length at one
    of `spread` lengths (20-50 tokens out), every stop_every-th at its 9th token instead."""
    handles = []
    for i in range(n):
        stop = (token_for(i + 1, 8),) if i % stop_every == 0 else ()
        handles.append(
            d.submit(np.arange(1, 4 + i % spread), 20 + (30 * (i % spread)) // spread, stop_ids=stop)
        )
    d.rings.submissions.publish()
    return handles


def loop_against_serial(cfg, n: int, spread: int, stop_every: int, token_fn=token_for) -> list:
    """Runs the same requests through sched_step and through the persistent loop (the resident
    graph's stand-in recording each step), asserts every step's layout and every request's
    tokens and finish identical; returns the loop's steps."""
    serial = Driver(cfg, token_fn=token_fn)
    submit_all(serial, n, spread, stop_every)
    serial_steps = []
    while serial.step(drain=False) == layout.StepStatus.RUN:
        serial_steps.append(step_layout(serial))
        serial.drain_cq()
    serial.drain_cq()  # the events of the pass that found nothing more to run
    assert all(serial.records[h].done for h in serial.records)
    d = Driver(cfg, token_fn=token_fn)
    scheduler().reset_hand_over_paths()
    handles = submit_all(d, n, spread, stop_every)
    loop, graph = start_loop(d), LayoutLog(d)
    graph.start()
    assert wait_until(lambda: d.drain_cq() >= 0 and all(d.records[h].done for h in handles), 20)
    d.rings.request_shutdown()
    loop.join(5)
    graph.join(5)
    assert not loop.is_alive() and not graph.is_alive()
    for k, (got, want) in enumerate(zip(graph.steps, serial_steps)):
        assert got == want, f"step {k}: the loop laid out {got}, sched_step {want}"
    assert len(graph.steps) == len(serial_steps)
    for h in handles:
        assert d.records[h].tokens == serial.records[h].tokens and d.records[h].done == serial.records[h].done
    return graph.steps


def quoting(handle: int, index: int) -> int:
    """A stand-in that repeats its prompt (submit_all's: 1, 2, 3, ...): drafts are accepted."""
    return 1 + (index + 1) % (3 + (handle - 1) % 3)


@pytest.mark.parametrize("cfg", [CFG, WIDE], ids=["warp", "block"])
def test_with_drafts_the_loop_lays_out_every_step_as_the_serial_scheduler_does(cfg):
    """Speculative decoding through the persistent loop: the verification rows, the drafts'
    sample places and the tokens accepted, identical to sched_step's."""
    spec = dataclasses.replace(cfg, spec_tokens=4, spec_max_batch=cfg.n_slots)
    steps = loop_against_serial(spec, 7 if cfg is CFG else 38, 3, 1000, quoting)
    assert any(len(st[0]) > 1 and len(set(st[0])) < len(st[0]) for st in steps)  # a slot's draft rows


@pytest.mark.parametrize(
    "cfg,n,spread,stop_every", [(CFG, 7, 3, 3), (WIDE, 38, 1, 10)], ids=["warp", "block"]
)
def test_the_loop_lays_out_every_step_as_the_serial_scheduler_does(cfg, n, spread, stop_every):
    """The persistent loop (steady steps of up to 32 rows on warp 0 alone, more on the block)
    against sched_step, on the same requests: every step's rows, tokens, positions and samples,
    and every token, identical.  Also: the hand-overs of the loop's steady warp path passed no
    block barrier between the turn coming back and the step going out, the block path a few."""
    steps = loop_against_serial(cfg, n, spread, stop_every)
    paths = scheduler().hand_over_paths()
    assert sum(paths) == len(steps)
    # steady steps of up to 32 rows: warp 0 alone, no block barrier on the path; of 33 or more:
    # the block's barrier after the wait, its vote and the hand-over's; the full builds: more
    assert paths[0] >= len(steps) // 2 if cfg is CFG else paths[3] >= len(steps) // 3, paths
    assert paths[1] == paths[2] == 0 and sum(paths[4:]) > 0, paths
