"""Ring mechanics: wrap-around, full and empty, for the SQ, the abort ring, the CQ and the prompt
arena."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringleader.device.backends.host_memory import HostMemory
from ringleader.ipc import layout
from ringleader.ipc.rings import AbortQueue, PromptArena, RingConfig
from ringleader.ipc.sampling_params import SamplingParams
from tests.sched_driver import Driver, token_for


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 10**6)), max_size=80))
def test_arena_never_hands_out_live_tokens_and_reclaims_in_order(ops):
    arena = PromptArena(np.zeros(64, dtype=np.int32))
    live = {}  # start -> tokens
    for is_alloc, n, pick in ops:
        if is_alloc or not live:
            tokens = np.arange(n, dtype=np.int32) + pick
            fits = arena.can_allocate(n)
            start = arena.allocate(tokens)
            assert (start is not None) == fits
            if start is not None:
                live[start] = tokens
        else:
            start = sorted(live)[pick % len(live)]
            arena.release(start)
            del live[start]
        for s, toks in live.items():  # every live prompt still reads back intact, across the wrap
            idx = (s + np.arange(len(toks))) % 64
            assert (arena._arena[idx] == toks).all()
        assert arena.used() >= sum(len(t) for t in live.values())
        assert arena.used() <= 64
    for s in list(live):
        arena.release(s)
    assert arena.used() == 0 and arena.can_allocate(64) and not arena.can_allocate(65)


def test_sq_full_and_empty():
    mem = HostMemory(
        RingConfig(n_slots=1, token_budget=4, sq_size=4, cq_size=64, pending_cap=2, arena_size=64, max_ctx=32)
    )
    sq = mem.rings.submissions
    assert sq.free_entries() == 4
    params = SamplingParams(max_tokens=1, seed=0)
    positions = [sq.push(h + 1, params, prompt_off=0, prompt_len=1) for h in range(4)]
    assert positions == [0, 1, 2, 3]  # push returns the SQ position
    assert (mem.arrays["sq"]["op"] == layout.Op.GENERATE).all()
    assert sq.free_entries() == 0
    assert not mem.rings.completions.take().size  # empty CQ reads nothing
    assert mem.rings.completions.pending() == 0
    assert sq.publish() and not sq.publish()  # nothing new the second time


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_indices_wrap_at_32_bits(start):
    """Ring indices are free-running u32 counters: start them anywhere, including just below the
    wrap, and everything still arrives."""
    cfg = RingConfig(
        n_slots=2, token_budget=4, sq_size=4, cq_size=64, pending_cap=4, arena_size=64, max_ctx=32
    )
    d = Driver(cfg, start_index=start or 1)
    for _ in range(6):
        assert d.submit([1, 2, 3], 5) is not None
        d.step()
    d.run_until_idle()
    for rec in d.records.values():
        assert rec.tokens == [token_for(rec.handle, i) for i in range(5)]
        assert rec.done == [layout.Finish.LENGTH]


def _abort_ring(start: int, aq_size: int = 4):
    cfg = RingConfig(
        n_slots=1,
        token_budget=4,
        sq_size=4,
        cq_size=64,
        pending_cap=2,
        arena_size=64,
        max_ctx=32,
        aq_size=aq_size,
    )
    mem = HostMemory(cfg)
    ctl = mem.arrays["ctl"][0]
    ctl["aq_tail"] = ctl["aq_head"] = start
    return AbortQueue(mem.arrays["ctl"], mem.arrays["aq"]), ctl, mem.arrays["aq"]


def test_abort_ring_full_publish_and_wrap():
    start = 2**32 - 2  # the free-running u32 index wraps after two entries
    aq, ctl, entries = _abort_ring(start)
    assert aq.free_entries() == 4 and not aq.publish()
    assert all(aq.push(h, 100 + h) for h in range(1, 5))
    assert aq.free_entries() == 0 and not aq.push(5, 105)  # full: refused, nothing overwritten
    assert ctl["aq_tail"] == start, "nothing is visible before publish"
    assert aq.publish() and not aq.publish()
    assert ctl["aq_tail"] == (start + 4) % 2**32
    slots = [(start + i) % 4 for i in range(4)]
    assert [tuple(entries[i]) for i in slots] == [(h, 100 + h, 0) for h in range(1, 5)]
    ctl["aq_head"] = (start + 3) % 2**32  # the device consumed three
    assert aq.free_entries() == 3
    assert aq.push(6, 2**32 + 7, if_queued=True)  # sq_pos is a u32
    assert tuple(entries[(start + 4) % 4]) == (6, 7, layout.AbortFlag.IF_QUEUED)


def test_abort_ring_size_defaults_to_what_the_device_can_hold():
    cfg = RingConfig(n_slots=3, token_budget=4, sq_size=16, cq_size=64, pending_cap=4)
    assert cfg.aq_size == 32  # next power of two >= 16 + 4 + 3
    assert RingConfig(sq_size=16, pending_cap=8, n_slots=8, token_budget=8).aq_size == 32
    assert RingConfig(aq_size=8).aq_size == 8
    with pytest.raises(ValueError):
        RingConfig(aq_size=12)


def test_ring_config_refuses_what_the_scheduler_cannot_hold():
    from ringleader.ipc.limits import MAX_SLOTS

    big = MAX_SLOTS + 1  # the event scan packs a slot's token and done counts in 16 bits each
    with pytest.raises(ValueError, match=f"n_slots must be in \\[1, {MAX_SLOTS}\\], got {big}"):
        RingConfig(n_slots=big, token_budget=big, cq_size=1 << 18)
    with pytest.raises(ValueError, match="max_ctx must be >= 2, got 1"):
        RingConfig(max_ctx=1)
    with pytest.raises(ValueError, match="pending_cap must be >= 1, got 0"):
        RingConfig(pending_cap=0)
    assert RingConfig(n_slots=1, token_budget=1, max_ctx=2).pages_per_slot == 1
