"""Logprobs through the real CPU-built scheduler: a request that asks for them gets, beside each
TOKEN event, the record the step wrote for that very sample; a request that does not ask leaves
its events' cq_logprobs entries untouched (no extra ring traffic)."""

from __future__ import annotations

import numpy as np

from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from tests.sched_driver import Driver

UNTOUCHED = 0x5A


def _driver(**over) -> Driver:
    sizes = dict(
        n_slots=4, max_ctx=64, token_budget=16, sq_size=16, cq_size=64, arena_size=1024, pending_cap=16
    )
    d = Driver(RingConfig(**{**sizes, **over}))
    d.a["cq_logprobs"].view(np.uint8)[:] = UNTOUCHED
    return d


def _untouched(record: np.ndarray) -> bool:
    return bool((np.frombuffer(record.tobytes(), np.uint8) == UNTOUCHED).all())


def test_each_token_event_carries_its_own_samples_record_and_only_when_asked():
    d = _driver()
    asked = [d.submit(list(range(1, 6 + k)), 7 + k, logprobs=3) for k in range(3)]
    plain = [d.submit([9, 8, 7, 6], 9) for _ in range(3)]
    d.run_until_idle()
    for handle in asked:
        rec = d.records[handle]
        assert len(rec.tokens) == rec.max_tokens and rec.done
        for token, index, lp in zip(rec.tokens, rec.indices, rec.logprobs):
            # the record of this sample (counter = its index), not a neighbour's or a later step's
            assert lp["logprob"] == -float(token) and int(lp["n_top"]) == index
            assert (lp["top_ids"] == token).all()
    for handle in plain:
        rec = d.records[handle]
        assert len(rec.tokens) == rec.max_tokens
        assert all(_untouched(lp) for lp in rec.logprobs)


def test_records_survive_a_wrapping_cq_read_steps_late():
    # a small CQ wraps many times, read only every third step
    d = _driver(cq_size=16, n_slots=2, pending_cap=8)
    handles = [d.submit([1, 2, 3], 20, logprobs=0) for _ in range(2)]
    for _ in range(200):
        d.step(drain=len(d.steps) % 3 == 0)
    d.run_until_idle()
    for handle in handles:
        rec = d.records[handle]
        assert len(rec.tokens) == 20
        assert [int(lp["n_top"]) for lp in rec.logprobs] == rec.indices
        assert [-float(lp["logprob"]) for lp in rec.logprobs] == rec.tokens


def test_the_flag_follows_the_request():
    d = _driver()
    d.submit([1, 2, 3], 2, logprobs=5)
    d.submit([1, 2, 3], 2)
    sq = d.a["sq"]
    assert int(sq[0]["flags"]) & layout.SqFlag.LOGPROBS
    assert not int(sq[1]["flags"]) & layout.SqFlag.LOGPROBS
    assert int(sq[0]["sampling"]["logprobs"]) == 5 and int(sq[1]["sampling"]["logprobs"]) == -1
