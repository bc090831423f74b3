"""The request table's rows as columns (hostctl/serving/stream_columns.py) and the CQ batch's
chunks (completions.py:TokenChunks): handles name rows, a stale handle matches no live request,
a hot request's counts come back to its InFlight when it leaves, and a batch of many streams is
counted at once, whatever order its events come in."""

from __future__ import annotations

import time

import numpy as np

from ringleader.hostctl.serving.completions import TokenChunks
from ringleader.hostctl.serving.inflight import RequestTable
from ringleader.hostctl.serving.stream_columns import ROW_MASK
from ringleader.ipc import layout
from ringleader.ipc.sampling_params import SamplingParams


def _add(table: RequestTable, client: bytes, rid):
    return table.add(
        client, rid, prompt_ids=np.zeros(3, np.int32), sampling=SamplingParams(seed=1), priority=0
    )


def test_a_reused_row_gets_a_new_handle_and_the_old_one_matches_nothing():
    table = RequestTable()
    first = _add(table, b"a", 1)
    table.finish(first.handle)
    second = _add(table, b"a", 2)
    assert second.handle & ROW_MASK == first.handle & ROW_MASK and second.handle != first.handle
    assert second.handle != 0 and first.handle != 0
    table.make_hot(second)
    hot, gaps, groups, ids, live = table.advance_hot(
        np.array([first.handle, second.handle], np.uint32), np.array([1, 1]), time.perf_counter_ns()
    )
    assert live.tolist() == [False, True] and hot.tolist() == [False, True] and ids.tolist() == [2]


def test_hot_counts_come_back_when_the_request_leaves():
    table = RequestTable()
    req = _add(table, b"a", "r")
    req.completion_tokens, req.last_token_ns = 1, 5
    table.make_hot(req)
    for k in (1, 3, 2):
        table.advance_hot(np.array([req.handle], np.uint32), np.array([k]), 1000 + k)
    assert req.completion_tokens == 1  # the columns hold the truth while it is in the table ...
    assert table.finish(req.handle) is req
    assert req.completion_tokens == 7 and req.last_token_ns == 1002  # ... and hand it back


def test_a_batch_is_grouped_by_connection_and_rows_grow_past_their_first_size():
    table = RequestTable()
    reqs = [_add(table, b"abc"[i % 3 : i % 3 + 1], i) for i in range(3000)]
    for r in reqs:
        r.completion_tokens, r.last_token_ns = 1, 0
        table.make_hot(r)
    handles = np.array([r.handle for r in reqs], np.uint32)
    hot, gaps, connections, ids, live = table.advance_hot(handles, np.ones(3000, np.int64), 10)
    assert hot.all() and (gaps == 10).all()
    assert connections == [b"abc"[i % 3 : i % 3 + 1] for i in range(3000)]  # each chunk's
    assert ids.tolist() == list(range(3000))
    one = RequestTable()
    lone = [_add(one, b"x", i) for i in range(5)]
    for r in lone:
        one.make_hot(r)
    _, _, connections, _, _ = one.advance_hot(
        np.array([r.handle for r in lone], np.uint32), np.ones(5, np.int64), 1
    )
    assert connections == b"x"  # one connection: no work per chunk at all


def test_a_batch_becomes_one_chunk_per_request_in_generation_order():
    dtype = layout.CQ_EVENT.numpy_dtype()
    rng = np.random.default_rng(7)
    events = np.zeros(60, dtype)
    events["handle"] = rng.choice([11, 22, 33, 44], size=60)
    events["token"] = np.arange(60)
    events["kind"] = layout.EventKind.TOKEN
    events["kind"][[5, 40]] = layout.EventKind.DONE
    chunks = TokenChunks.of(events)
    tokens = {int(h): chunks.token_ids(i) for i, h in enumerate(chunks.handles)}
    for h in (11, 22, 33, 44):
        mine = [i for i in range(60) if events["handle"][i] == h and i not in (5, 40)]
        assert tokens.get(h, []) == mine  # each request's tokens in the order they came
        assert chunks.positions(list(chunks.handles).index(h)) == mine if mine else True
    assert [h for h, _, _ in chunks.dones] == [int(events["handle"][5]), int(events["handle"][40])]
    assert int(chunks.counts.sum()) == 58
