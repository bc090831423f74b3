"""The real sched_step (CPU build) over real rings: continuous batching, budgets, policies, aborts."""

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from tests.sched_driver import Driver, token_for


def small_config(**kw) -> RingConfig:
    base = dict(
        n_slots=4,
        max_ctx=64,
        token_budget=8,
        sq_size=4,
        cq_size=64,
        arena_size=128,
        pending_cap=8,
        aging_steps=4,
    )
    base.update(kw)
    return RingConfig(**base)


def check_step_layout(d: Driver, step: dict) -> None:
    budget = d.cfg.token_budget
    assert 0 < step["n_tokens"] <= budget
    segs = step["seg"]
    slots = [s for s, _, _ in segs]
    assert len(slots) == len(set(slots)), "a slot appears twice in one step"
    row = 0
    for g, (slot, start, n) in enumerate(segs):
        assert start == row and n >= 1
        if g < step["n_decode"]:
            assert n == 1, "decode rows come first, one per decoding slot"
        assert (step["slot_of"][start : start + n] == slot).all()
        pos = step["positions"][start : start + n]
        assert (np.diff(pos) == 1).all()
        row += n
    assert row == step["n_tokens"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_request_gets_its_tokens_and_one_done(data):
    n_slots = data.draw(st.integers(1, 4), label="n_slots")
    budget = data.draw(st.integers(n_slots, 12), label="budget")
    d = Driver(small_config(n_slots=n_slots, token_budget=budget))
    arrivals = data.draw(
        st.lists(
            st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(0, 3)), min_size=1, max_size=24
        ),
        label="requests",
    )
    queue = list(arrivals)
    for _ in range(5000):
        while queue:  # submit as many as the SQ and arena take: exercises full rings and wrap
            plen, max_tokens, _ = queue[0]
            prompt = np.arange(plen, dtype=np.int32) + 1000 * (len(d.records) + 1)
            if d.submit(prompt, max_tokens) is None:
                break
            queue.pop(0)
        d.step()
        if not queue and all(r.done for r in d.records.values()):
            break
    assert not queue
    for rec in d.records.values():
        assert rec.done == [layout.Finish.LENGTH]
        assert rec.indices == list(range(rec.max_tokens))
        assert rec.tokens == [token_for(rec.handle, i) for i in range(rec.max_tokens)]
    for step in d.steps:
        check_step_layout(d, step)
    # every prompt token was fed exactly once, at its own position, before the first decode row
    assert d.rings.arena.used() == 0
    ctl = d.rings.counters()
    assert ctl["finished"] == len(d.records) and ctl["active_slots"] == 0 and ctl["pending"] == 0


def test_prefill_is_chunked_under_the_budget_and_rows_carry_the_prompt():
    d = Driver(small_config(n_slots=2, token_budget=8, arena_size=256, max_ctx=128))
    prompt = np.arange(50, 70, dtype=np.int32)  # 20 tokens: chunks of 8, 8, 4
    h = d.submit(prompt, 3)
    d.run_until_idle()
    first = d.steps[:3]
    assert [s["n_tokens"] for s in first] == [8, 8, 4]
    fed = np.concatenate([s["tokens"] for s in first])
    assert (fed == prompt).all()
    assert [s["n_samples"] for s in first] == [0, 0, 1]
    # decode rows feed back the previous token at the next position
    rec = d.records[h]
    decode = d.steps[3:]
    assert [int(s["tokens"][0]) for s in decode] == rec.tokens[:-1]
    assert [int(s["positions"][0]) for s in decode] == [20, 21]


