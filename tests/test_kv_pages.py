"""The KV pages the scheduler allocates (the real CPU build over real rings): random admit /
grow / finish / abort / preempt sequences keep the pool whole, no page is in two live
sequences, every row the step lays out has its page, and every request still gets each of its
tokens once and exactly one DONE."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from tests.sched_driver import Driver, token_for

S = layout.SlotState


def paged_config(**kw) -> RingConfig:
    base = dict(
        n_slots=6,
        max_ctx=64,
        token_budget=12,
        sq_size=8,
        cq_size=128,
        arena_size=512,
        pending_cap=16,
        page_size=4,
        n_pages=20,  # 16 pages hold one request of max_ctx: the rest is all the sharing there is
    )
    base.update(kw)
    return RingConfig(**base)


def pages_of(d: Driver, slot: int) -> list[int]:
    n = int(d.a["slots"][slot]["n_pages"])
    m = d.cfg.pages_per_slot
    return [int(p) for p in d.a["block_table"][slot * m : slot * m + n]]


NO_POS = 0xFFFFFFFF
CELL_GONE = 0xFFFFFFFE


def lru_pages(d: Driver) -> list[int]:
    """The live entries of the prefix cache's lru ring, least recently used first."""
    st = d.a["sched"][0]
    head, tail, size = int(st["lru_head"]), int(st["lru_tail"]), len(d.a["lru"])
    ring = [int(d.a["lru"][i % size]) for i in range(head, head + ((tail - head) & 0xFFFFFFFF))]
    return [p for p in ring if p != CELL_GONE]


