"""The token counts the scheduler keeps for penalized requests (the real CPU build over real rings):
at admission a penalized request's row is reset and its prompt tokens marked, each consumed
sample counts once (before the next step's sampler can read the row), preemption keeps the row,
and requests without a penalty cost nothing (their rows are left alone)."""

from collections import Counter

import numpy as np

from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from tests.sched_driver import Driver

VOCAB = 1000  # token_for's range
S = layout.SlotState


def config(**kw) -> RingConfig:
    base = dict(
        n_slots=4,
        max_ctx=64,
        token_budget=16,
        sq_size=16,
        cq_size=256,
        arena_size=1024,
        pending_cap=16,
        page_size=4,
        vocab_size=VOCAB,
    )
    base.update(kw)
    return RingConfig(**base)


def counts_row(d: Driver, slot: int) -> np.ndarray:
    return d.a["token_counts"][slot * VOCAB : (slot + 1) * VOCAB]


def expected_row(prompt, output) -> np.ndarray:
    want = np.zeros(VOCAB, np.int64)
    want[np.asarray(prompt, np.int64)] = layout.PROMPT_MARK
    for tok, n in Counter(output).items():
        want[tok] += n
    return want


def slot_of(d: Driver, handle: int) -> int | None:
    slots = d.a["slots"]
    for s in range(d.cfg.n_slots):
        if int(slots[s]["handle"]) == handle and int(slots[s]["state"]) in (S.PREFILL, S.DECODE, S.PREEMPTED):
            return s
    return None


def test_a_penalized_request_counts_its_prompt_and_each_output_token_once():
    d = Driver(config())
    prompt = [5, 5, 7, 9, 9, 9, 11]
    h = d.submit(prompt, 12, presence_penalty=0.5)
    plain = d.submit([1, 2, 3], 12)  # no penalty: its row is never touched
    d.a["token_counts"][:] = 12345  # stale rows, as a slot's last tenant leaves them
    seen_running = 0
    while not d.records[h].done:
        d.step()
        s = slot_of(d, h)
        if s is None:
            continue
        seen_running += 1
        # the consumed samples are exactly the events written so far
        assert np.array_equal(counts_row(d, s), expected_row(prompt, d.records[h].tokens))
        p = slot_of(d, plain)
        if p is not None:
            assert np.all(counts_row(d, p) == 12345)
    assert seen_running >= 10 and len(d.records[h].tokens) == 12
    assert int(d.a["slots"]["flags"][0] | d.a["slots"]["flags"][1]) & layout.SqFlag.PENALIZED


def test_a_reused_slot_starts_from_its_new_prompt():
    d = Driver(config(n_slots=1, token_budget=8))
    first = d.submit([3, 4], 6, repetition_penalty=1.3)
    d.run_until_idle()
    assert d.records[first].done
    prompt = [8, 8, 2]
    second = d.submit(prompt, 6, frequency_penalty=-0.5)
    d.step()
    d.step()
    assert slot_of(d, second) == 0
    assert np.array_equal(counts_row(d, 0), expected_row(prompt, d.records[second].tokens))


def test_preemption_keeps_the_counts_of_what_was_generated():
    # a pool so small that two growing requests cannot both finish: the younger is preempted,
    # recomputes, and its counts still hold each token it streamed exactly once
    d = Driver(config(n_slots=2, max_ctx=32, page_size=4, n_pages=9, prefix_caching=False))
    a = d.submit([1, 2, 3, 4, 5], 24, presence_penalty=1.0, flags=layout.SqFlag.IGNORE_EOS)
    b = d.submit([6, 7, 8, 9, 10], 24, frequency_penalty=1.0, flags=layout.SqFlag.IGNORE_EOS)
    for _ in range(400):
        d.step()
        for h, prompt in ((a, [1, 2, 3, 4, 5]), (b, [6, 7, 8, 9, 10])):
            s = slot_of(d, h)
            if s is not None:
                assert np.array_equal(counts_row(d, s), expected_row(prompt, d.records[h].tokens))
        if d.records[a].done and d.records[b].done:
            break
    assert int(d.a["sched"][0]["preemptions"]) >= 1
    assert len(d.records[a].tokens) == 24 and len(d.records[b].tokens) == 24


def test_no_counts_are_kept_without_a_vocabulary():
    d = Driver(config(vocab_size=0))
    assert d.a["token_counts"].size == 0
    h = d.submit([1, 2, 3], 5, presence_penalty=2.0)
    d.run_until_idle()
    assert len(d.records[h].tokens) == 5 and d.records[h].done == [layout.Finish.LENGTH]