def test_decode_rows_go_first_and_prefill_takes_the_rest_of_the_budget():
    d = Driver(small_config(n_slots=3, token_budget=6, arena_size=256, max_ctx=128))
    d.submit(np.arange(3, dtype=np.int32), 10)
    d.step()  # prefill of the first
    d.submit(np.arange(30, dtype=np.int32), 2)
    d.step()  # built before the SQ is read: admission runs beside this step, for the next
    assert d.steps[-1]["n_decode"] == 1 and len(d.steps[-1]["seg"]) == 1
    d.step()
    s = d.steps[-1]
    assert s["n_decode"] == 1 and s["seg"][0][2] == 1
    assert s["seg"][1][2] == 5, "the prefill chunk takes what the decode row left"


def test_fifo_admits_in_arrival_order():
    d = Driver(small_config(n_slots=1))
    handles = [d.submit([1, 2], 2) for _ in range(4)]
    assert _completion_order(d) == handles
    assert all(r.done == [layout.Finish.LENGTH] for r in d.records.values())


def _completion_order(d: Driver) -> list[int]:
    """Handles in the order their DONE appeared (records keep insertion order of completion)."""
    done_order = []
    while True:
        before = {h for h, r in d.records.items() if r.done}
        status = d.step()
        after = {h for h, r in d.records.items() if r.done}
        done_order.extend(sorted(after - before))
        if status == layout.StepStatus.IDLE:
            return done_order


def test_priority_admits_higher_first():
    d = Driver(small_config(n_slots=1, aging_steps=1000, policy=layout.Policy.PRIORITY))
    busy = d.submit([1], 3)
    d.step()  # busy takes the only slot
    low = d.submit([2], 1, priority=0)
    high = d.submit([3], 1, priority=5)
    order = _completion_order(d)
    assert order.index(high) < order.index(low)
    assert order[0] == busy


def test_priority_aging_lets_old_requests_through():
    # A low-priority request waits while high-priority ones keep coming; aging must admit it.
    d = Driver(small_config(n_slots=1, sq_size=8, aging_steps=1, policy=layout.Policy.PRIORITY))
    d.submit([1], 2)
    d.step()
    low = d.submit([2], 1, priority=0)
    for _ in range(30):
        d.submit([3], 2, priority=3)
        d.step()
        d.step()
        if d.records[low].done:
            break
    assert d.records[low].done == [layout.Finish.LENGTH], "starved despite aging"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([-(2**31), -5, -1, 0, 0, 1, 3, 3, 7, 2**31 - 1]), min_size=5, max_size=24))
def test_priority_admits_the_highest_first_ties_in_arrival_order(priorities):
    """The admission sort (a radix sort on the device) against a reference: with every request
    waiting while the slots are busy, each batch of freed slots takes the next n_slots requests
    by priority, equal priorities in arrival order."""
    n_slots = 4
    d = Driver(
        small_config(
            n_slots=n_slots,
            token_budget=8,
            sq_size=32,
            pending_cap=32,
            cq_size=256,
            arena_size=256,
            aging_steps=10**6,
            policy=layout.Policy.PRIORITY,
        )
    )
    for _ in range(n_slots):
        d.submit([1], 3)
    d.step()  # the slots are busy for a few steps
    handles = [d.submit([2], 1, priority=p) for p in priorities]
    batches = []
    while True:
        before = {h for h in handles if d.records[h].done}
        status = d.step()
        ended = {h for h in handles if d.records[h].done} - before
        if ended:
            batches.append(ended)
        if status == layout.StepStatus.IDLE:
            break
    order = sorted(range(len(handles)), key=lambda i: (-priorities[i], i))
    want = [{handles[i] for i in order[k : k + n_slots]} for k in range(0, len(order), n_slots)]
    assert batches == want


def test_static_batching_waits_for_the_whole_batch():
    d = Driver(small_config(n_slots=2, policy=layout.Policy.STATIC))
    short = d.submit([1], 1)
    long = d.submit([2], 6)
    third = d.submit([3], 1)
    while not d.records[short].done:
        d.step()
    # the short one's slot is free, but a static batch admits nothing until long finishes
    while not d.records[long].done:
        assert not d.records[third].tokens
        d.step()
    d.run_until_idle()
    assert d.records[third].done == [layout.Finish.LENGTH]