def check_pool(d: Driver) -> None:
    """free + held + cached-unheld = pool, each page in exactly one; ref counts are the block
    tables holding a page; the table and the lru ring agree with the page records; only slots
    that may still be read by a step (running, or aborted with its step in flight) hold pages;
    slots sharing a page share its tokens (a hit was right)."""
    pages, ps = d.a["pages"], d.cfg.page_size
    n_free = int(d.a["sched"][0]["n_free_pages"])
    free = [int(p) for p in d.a["free_pages"][:n_free]]
    held: dict[int, list[tuple[int, int]]] = {}  # page -> (slot, index) of every holder
    for s, sl in enumerate(d.a["slots"]):
        mine = pages_of(d, s)
        if int(sl["state"]) in (S.FREE, S.ENDING, S.PREEMPTED):
            assert not mine, f"slot {s} in state {S(int(sl['state'])).name} still holds pages {mine}"
        if int(sl["state"]) == S.PREFILL:
            need = -(-int(sl["fill_len"]) // ps)
            assert len(mine) == need, f"prefilling slot {s} holds {len(mine)} pages, needs {need}"
        assert len(set(mine)) == len(mine), f"slot {s} holds a page twice: {mine}"
        for j, p in enumerate(mine):
            held.setdefault(p, []).append((s, j))
    cached_free = lru_pages(d)
    assert len(set(free)) == len(free), "a page is on the free list twice"
    assert len(set(cached_free)) == len(cached_free), "a page is in the lru ring twice"
    assert not set(free) & set(held) and not set(cached_free) & set(held), "an unheld page is held"
    assert not set(free) & set(cached_free), "a page is both free and cached-unheld"
    assert sorted(free + cached_free + list(held)) == list(range(d.cfg.n_pages)), "pages leaked"
    assert int(d.a["sched"][0]["n_cached_free"]) == len(cached_free)
    for p, holders in held.items():
        assert int(pages[p]["ref_count"]) == len(holders), f"page {p}: refs vs holders {holders}"
        if len(holders) > 1 or int(pages[p]["table_pos"]) != NO_POS:
            (s0, j0), m = holders[0], d.cfg.max_ctx
            want = d.a["slot_tokens"][s0 * m + j0 * ps : s0 * m + (j0 + 1) * ps]
            for s, j in holders:
                assert j == j0, f"page {p} at different depths {holders}"
                got = d.a["slot_tokens"][s * m + j * ps : s * m + (j + 1) * ps]
                assert (got == want).all(), f"page {p} shared by slots with other tokens"
                assert j < int(d.a["slots"][s]["n_cached"]), f"slot {s} shares page {p} it has not cached"
    assert all(int(pages[p]["ref_count"]) == 0 for p in free + cached_free)
    assert all(int(pages[p]["table_pos"]) == NO_POS for p in free), "a free page is still cached"
    for p in cached_free:
        pos = int(pages[p]["table_pos"])
        assert pos != NO_POS and int(d.a["prefix_table"][pos]) == p, f"lru page {p} is not in the table"
        assert d.a["lru"][int(pages[p]["lru_pos"]) % len(d.a["lru"])] == p
    for pos, cell in enumerate(d.a["prefix_table"]):
        if int(cell) < NO_POS - 1:
            assert int(pages[int(cell)]["table_pos"]) == pos, f"table cell {pos} names page {cell}"
    ctl = d.a["ctl"][0]
    assert int(ctl["kv_pages_free"]) <= d.cfg.n_pages
    assert int(ctl["prefix_cache_hits"]) <= int(ctl["prefix_cache_queries"])


def check_rows_have_pages(d: Driver, step: dict) -> None:
    """Every row of the step the scheduler just built writes into a page its slot holds alone
    and the prefix cache does not hold: no cached page changes under a reader."""
    for slot, pos in zip(step["slot_of"], step["positions"]):
        held = pages_of(d, int(slot))
        j = int(pos) // d.cfg.page_size
        assert j < len(held), f"slot {slot} position {pos} has no page"
        page = d.a["pages"][held[j]]
        assert int(page["ref_count"]) == 1 and int(page["table_pos"]) == NO_POS, (
            f"slot {slot} writes position {pos} into shared or cached page {held[j]}"
        )


def check_streams(d: Driver) -> None:
    for rec in d.records.values():
        n = len(rec.tokens)
        assert rec.indices == list(range(n)), f"handle {rec.handle}: indices {rec.indices}"
        assert rec.tokens == [token_for(rec.handle, i) for i in range(n)]
        assert len(rec.done) == 1, f"handle {rec.handle}: DONEs {rec.done}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_sequences_keep_the_pool_whole_and_every_stream_exact(data):
    n_slots = data.draw(st.integers(1, 6), label="n_slots")
    n_pages = data.draw(st.integers(16, 40), label="n_pages")
    policy = data.draw(st.sampled_from([layout.Policy.FIFO, layout.Policy.PRIORITY]), label="policy")
    d = Driver(paged_config(n_slots=n_slots, n_pages=n_pages, token_budget=max(n_slots, 12), policy=policy))
    ops = data.draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("submit"), st.integers(1, 50), st.integers(1, 40), st.integers(0, 3)),
                st.tuples(st.just("abort"), st.integers(0, 30)),
                st.tuples(st.just("step"), st.integers(1, 6)),
            ),
            min_size=1,
            max_size=40,
        ),
        label="ops",
    )
    for op in ops:
        if op[0] == "submit":
            d.submit(np.arange(op[1], dtype=np.int32) % 97 + 3, op[2], priority=op[3])
        elif op[0] == "abort" and d.records:
            handles = sorted(d.records)
            d.abort(handles[op[1] % len(handles)])
        else:
            for _ in range(op[1]):
                before = len(d.steps)
                d.step()
                if len(d.steps) > before:
                    check_rows_have_pages(d, d.steps[-1])
                check_pool(d)
    for _ in range(20_000):
        before = len(d.steps)
        idle = d.step() == layout.StepStatus.IDLE
        if len(d.steps) > before:
            check_rows_have_pages(d, d.steps[-1])
        check_pool(d)
        if idle and d.rings.completions.pending() == 0 and all(r.done for r in d.records.values()):
            break
    check_streams(d)
    st_ = d.a["sched"][0]
    assert int(st_["n_free_pages"]) + int(st_["n_cached_free"]) == d.cfg.n_pages, "pages not all back"


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_decode_out_of_pages_preempts_the_youngest_and_it_recomputes_what_it_streamed(prefix_caching):
    # two requests of 20 prompt tokens and 40 new ones: each ends at 60 positions = 15 pages of
    # 4, and the pool has 20, so the younger is preempted once the older needs its pages
    d = Driver(paged_config(n_slots=2, token_budget=64, prefix_caching=prefix_caching))
    old = d.submit(np.arange(20, dtype=np.int32) + 3, 40)
    d.step()
    young = d.submit(np.arange(20, dtype=np.int32) + 50, 40)
    preempted_at = None
    for _ in range(2_000):
        d.step()
        check_pool(d)
        slots = d.a["slots"]
        states = {int(sl["handle"]): int(sl["state"]) for sl in slots}
        if preempted_at is None and states.get(young) == S.PREEMPTED:
            preempted_at = len(d.records[young].tokens)
            assert states[old] == S.DECODE, "the older request keeps running"
        if all(r.done for r in d.records.values()):
            break
    assert preempted_at is not None and 0 < preempted_at < 40, "the younger request was never preempted"
    assert int(d.a["ctl"][0]["preemptions"]) >= 1
    check_streams(d)
    assert len(d.records[old].tokens) == len(d.records[young].tokens) == 40
    # the recompute fed the prompt and every token generated before the preemption, in one
    # chunk; with prefix caching, from the first of its pages no longer cached (a page boundary)
    young_rec = d.records[young]
    want = list(young_rec.prompt) + young_rec.tokens[:preempted_at]
    young_slot = next(s for s, sl in enumerate(d.a["slots"]) if int(sl["handle"]) == young)
    chunks = {
        int(step["positions"][start]): step["tokens"][start : start + n].tolist()
        for step in d.steps[1:]
        for slot, start, n in step["seg"]
        if slot == young_slot and start + n <= len(step["tokens"]) and n > 1
    }
    resumed_from = [p for p, toks in chunks.items() if toks == want[p:] and p % d.cfg.page_size == 0]
    assert resumed_from, "no recompute of the prompt and the tokens already streamed"
    if prefix_caching:
        assert max(resumed_from) > 0, "the recompute found none of its own pages cached"
    else:
        assert 0 in resumed_from


