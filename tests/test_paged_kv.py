"""The paged KV cache: its shapes, and the eager step reading and writing through a block table.

The paging checks run the same schedule twice: through the cache's own slot_table (slot s owns
pages [s * M, (s + 1) * M)) and through a shuffled table whose slots' pages interleave, with
junk in the pages no slot uses and in the table entries past each slot's context. Both must
give the same logits and the same cached k/v at every position that exists.
"""

from __future__ import annotations

import pytest
import torch

from ringleader.device.model import LlamaModel, preset_config
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.step_batch import StepBatch

PS, N_SLOTS, MAX_CTX = 4, 3, 40
M = MAX_CTX // PS
N_PAGES = N_SLOTS * M + 7  # pages no slot's table names: they must stay untouched
JUNK_ENTRIES = (-1, 10**6)  # table entries past a context: never read as they stand

# per step: (slot, first position, n rows); prefill chunks that start and end mid-page, decode
# rows of several slots, slots out of order
SCHEDULE = [
    [(2, 0, 6), (0, 0, 3)],
    [(2, 6, 7), (1, 0, 9), (0, 3, 1)],
    [(0, 4, 1), (1, 9, 1), (2, 13, 1)],
    [(1, 10, 1), (0, 5, 2), (2, 14, 1)],
    [(2, 15, 1), (1, 11, 5), (0, 7, 1)],
    [(1, 16, 1), (2, 16, 1), (0, 8, 1)],
]


@pytest.fixture(scope="module")
def model():
    return LlamaModel.from_preset("tiny", torch.float32, "cpu", seed=0)


def test_cache_shapes_and_slot_table():
    config = preset_config("tiny")
    kv = KVCache.for_model(config, n_pages=5, page_size=8, dtype=torch.bfloat16)
    shape = (config.num_layers, 5, 8, config.num_kv_heads, config.head_dim)
    assert kv.k.shape == kv.v.shape == shape and not kv.k.any()
    assert (kv.n_pages, kv.page_size, kv.dtype, kv.slot_table) == (5, 8, torch.bfloat16, None)
    assert kv.layer(1)[0].shape == shape[1:] and kv.layer(1)[1].data_ptr() == kv.v[1].data_ptr()
    per_token = KVCache.bytes_per_token(config, torch.bfloat16)
    assert per_token == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    assert kv.nbytes == 5 * 8 * per_token

    slots = KVCache.for_slots(config, n_slots=3, max_ctx=33, page_size=16)
    assert slots.n_pages == 9 and slots.slot_table.dtype == torch.int32
    assert slots.slot_table.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match="power of two"):
        KVCache.for_model(config, n_pages=4, page_size=12)


def _shuffled_table(seed: int) -> torch.Tensor:
    """[N_SLOTS, M]: page j of slot s is order[j * N_SLOTS + s], so the slots' pages interleave."""
    order = torch.randperm(N_PAGES, generator=torch.Generator().manual_seed(seed))[: N_SLOTS * M]
    return order.view(M, N_SLOTS).t().contiguous().int()


def _with_junk_past(table: torch.Tensor, ctx: dict[int, int]) -> torch.Tensor:
    """The table with every entry past slot s's first ctx[s] positions replaced by junk."""
    out = table.clone()
    for s in range(N_SLOTS):
        out[s, -(-ctx[s] // PS) :] = JUNK_ENTRIES[s % 2]
    return out


def _run(model, kv, tables):
    """The schedule's logits (every row sampled); tables: one block table per step, or None."""
    rng = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, 250, (N_SLOTS, MAX_CTX), generator=rng).tolist()
    out = []
    for step, table in zip(SCHEDULE, tables):
        segs = [(s, tokens[s][p0 : p0 + n], p0) for s, p0, n in step]
        n_rows = sum(n for *_, n in step)
        batch = StepBatch.from_segments(segs, sample_rows=list(range(n_rows)), block_table=table)
        out.append(model.step(batch, kv))
    return out


def test_step_through_a_shuffled_block_table_matches_the_slot_table(model):
    ref_kv = KVCache.for_slots(model.config, N_SLOTS, MAX_CTX, page_size=PS)
    want = _run(model, ref_kv, [None] * len(SCHEDULE))

    kv = KVCache.for_model(model.config, N_PAGES, PS)
    gen = torch.Generator().manual_seed(3)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))  # stale junk: masked, never attended
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    k0 = kv.k.clone()
    table = _shuffled_table(seed=1)
    ctx, tables = dict.fromkeys(range(N_SLOTS), 0), []
    for step in SCHEDULE:
        for s, p0, n in step:
            ctx[s] = p0 + n
        tables.append(_with_junk_past(table, ctx))
    got = _run(model, kv, tables)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)

    used = torch.zeros(N_PAGES, PS, dtype=torch.bool)
    for s in range(N_SLOTS):
        for p in range(ctx[s]):
            page, ref_page = int(table[s, p // PS]), int(ref_kv.slot_table[s, p // PS])
            torch.testing.assert_close(kv.k[:, page, p % PS], ref_kv.k[:, ref_page, p % PS])
            torch.testing.assert_close(kv.v[:, page, p % PS], ref_kv.v[:, ref_page, p % PS])
            used[page, p % PS] = True
    assert torch.equal(kv.k[:, ~used], k0[:, ~used]), "a write landed outside the rows' pages"


def test_generate_greedy_is_the_same_at_any_page_size(model):
    from ringleader.device.model import generate_greedy

    prompt = [256, *b"Pages"]
    small = KVCache.for_slots(model.config, 2, 24, page_size=2)
    assert generate_greedy(model, prompt, 8, slot=1, kv=small) == generate_greedy(model, prompt, 8)


def test_step_needs_a_block_table(model):
    kv = KVCache.for_model(model.config, 4, PS)
    with pytest.raises(ValueError, match="no block table"):
        model.step(StepBatch.from_segments([(0, [1, 2], 0)]), kv)


def test_decode_rows_of_very_different_lengths_attend_in_groups_and_match_alone(model):
    """Decode rows at contexts 3, 5, 90 and 7: one batch padded to 90 would read over four times
    what they need, so the plan groups them by length (powers of two); each row's logits equal
    the row decoded alone."""
    from ringleader.device.step.step_batch import StepPlan

    lengths = [3, 5, 90, 7]
    kv = model.new_kv_cache(len(lengths), 96)
    prompts = [[(7 * s + i) % 200 + 3 for i in range(n - 1)] for s, n in enumerate(lengths)]
    for s, ids in enumerate(prompts):  # each slot's prompt, prefilled alone
        model.step(StepBatch.from_segments([(s, ids, 0)]), kv)
    last = [11, 12, 13, 14]
    batch = StepBatch.from_segments([(s, [t], n - 1) for s, (t, n) in enumerate(zip(last, lengths))])
    plan = batch.get_plan()
    assert len(plan.decode_groups) == 3 and sorted(len(r) for r, _ in plan.decode_groups) == [1, 1, 2]
    together = model.step(batch, kv)
    for s, (t, n) in enumerate(zip(last, lengths)):
        alone = model.step(StepBatch.from_segments([(s, [t], n - 1)]), kv)
        assert torch.allclose(together[s], alone[0], atol=1e-5, rtol=1e-5)
    close = StepPlan.from_numpy(
        batch.positions.numpy() * 0 + 50,
        *(t.numpy() for t in (batch.seg_slot, batch.seg_row_start, batch.seg_n_rows)),
    )
    assert len(close.decode_groups) == 1  # equal lengths: one padded batch