def test_stop_token_and_eos():
    eos = token_for(1, 2)
    d = Driver(small_config(eos_ids=(eos,)))
    h = d.submit([5, 6], 10)  # handle 1: its third token is eos
    stop = token_for(2, 1)
    h2 = d.submit([5], 10, stop_ids=(stop,))
    h3 = d.submit([5], 4, flags=layout.SqFlag.IGNORE_EOS)
    d.run_until_idle()
    assert d.records[h].done == [layout.Finish.STOP] and len(d.records[h].tokens) == 3
    assert d.records[h2].done == [layout.Finish.STOP] and d.records[h2].tokens[-1] == stop
    assert d.records[h3].done == [layout.Finish.LENGTH]


def test_abort_pending_and_running_requests():
    d = Driver(small_config(n_slots=1, sq_size=8))
    running = d.submit([1, 2], 50)
    waiting = d.submit([3], 50)
    d.step()
    d.step()
    assert d.abort(running) and d.abort(waiting)
    d.run_until_idle()
    assert d.records[running].done == [layout.Finish.ABORT]
    assert d.records[waiting].done == [layout.Finish.ABORT] and not d.records[waiting].tokens
    assert len(d.records[running].tokens) < 50
    assert d.rings.counters()["active_slots"] == 0
    # an abort for a finished request is ignored
    assert d.abort(running)
    d.run_until_idle()
    assert d.records[running].done == [layout.Finish.ABORT]


def _in_sq(d: Driver, handle: int) -> bool:
    """Whether the GENERATE of `handle` is still in the SQ (not drained by the device)."""
    head = int(d.a["ctl"][0]["sq_head"])
    return (d.sq_pos[handle] - head) % 2**32 < 2**31


def _fill_device(d: Driver, max_tokens: int) -> list[int]:
    """Submits until the slots, the pending queue and the SQ are all full."""
    handles = []
    while True:
        h = d.submit([1, 2], max_tokens)
        if h is None:
            ctl = d.rings.counters()
            if ctl["pending"] == d.cfg.pending_cap and ctl["active_slots"] == d.cfg.n_slots:
                return handles
            d.step()
        else:
            handles.append(h)


def test_abort_of_a_request_still_in_the_sq():
    """pending is full, so the GENERATE waits in the SQ; its abort must not wait behind it."""
    d = Driver(small_config(n_slots=1, sq_size=16, pending_cap=4, cq_size=64))
    handles = [d.submit([1, 2], 3) for _ in range(10)]
    d.step()
    d.step()
    victim = handles[7]
    assert _in_sq(d, victim) and int(d.a["sched"][0]["n_pending"]) == 4
    assert d.abort(victim)
    d.step()
    assert _in_sq(d, victim) and not d.records[victim].done  # marked, applied once drained
    while _in_sq(d, victim):
        d.step()
    assert d.records[victim].done == [layout.Finish.ABORT], "DONE in the step that drains it"
    d.run_until_idle()
    assert d.records[victim].done == [layout.Finish.ABORT] and not d.records[victim].tokens
    for h in handles:
        if h != victim:
            assert d.records[h].done == [layout.Finish.LENGTH]
            assert d.records[h].tokens == [token_for(h, i) for i in range(3)]
    assert d.rings.counters()["aborts"] == 1
    assert not d.a["sq_cancel"].any()