@pytest.mark.parametrize("policy", [layout.Policy.FIFO, layout.Policy.PRIORITY])
def test_under_the_priority_policy_the_lowest_priority_loses_its_pages_first(policy):
    # the same two requests as above, the younger sent at a higher priority: under fifo the
    # younger is still preempted; under priority the older, less urgent one is
    d = Driver(paged_config(n_slots=2, token_budget=64, policy=policy))
    old = d.submit(np.arange(20, dtype=np.int32) + 3, 40, priority=0)
    d.step()
    young = d.submit(np.arange(20, dtype=np.int32) + 50, 40, priority=5)
    victims = set()
    for _ in range(2_000):
        d.step()
        check_pool(d)
        victims |= {int(sl["handle"]) for sl in d.a["slots"] if int(sl["state"]) == S.PREEMPTED}
        if all(r.done for r in d.records.values()):
            break
    assert victims == ({old} if policy == layout.Policy.PRIORITY else {young})
    check_streams(d)
    assert len(d.records[old].tokens) == len(d.records[young].tokens) == 40


def run_two_until_one_is_preempted(d: Driver) -> tuple[int, int]:
    """Two requests of 20 prompt tokens and 40 new ones (15 pages of 4 each at the end, in a
    pool of 20), the second sent a step later; steps until one of them is preempted."""
    first = d.submit(np.arange(20, dtype=np.int32) + 3, 40)
    d.step()
    second = d.submit(np.arange(20, dtype=np.int32) + 50, 40)
    for _ in range(2_000):
        d.step()
        if any(int(sl["state"]) == S.PREEMPTED for sl in d.a["slots"]):
            return first, second
    raise AssertionError("nothing was preempted")


