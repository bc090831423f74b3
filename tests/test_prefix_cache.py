"""The prefix cache over the device's KV pages (device/sched/sched_prefix.h, the real CPU build over
real rings): the host's and the device's page keys agree, a shared prefix skips its prefill and
is counted, generated tokens' pages are found by a later prompt that resends them, eviction takes
the least recently used page first, and random admit / grow / finish / abort / preempt sequences
with hits keep the pool whole (tests/test_kv_pages.py's check_pool: free + held + cached = pool,
ref counts equal holders, no cached page written under a reader)."""

import numpy as np
import pytest

from ringleader.device.sched.build import cpu_scheduler
from ringleader.ipc import layout
from ringleader.ipc.prefix_keys import page_keys
from ringleader.ipc.rings import RingConfig, write_config
from tests.sched_driver import Driver
from tests.test_kv_pages import check_pool, check_streams, paged_config, random_run


def counters(d: Driver) -> tuple[int, int]:
    ctl = d.a["ctl"][0]
    return int(ctl["prefix_cache_queries"]), int(ctl["prefix_cache_hits"])


def first_chunk_start(d: Driver, handle: int, since: int) -> int:
    """The position of the first prefill row laid out for `handle` in steps after `since`."""
    slot = next(s for s, sl in enumerate(d.a["slots"]) if int(sl["handle"]) == handle)
    for step in d.steps[since:]:
        for g_slot, start, _ in step["seg"]:
            if g_slot == slot:
                return int(step["positions"][start])
    raise AssertionError(f"handle {handle} never ran")


def run(d: Driver, prompt, max_tokens: int) -> tuple[int, int]:
    """Runs one request to its end; returns (handle, the position its prefill started at)."""
    since = len(d.steps)
    h = d.submit(np.asarray(prompt, np.int32), max_tokens)
    d.run_until_idle()
    check_pool(d)
    assert d.records[h].done, "the request did not end"
    return h, first_chunk_start(d, h, since)


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
def test_host_and_device_page_keys_agree(page_size):
    cfg = RingConfig(n_slots=2, max_ctx=256, token_budget=64, page_size=page_size, prefix_seed=12345)
    view = np.zeros(1, layout.CONFIG.numpy_dtype())
    write_config(view, cfg)
    rng = np.random.default_rng(page_size)
    tokens = rng.integers(0, 2**31 - 1, size=7 * page_size + page_size // 2, dtype=np.int64).astype(np.int32)
    tokens[:page_size] = np.arange(page_size)  # small ids too
    host = page_keys(tokens, page_size, *cfg.prefix_secret)
    assert len(host) == 7 and len(set(host.tolist())) == 7
    lib, parent = cpu_scheduler(), 0
    for j in range(7):
        page = np.ascontiguousarray(tokens[j * page_size : (j + 1) * page_size])
        parent = lib.page_key(view.ctypes.data, parent, page.ctypes.data)
        assert parent == int(host[j]), f"page {j}: device {parent:#x}, host {int(host[j]):#x}"
    # the key covers the whole prefix: change one token of page 0 and every key changes
    other = tokens.copy()
    other[0] += 1
    assert not set(page_keys(other, page_size, *cfg.prefix_secret).tolist()) & set(host.tolist())
    # and the secret: another process's keys for the same tokens are others
    assert (page_keys(tokens, page_size, 1, 2) != host).all()


def test_a_shared_prefix_skips_its_prefill_and_is_counted():
    d = Driver(paged_config(n_slots=2, token_budget=64))
    ps = d.cfg.page_size
    base = np.arange(30) + 3
    _, start = run(d, base, 3)
    assert start == 0 and counters(d) == (30, 0)
    # 6 full pages (24 tokens) shared, then other tokens
    _, start = run(d, np.concatenate([base[:26], [90, 91, 92]]), 3)
    assert start == 24 and counters(d) == (59, 24)
    # the same prompt again: every full page but the one of its last token, which must run to sample
    _, start = run(d, base, 3)
    assert start == (30 - 1) // ps * ps == 28 and counters(d) == (89, 52)
    # a prompt ending on a page boundary still recomputes its last page
    _, start = run(d, base[:28], 2)
    assert start == 24
    check_streams(d)


def test_generated_tokens_pages_are_keyed_as_the_host_keys_a_prompt_that_resends_them():
    d = Driver(paged_config(n_slots=2, token_budget=64))
    a, _ = run(d, np.arange(20) + 3, 20)
    resend = np.concatenate([np.arange(20) + 3, d.records[a].tokens[:19]])  # a second turn
    queries, hits = counters(d)
    _, start = run(d, resend, 2)
    # the first request's KV is written for its 39 positions but the last: 9 full pages, 5 of
    # prompt (host keys) and 4 holding generated tokens (keyed on the device)
    assert start == 36 and counters(d) == (queries + 39, hits + 36)


def test_off_writes_no_keys_and_shares_nothing():
    d = Driver(paged_config(n_slots=2, token_budget=64, prefix_caching=False))
    assert d.rings.arena_words(30) == 30
    base = np.arange(30) + 3
    run(d, base, 3)
    _, start = run(d, base, 3)
    assert start == 0 and counters(d) == (60, 0)
    assert int(d.a["sched"][0]["n_cached_free"]) == 0


def test_eviction_takes_the_least_recently_used_page_first_and_a_prefix_tail_before_its_head():
    # pages of 4, a pool of 20: three 17-token prompts leave 4 full pages each cached (12) and 8
    # free; a 35-token prompt needs 9 (its next token still fits its last page, so it takes no
    # page ahead) and so evicts one: the first request's last full page
    d = Driver(paged_config(n_slots=1, token_budget=64))
    groups = [np.arange(17) + 3 + 100 * g for g in range(3)]
    for g in groups:
        run(d, g, 1)
    assert int(d.a["sched"][0]["n_cached_free"]) == 12 and int(d.a["sched"][0]["n_free_pages"]) == 8
    run(d, np.arange(35) + 1000, 1)
    assert int(d.a["sched"][0]["n_cached_free"]) == 11 + 8, "one evicted; the new prompt's 8 cached"
    _, start = run(d, groups[1], 1)
    assert start == 16, "a newer prefix should be whole"
    _, start = run(d, groups[0], 1)
    assert start == 12, "the oldest prefix should have lost its tail page only"


def test_random_traffic_with_shared_prefixes_keeps_the_pool_whole_and_streams_exact():
    d = Driver(paged_config(n_slots=6, n_pages=24, token_budget=16))
    rng = np.random.default_rng(11)
    bases = [rng.integers(3, 500, size=60).astype(np.int32) for _ in range(3)]

    def prompt(rng):  # a prefix of one of three sequences, then up to 3 tokens of its own
        base, n = bases[int(rng.integers(0, 3))], int(rng.integers(1, 40))
        return np.concatenate([base[:n], rng.integers(3, 500, size=int(rng.integers(0, 4)))])[:48]

    random_run(d, rng, prompt, n_steps=400)
    queries, hits = counters(d)
    assert hits > queries // 10, f"shared prefixes hit too little: {hits} of {queries}"