def test_abort_all_with_everything_full_ends_every_request_within_a_few_steps():
    cfg = small_config(n_slots=2, sq_size=16, pending_cap=4, cq_size=64, arena_size=256)
    d = Driver(cfg)
    handles = _fill_device(d, max_tokens=1000)
    assert d.rings.submissions.free_entries() == 0 and len(handles) == 16 + 4 + 2
    drained = {h for h in handles if not _in_sq(d, h)}
    assert len(drained) == 6
    tokens_before = {h: len(d.records[h].tokens) for h in handles}
    assert all(d.abort(h) for h in handles), "the abort ring holds every request the device can"
    for n_steps in range(1, cfg.sq_size // cfg.pending_cap + 4):
        d.step()
        if n_steps == 1:
            assert all(d.records[h].done for h in drained), "drained requests end in one step"
        if all(d.records[h].done for h in handles):
            break
    assert n_steps <= cfg.sq_size // cfg.pending_cap + 1
    for h in handles:
        rec = d.records[h]
        assert rec.done == [layout.Finish.ABORT]
        assert len(rec.tokens) == tokens_before[h], "no token after the abort"
    ctl = d.rings.counters()
    assert ctl["aborts"] == ctl["finished"] == len(handles)
    assert ctl["active_slots"] == 0 and ctl["pending"] == 0
    assert d.step() == layout.StepStatus.IDLE


def test_a_stale_abort_is_ignored():
    d = Driver(small_config(n_slots=1, sq_size=4))
    old = d.submit([1, 2], 2)
    d.run_until_idle()
    for _ in range(3):  # the next request lands on the SQ entry the old one used
        d.submit([5], 1)
    d.run_until_idle()
    later = d.submit([3, 4], 4)
    assert d.sq_pos[later] % 4 == d.sq_pos[old] % 4
    assert d.abort(old)
    d.run_until_idle()
    assert d.records[old].done == [layout.Finish.LENGTH]
    assert d.records[later].done == [layout.Finish.LENGTH]
    assert d.records[later].tokens == [token_for(later, i) for i in range(4)]
    assert d.rings.counters()["aborts"] == 0
    assert not d.a["sq_cancel"].any()


def test_aborts_of_undrained_entries_across_the_u32_wrap():
    """The SQ and abort-ring indices start 6 below 2**32; the aborted GENERATEs sit on both sides
    of the wrap, still in the SQ (pending_cap 4), and one more is already pending."""
    cfg = small_config(n_slots=1, sq_size=16, pending_cap=4, cq_size=64)
    d = Driver(cfg, start_index=2**32 - 6)
    handles = [d.submit([1, 2], 3) for _ in range(12)]
    d.step()  # drains 4, admits 1, then drains 1 more for the step it builds
    undrained = [h for h in handles if _in_sq(d, h)]
    assert {d.sq_pos[h] for h in undrained[:3]} == {2**32 - 1, 0, 1}
    aborted = [handles[2]] + undrained[:3] + [undrained[5]]
    assert all(d.abort(h) for h in aborted)
    d.step()
    late = undrained[-1]  # its abort takes the abort ring's last index before the wrap
    assert int(d.a["ctl"][0]["aq_head"]) == 2**32 - 1 and d.abort(late)
    aborted.append(late)
    d.run_until_idle()
    assert int(d.a["ctl"][0]["aq_head"]) == 0
    for h in handles:
        rec = d.records[h]
        if h in aborted:
            assert rec.done == [layout.Finish.ABORT] and not rec.tokens
        else:
            assert rec.done == [layout.Finish.LENGTH]
            assert rec.tokens == [token_for(h, i) for i in range(3)]
    assert d.rings.counters()["aborts"] == len(aborted)


def test_a_step_whose_drained_entries_were_all_aborted_drains_more_instead_of_idling():
    """Backends sleep on an idle step until the host rings; the SQ's remaining entries must not
    wait for that."""
    d = Driver(small_config(n_slots=1, sq_size=8, pending_cap=2))
    first, second, third = (d.submit([1, 2], 2) for _ in range(3))
    assert d.abort(first) and d.abort(second)
    assert d.step() == layout.StepStatus.RUN
    assert d.records[first].done == d.records[second].done == [layout.Finish.ABORT]
    assert d.a["slots"][0]["handle"] == third
    d.run_until_idle()
    assert d.records[third].done == [layout.Finish.LENGTH]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_aborts_at_random_times_end_each_request_once(data):
    n_slots = data.draw(st.integers(1, 3), label="n_slots")
    pending_cap = data.draw(st.sampled_from([2, 4, 8]), label="pending_cap")
    d = Driver(
        small_config(
            n_slots=n_slots, token_budget=8, sq_size=8, pending_cap=pending_cap, cq_size=64, arena_size=256
        )
    )
    aborted: set[int] = set()
    ops = data.draw(
        st.lists(
            st.tuples(
                st.sampled_from(["submit", "abort", "step"]), st.integers(1, 12), st.integers(0, 10**6)
            ),
            min_size=1,
            max_size=120,
        ),
        label="ops",
    )
    for op, n, pick in ops:
        if op == "submit":
            d.submit(np.arange(n % 5 + 1, dtype=np.int32), n)
        elif op == "abort" and d.records:
            h = sorted(d.records)[pick % len(d.records)]  # live, queued or long finished
            if d.abort(h):
                aborted.add(h)
        else:
            d.step(drain=pick % 4 != 0)  # sometimes the host reads the CQ a step late
    d.run_until_idle()
    for h, rec in d.records.items():
        assert len(rec.done) == 1
        assert rec.indices == list(range(len(rec.tokens)))
        assert rec.tokens == [token_for(h, i) for i in range(len(rec.tokens))]
        if rec.done == [layout.Finish.ABORT]:
            assert h in aborted and len(rec.tokens) < rec.max_tokens
        else:  # not aborted, or it finished before its abort was applied
            assert rec.done == [layout.Finish.LENGTH] and len(rec.tokens) == rec.max_tokens
    ctl = d.rings.counters()
    assert ctl["finished"] == len(d.records)
    assert ctl["aborts"] == sum(r.done == [layout.Finish.ABORT] for r in d.records.values())
    assert not d.a["sq_cancel"].any()


def test_full_cq_makes_the_scheduler_wait_not_drop():
    cfg = small_config(n_slots=4, token_budget=4, cq_size=16, pending_cap=8)
    d = Driver(cfg)
    for _ in range(4):
        d.submit([1], 30)
    # the host does not read the CQ for a while: the scheduler must stall, then resume
    t = threading.Thread(target=lambda: [d.step(drain=False) for _ in range(12)])
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "the scheduler should be waiting for CQ space"
    assert d.rings.counters()["cq_stalls"] >= 1
    while t.is_alive():
        d.drain_cq()
        time.sleep(0.01)
    t.join()
    d.run_until_idle()
    for rec in d.records.values():
        assert rec.tokens == [token_for(rec.handle, i) for i in range(30)]
        assert rec.done == [layout.Finish.LENGTH]


def test_shutdown_while_waiting_for_cq_space_returns():
    d = Driver(small_config(n_slots=4, token_budget=4, cq_size=16))
    for _ in range(4):
        d.submit([1], 30)
    t = threading.Thread(target=lambda: [d.step(drain=False) for _ in range(12)])
    t.start()
    time.sleep(0.2)
    d.rings.request_shutdown()
    t.join(timeout=5)
    assert not t.is_alive()


def test_init_rejects_a_foreign_layout():
    d = Driver(small_config())
    d.a["cfg"][0]["magic"] = 0xDEADBEEF
    from tests.sched_driver import scheduler

    assert scheduler().init(d.mem.context_address) == layout.InitError.BAD_MAGIC
    d.a["cfg"][0]["magic"] = layout.MAGIC
    d.a["cfg"][0]["layout_fingerprint"] ^= 1
    assert scheduler().init(d.mem.context_address) == layout.InitError.BAD_FINGERPRINT


@pytest.mark.parametrize("bad", [dict(sq_size=6), dict(token_budget=2, n_slots=4)])
def test_ring_config_rejects_bad_sizes(bad):
    with pytest.raises(ValueError):
        small_config(**bad)