@pytest.mark.parametrize("policy", [layout.Policy.FIFO, layout.Policy.PRIORITY])
def test_a_preempted_request_waits_only_for_requests_more_urgent_than_it(policy):
    # A and B (priority 0) outgrow the pool and B is preempted; then C (priority 5) and D
    # (priority -5) arrive, each small enough to fit beside A.  Under priority C runs before B
    # comes back, and D still waits behind B; under fifo both wait behind B, as they always have.
    d = Driver(paged_config(n_slots=4, token_budget=64, policy=policy, aging_steps=10_000))
    a, b = run_two_until_one_is_preempted(d)
    b_streamed = len(d.records[b].tokens)
    c = d.submit(np.arange(8, dtype=np.int32) + 200, 4, priority=5)
    low = d.submit(np.arange(8, dtype=np.int32) + 300, 4, priority=-5)
    streamed_by = {b: b_streamed, c: 0, low: 0}  # a request has run again once it streams more
    ran_at: dict[int, int] = {}
    for n in range(5_000):
        d.step()
        check_pool(d)
        for h, before in streamed_by.items():
            if h not in ran_at and len(d.records[h].tokens) > before:
                ran_at[h] = n
        if all(r.done for r in d.records.values()):
            break
    check_streams(d)
    assert all(len(d.records[h].tokens) == d.records[h].max_tokens for h in (a, b, c, low))
    if policy == layout.Policy.PRIORITY:
        assert ran_at[c] < ran_at[b], "the urgent request waited for a less urgent preempted one"
    else:
        assert ran_at[c] >= ran_at[b], "fifo: a new request overtook a preempted one"
    assert ran_at[low] >= ran_at[b], "a less urgent request overtook a preempted one"


def random_run(d: Driver, rng: np.random.Generator, make_prompt, n_steps: int = 300) -> None:
    """Random submits (make_prompt(rng) each, at a random priority), aborts and steps, every
    step checked; then runs idle: the pool whole, every stream exact, and some request preempted."""
    for _ in range(n_steps):
        if rng.random() < 0.4:
            d.submit(make_prompt(rng), int(rng.integers(1, 30)), priority=int(rng.integers(-3, 4)))
        if rng.random() < 0.05 and d.records:
            d.abort(int(rng.choice(sorted(d.records))))
        before = len(d.steps)
        d.step()
        if len(d.steps) > before:
            check_rows_have_pages(d, d.steps[-1])
        check_pool(d)
    d.run_until_idle()
    check_pool(d)
    check_streams(d)
    assert int(d.a["ctl"][0]["preemptions"]) > 0, "the pool was never tight enough to preempt"
    st_ = d.a["sched"][0]
    assert int(st_["n_free_pages"]) + int(st_["n_cached_free"]) == d.cfg.n_pages


@pytest.mark.parametrize("policy", [layout.Policy.FIFO, layout.Policy.PRIORITY])
def test_a_long_random_run_under_a_tight_pool_preempts_and_stays_exact(policy):
    d = Driver(paged_config(n_slots=6, n_pages=24, token_budget=16, policy=policy, aging_steps=8))
    random_run(d, np.random.default_rng(7), lambda rng: np.arange(int(rng.integers(1, 40))) % 89 + 3)


def test_a_prompt_waits_until_its_pages_fit():
    # 16 pages of 4 hold one 60-token prompt (15 pages); a second must wait for the first to end
    d = Driver(paged_config(n_slots=4, n_pages=16, token_budget=64))
    first = d.submit(np.arange(60, dtype=np.int32) + 3, 3)
    second = d.submit(np.arange(60, dtype=np.int32) + 100, 3)  # no prefix to share
    d.step()
    d.step()
    states = {int(sl["handle"]): int(sl["state"]) for sl in d.a["slots"]}
    assert first in states and second not in states, "admitted without pages for its prompt"
    assert int(d.a["sched"][0]["n_pending"]) == 1
    d.run_until_idle()
    check_streams(d)
    assert int(d.a["ctl"][0]["preemptions"]) == 0


def test_an_aborted_preempted_request_gets_one_done_and_no_pages_leak():
    d = Driver(paged_config(n_slots=2, token_budget=64))
    _, young = run_two_until_one_is_preempted(d)
    d.abort(young)
    d.run_until_idle()
    check_pool(d)
    check_streams(d)
    assert d.records[young].done == [layout.Finish.ABORT]
    st_ = d.a["sched"][0]
    assert int(st_["n_free_pages"]) + int(st_["n_cached_free"]) == d.cfg.n_pages
