"""Speculative decoding in the scheduler (device/sched/sched_spec.h), driven over real rings by
the CPU build with a stand-in sampler whose token is a function of the request and the token's
index, as the real sampler's seeded draw is: every request's tokens, indices, logprobs records
and finish must be the same with drafts as without, in fewer steps where text repeats."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from tests.sched_driver import Driver, token_for

PASSAGE_LEN = 48


def passage(handle: int) -> np.ndarray:
    """Request `handle`'s prompt: a text of distinct-looking tokens (no accidental repeats)."""
    rng = np.random.default_rng(handle)
    return rng.choice(np.arange(10, 900), size=PASSAGE_LEN, replace=False).astype(np.int32)


def copying(handle: int, index: int) -> int:
    """The stand-in that quotes its prompt: token i is the passage's token (3 + i), wrapping."""
    return int(passage(handle)[(3 + index) % PASSAGE_LEN])


def half_copying(handle: int, index: int) -> int:
    """Quotes, but every 7th token is its own (a draft fails there, then the quote resumes)."""
    return token_for(handle, index) + 1000 if index % 7 == 6 else copying(handle, index)


def run(cfg: RingConfig, requests, token_fn, step_limit: int = 20_000):
    """Submits every request at once (retrying while the rings are full), runs to idle; returns
    the driver."""
    d = Driver(cfg, token_fn=token_fn)
    queue = list(requests)
    for _ in range(step_limit):
        while queue and d.submit(queue[0][0], queue[0][1], **queue[0][2]) is not None:
            queue.pop(0)
        if not queue and d.step() == layout.StepStatus.IDLE and d.rings.completions.pending() == 0:
            return d
        if queue:
            d.step()
    raise AssertionError("never idle")


def outputs(d: Driver) -> dict:
    return {
        h: (r.tokens, r.indices, r.done, [int(lp["n_top"]) for lp in r.logprobs] if r.logprobs else None)
        for h, r in d.records.items()
    }


def config(**kw) -> RingConfig:
    base = dict(
        n_slots=4, max_ctx=256, token_budget=64, sq_size=64, cq_size=1024, pending_cap=16, prefix_seed=7
    )
    return RingConfig(**{**base, **kw})


def requests(n: int, max_tokens: int = 60, **sampling):
    return [(passage(h), max_tokens, dict(sampling)) for h in range(1, n + 1)]


@pytest.mark.parametrize("token_fn", [copying, half_copying, token_for], ids=["copy", "half", "random"])
@pytest.mark.parametrize("n_requests", [1, 6])
def test_drafts_change_no_output_and_save_steps_where_text_repeats(token_fn, n_requests):
    reqs = requests(n_requests, logprobs=1)
    off = run(config(), reqs, token_fn)
    on = run(config(spec_tokens=4), reqs, token_fn)
    assert outputs(on) == outputs(off)
    for r in on.records.values():
        assert r.indices == list(range(len(r.tokens))) and len(r.done) == 1
    c = on.rings.counters()
    assert c["spec_accepted_tokens"] <= c["spec_draft_tokens"]
    assert c["generated"] == sum(len(r.tokens) for r in on.records.values())
    if token_fn is copying:  # nearly every token after the first few comes from a draft
        assert c["spec_accepted_tokens"] >= 0.6 * c["generated"]
        assert len(on.steps) < 0.5 * len(off.steps)
    if token_fn is token_for:  # no text repeats: hardly a draft
        assert c["spec_accepted_tokens"] <= 0.05 * c["generated"]


def test_a_verification_lays_out_the_newest_token_then_the_draft():
    d = run(config(spec_tokens=3), requests(1, max_tokens=30), copying)
    verifications = [st for st in d.steps if st["n_tokens"] > 1 and st["n_decode"] == 1]
    assert verifications
    for st in verifications:
        ((slot, start, n),) = st["seg"]
        pos = st["positions"][start : start + n]
        assert list(pos) == list(range(int(pos[0]), int(pos[0]) + n))  # consecutive positions
        assert st["n_samples"] == n and list(st["sample_row"]) == list(range(start, start + n))
        assert list(st["counter"]) == list(range(int(st["counter"][0]), int(st["counter"][0]) + n))
        assert int(st["sample_slot"][0]) == slot  # a slot's first sample stays in its own place
        # the draft is the passage's continuation: the tokens after the newest in the prompt
        prompt = passage(1)
        newest = int(st["tokens"][start])
        at = int(np.flatnonzero(prompt == newest)[0])
        assert list(st["tokens"][start + 1 : start + n]) == list(prompt[at + 1 : at + n])


@pytest.mark.parametrize("spec_tokens", [1, 2, 8])
def test_stops_max_tokens_and_the_context_end_inside_a_draft(spec_tokens):
    # stop ids that the quote reaches mid-draft, short max_tokens, and a context that ends
    # inside a draft (max_ctx 72: 48 prompt tokens, so at most 24 generated)
    reqs = []
    for h in range(1, 9):
        stop = [int(passage(h)[3 + 5 + h])] if h % 3 == 0 else []
        reqs.append((passage(h), [5, 9, 100, 33][h % 4], {"stop_ids": stop, "logprobs": 2}))
    for max_ctx in (256, 72):
        off = run(config(max_ctx=max_ctx), reqs, copying)
        on = run(config(max_ctx=max_ctx, spec_tokens=spec_tokens), reqs, copying)
        assert outputs(on) == outputs(off)


def test_preemption_and_aborts_keep_every_request_whole():
    # a small page pool (preemption as decode grows) and aborts in mid-draft
    cfg_off = config(n_slots=6, page_size=4, n_pages=64, max_ctx=120)
    cfg_on = dataclasses.replace(cfg_off, spec_tokens=4)
    reqs = requests(10, max_tokens=70)
    off, on = run(cfg_off, reqs, copying), run(cfg_on, reqs, copying)
    assert outputs(on) == outputs(off)
    assert on.rings.counters()["preemptions"] > 0
    # aborts: each request gets one DONE, and its tokens are a prefix of the full answer
    d = Driver(cfg_on, token_fn=copying)
    handles = [d.submit(p, m, **kw) for p, m, kw in requests(6, max_tokens=70)]
    for i in range(60):
        d.step()
        if i in (7, 12, 20):
            d.abort(handles[i % 6])
    d.run_until_idle()
    for h in handles:
        r = d.records[h]
        assert len(r.done) == 1 and r.indices == list(range(len(r.tokens)))
        assert r.tokens == [copying(h, i) for i in range(len(r.tokens))]


def test_no_drafts_above_the_batch_limit_nor_for_penalized_requests():
    many = run(config(n_slots=6, spec_tokens=4, spec_max_batch=3), requests(6), copying)
    steps_with_6 = [st for st in many.steps if st["n_decode"] == 6]
    assert steps_with_6 and all(st["n_tokens"] == 6 for st in steps_with_6)
    penalized = run(config(spec_tokens=4, vocab_size=2000), requests(2, presence_penalty=0.5), copying)
    assert penalized.rings.counters()["spec_drafts"] == 0
    plain = run(config(spec_tokens=4, vocab_size=2000), requests(2), copying)
    assert plain.rings.counters()["spec_drafts"] > 0
