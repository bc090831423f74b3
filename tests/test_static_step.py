"""The static-shape step (CUDA-graph form) against the eager ragged step, on the CPU, both
through the paged KV cache's block table.

The step with Triton attention, and the product path (Triton attention, the fused pointwise
kernels, the Triton uniform), runs under the Triton interpreter, which has to be switched on
before triton is first imported; so those checks run in a child process started with
TRITON_INTERPRET=1 (`run_interpreted_checks`). The kernels alone are checked against the
reference in test_split_k_attention.py (attention) and test_triton_fused.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringleader.device.model import LlamaModel
from ringleader.device.step.eager_step import EagerStep
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.static_step import StaticStep
from ringleader.device.step.step_batch import StepBatch
from ringleader.device.step.step_layout import StepLayout
from ringleader.device.step.triton_attention import ragged_attention_reference
from ringleader.ipc import layout as L
from ringleader.ipc.rings import RingConfig
from tests.sched_driver import Driver, scheduler
from tests.triton_interpreter import run_interpreted_checks_of


def test_triton_under_interpreter():
    run_interpreted_checks_of("tests.test_static_step", "interpreted checks passed")


def run_interpreted_checks() -> None:
    """Entry point of the child process (TRITON_INTERPRET=1 set before anything imported triton)."""
    from ringleader.device.step import triton_attention as ta

    assert ta.triton_interpreted(), "triton was imported before TRITON_INTERPRET=1 took effect"
    model = LlamaModel.from_preset("tiny", torch.float32, "cpu", seed=0)
    _, seen = _drive(model, ta.ragged_attention_triton, max_steps=7)
    assert seen["mixed"] and seen["padded"], seen
    # the product path: Triton attention, the fused pointwise kernels, the Triton uniform
    step = StaticStep(model, StaticStep.new_kv_cache(model, 8), N_SLOTS, MAX_CTX, BUDGET)
    assert step.fused
    _, seen = _drive(model, "triton", max_steps=7)
    assert seen["mixed"] and seen["padded"], seen
    print("interpreted checks passed")


def test_reference_matches_eager_ragged_attention():
    from ringleader.device.step.eager_attention import ragged_attention

    gen = torch.Generator().manual_seed(1)
    n_pages, ps, m = 40, 4, 10
    k = torch.randn(n_pages, ps, 2, 16, generator=gen)
    v = torch.randn(n_pages, ps, 2, 16, generator=gen)
    batch = StepBatch.from_segments([(2, [0] * 1, 7), (0, [0] * 1, 30), (1, [0] * 6, 10), (3, [0] * 1, 0)])
    # interleaved shuffled pages; entries past each slot's context are junk
    table = torch.randperm(n_pages, generator=gen)[: 4 * m].view(m, 4).t().contiguous()
    for slot, ctx in enumerate((31, 16, 8, 1)):
        table[slot, -(-ctx // ps) :] = -1 if slot % 2 else 10**6
    q = torch.randn(batch.n_rows, 4, 16, generator=gen)
    eager = ragged_attention(q, batch, batch.get_plan(), k, v, table)
    ref = ragged_attention_reference(
        q, k, v, table.int(), batch.slot_of.int(), batch.positions.int(), 16**-0.5
    )
    torch.testing.assert_close(ref, eager, atol=1e-5, rtol=1e-5)


# ---- the step against the eager model, driven by the real scheduler ---------------------------

N_SLOTS, MAX_CTX, BUDGET, BUCKETS = 4, 96, 16, (4, 8, 16)
REQUESTS = [  # prompt length, max_tokens, temperature, top_p, top_k, seed
    (21, 5, 0.0, 1.0, 0, 0),
    (3, 6, 0.8, 0.9, 0, 11),
    (9, 4, 1.0, 1.0, 20, 12),
    (2, 3, 0.0, 1.0, 0, 0),
    (17, 4, 0.7, 0.95, 50, 13),
    (5, 5, 1.2, 1.0, 0, 14),
]


@pytest.fixture(scope="module")
def model():
    return LlamaModel.from_preset("tiny", torch.float32, "cpu", seed=0)


def _submit(d: Driver, prompt, max_tokens, temperature, top_p, top_k, seed) -> None:
    d.submit(
        prompt,
        max_tokens,
        flags=L.SqFlag.IGNORE_EOS,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        logprobs=[None, 0, 3, 20][seed % 4],  # some ask none, some the token's alone, some more
        prompt_logprobs=[2, None, None, 0][seed % 4],
    )


def _drive(model, attention, max_steps):
    cfg = RingConfig(
        n_slots=N_SLOTS,
        max_ctx=MAX_CTX,
        token_budget=BUDGET,
        buckets=BUCKETS,
        sq_size=64,
        cq_size=2048,
        arena_size=1 << 12,
        pending_cap=64,
        page_size=8,  # contexts span several pages
    )
    d = Driver(cfg)
    rng = np.random.default_rng(5)
    for plen, *params in REQUESTS:
        _submit(d, rng.integers(3, 250, plen), *params)
    # both caches hold the scheduler's pages; the static one has the scratch page after them
    kv_eager = KVCache.for_model(model.config, cfg.n_pages, cfg.page_size)
    eager = EagerStep(model, kv_eager)
    kv_static = StaticStep.new_kv_cache(model, cfg.n_pages, cfg.page_size)
    step = StaticStep(
        model, kv_static, N_SLOTS, MAX_CTX, BUDGET, attention=attention, score_rows=cfg.score_rows
    )
    a = d.a
    lay = StepLayout.from_arrays(a, "cpu")  # views: each step writes the scheduler's next_token
    seen = {"mixed": 0, "padded": 0, "stale": 0, "logprobs": 0, "scored": 0}
    for _ in range(max_steps):
        d.rings.submissions.publish()
        status = scheduler().step(d.mem.context_address)
        if status == L.StepStatus.IDLE:
            d.drain_cq()  # the DONE events of the last step's outputs
            break
        assert status == L.StepStatus.RUN
        h = a["step"][0]
        n, bucket, ns = int(h["n_tokens"]), int(h["bucket"]), int(h["n_samples"])
        ndec, seg_rows = int(h["n_decode"]), a["seg_n_rows"][: int(h["n_segments"])]
        seen["mixed"] += ndec > 0 and bool(np.any(seg_rows > 1))
        seen["padded"] += bucket > n
        seen["stale"] += ns < N_SLOTS
        assert np.all(a["slot_of"][n:bucket] == -1)

        # one layout, one bucket, two steps: the eager one is the reference
        before = a["next_token"].copy()
        a["step_logprobs"].view(np.uint8)[:] = 0xEE
        logits_e = eager.run(bucket, lay)
        expected = a["next_token"].copy()
        expected_logprobs = a["step_logprobs"].copy()
        expected_scores = a["step_prompt_logprobs"][: int(h["n_score"])]["logprob"].copy()
        a["step_logprobs"].view(np.uint8)[:] = 0xEE
        unsampled = np.setdiff1d(np.arange(N_SLOTS), a["sample_slot"][:ns])
        np.testing.assert_array_equal(expected[unsampled], before[unsampled])
        a["next_token"][:] = before
        logits_s = step.run(bucket, lay)
        assert logits_e.shape[0] == ns
        torch.testing.assert_close(logits_s[:ns], logits_e, atol=1e-4, rtol=1e-4)
        np.testing.assert_array_equal(a["next_token"], expected)
        # the same prompt logprobs (test_prompt_logprobs.py checks the records whole)
        got_scores = a["step_prompt_logprobs"][: int(h["n_score"])]["logprob"]
        np.testing.assert_allclose(got_scores, expected_scores, atol=1e-4)
        seen["scored"] += len(got_scores)
        # the same logprobs records, for the slots that asked, and nothing written elsewhere
        asked = a["slots"]["sampling"]["logprobs"] >= 0
        sampled = np.isin(np.arange(N_SLOTS), a["sample_slot"][:ns])
        got = a["step_logprobs"]
        np.testing.assert_array_equal(got[~(asked & sampled)].view(np.uint8), 0xEE)
        for s in np.flatnonzero(asked & sampled):
            k = int(expected_logprobs[s]["n_top"])
            assert int(got[s]["n_top"]) == k and k == min(20, int(a["slots"][s]["sampling"]["logprobs"]))
            assert abs(float(got[s]["logprob"]) - float(expected_logprobs[s]["logprob"])) < 1e-4
            values = expected_logprobs[s]["top_logprobs"][:k]
            np.testing.assert_allclose(got[s]["top_logprobs"][:k], values, atol=1e-4)
            # the same id at each rank, but where two tokens tie to rounding (their order is moot)
            if not k:
                continue
            gaps = np.abs(np.diff(values)) > 1e-4
            apart = np.concatenate([[True], gaps]) & np.concatenate([gaps, [True]])
            np.testing.assert_array_equal(
                got[s]["top_ids"][:k][apart], expected_logprobs[s]["top_ids"][:k][apart]
            )
        seen["logprobs"] += int(np.sum(asked & sampled))
        # the scheduler's pages agree; pad rows only ever wrote the scratch page
        torch.testing.assert_close(kv_static.k[:, :-1], kv_eager.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv_static.v[:, :-1], kv_eager.v, atol=1e-5, rtol=1e-5)
        d.drain_cq()
    return d, seen


def test_static_step_torch_matches_eager(model):
    d, seen = _drive(model, "torch", max_steps=200)
    assert all(r.done for r in d.records.values()), "every request finished"
    assert all(len(r.tokens) == r.max_tokens for r in d.records.values())
    assert seen["mixed"] and seen["padded"] and seen["stale"] and seen["logprobs"] and seen["scored"], seen


# ---- hand-built layouts over a shuffled block table ---------------------------------------------

PS, CTX = 4, 32
M = CTX // PS
N_PAGES = 4 * M + 3  # the scheduler's pool (the static cache adds the scratch page after it)


def _shuffled_table(n_slots: int, m: int, n_pages: int, seed: int) -> torch.Tensor:
    """int32 [n_slots, m] of distinct pages; page j of slot s is order[j * n_slots + s], so the
    slots' pages interleave."""
    order = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))[: n_slots * m]
    return order.view(m, n_slots).t().contiguous().int()


def _fill(lay: StepLayout, segments, table: torch.Tensor) -> None:
    """Rows of segments [(slot, token ids, first position)], the rest pad rows; each segment's
    last row sampled greedily into next_token[slot]."""
    lay.slot_of.fill_(-1)
    lay.positions.zero_()
    lay.token_ids.zero_()
    lay.params["temperature"].zero_()
    row = 0
    for i, (slot, ids, p0) in enumerate(segments):
        n = len(ids)
        lay.token_ids[row : row + n] = torch.tensor(ids)
        lay.positions[row : row + n] = torch.arange(p0, p0 + n)
        lay.slot_of[row : row + n] = slot
        lay.seg_slot[i], lay.seg_row_start[i], lay.seg_n_rows[i] = slot, row, n
        lay.sample_row[i], lay.sample_slot[i] = row + n - 1, slot
        row += n
    lay.n_tokens[0], lay.n_segments[0], lay.n_samples[0] = row, len(segments), len(segments)
    lay.block_table.copy_(table)


def test_static_step_matches_eager_through_a_shuffled_block_table(model):
    n_slots, budget = 4, 16
    gen = torch.Generator().manual_seed(3)
    kv_eager = KVCache.for_model(model.config, N_PAGES, PS)
    kv_eager.k.copy_(torch.randn(kv_eager.k.shape, generator=gen))  # stale junk in every page
    kv_eager.v.copy_(torch.randn(kv_eager.v.shape, generator=gen))
    kv_static = StaticStep.new_kv_cache(model, N_PAGES, PS)
    kv_static.k.normal_(generator=gen)
    kv_static.v.normal_(generator=gen)
    kv_static.k[:, :-1], kv_static.v[:, :-1] = kv_eager.k, kv_eager.v
    scratch_k = kv_static.k[:, -1].clone()
    eager = EagerStep(model, kv_eager)
    step = StaticStep(model, kv_static, n_slots, CTX, budget, attention="torch", fused=False)
    lay = StepLayout.allocate(n_slots, budget, "cpu", M)
    table = _shuffled_table(n_slots, M, N_PAGES, seed=2)
    tokens = torch.randint(3, 250, (n_slots, CTX), generator=gen).tolist()
    # per step: (slot, first position, n rows): chunks that start and end mid-page, decode rows
    # of several slots, pad rows in every step
    schedule = [
        [(2, 0, 6), (0, 0, 3)],
        [(2, 6, 7), (1, 0, 5), (0, 3, 1)],
        [(0, 4, 1), (1, 5, 1), (2, 13, 1), (3, 0, 9)],
        [(3, 9, 1), (1, 6, 1), (0, 5, 1), (2, 14, 1)],
    ]
    ctx = [0] * n_slots
    for segs in schedule:
        for slot, p0, n in segs:
            ctx[slot] = p0 + n
        step_table = table.clone()
        for slot in range(n_slots):  # entries past a context are junk: the steps must not use them
            step_table[slot, -(-ctx[slot] // PS) :] = -1 if slot % 2 else 10**6
        _fill(lay, [(slot, tokens[slot][p0 : p0 + n], p0) for slot, p0, n in segs], step_table)
        before = lay.next_token.clone()
        logits_e = eager.run(budget, lay)
        expected = lay.next_token.clone()
        lay.next_token.copy_(before)
        logits_s = step.run(budget, lay)
        torch.testing.assert_close(logits_s[: len(segs)], logits_e, atol=1e-4, rtol=1e-4)
        assert torch.equal(lay.next_token, expected)
        # the same rows of the same pages written; pad rows wrote only the scratch page's row 0
        torch.testing.assert_close(kv_static.k[:, :-1], kv_eager.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv_static.v[:, :-1], kv_eager.v, atol=1e-5, rtol=1e-5)
        assert torch.equal(kv_static.k[:, -1, 1:], scratch_k[:, 1:])


def _hand_layout(n_slots, budget):
    lay = StepLayout.allocate(n_slots, budget, "cpu", M)
    # bucket 8: decode rows for slots 1 and 3, then a 3-row chunk of slot 2 (positions 4-6, over
    # a page boundary; junk cache before it), then pad rows; slot 0 is idle
    rows = [(5, 1, 0), (7, 3, 0), (9, 2, 4), (10, 2, 5), (11, 2, 6)]
    for r, (tok, slot, pos) in enumerate(rows):
        lay.token_ids[r], lay.slot_of[r], lay.positions[r] = tok, slot, pos
    lay.sample_row[:] = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    lay.next_token[:] = torch.tensor([100, 101, 102, 103], dtype=torch.int32)
    lay.block_table.copy_(_shuffled_table(n_slots, M, N_PAGES, seed=4))
    return lay, rows


def test_stale_sample_entries_never_write(model):
    n_slots, budget = 4, 16
    kv = StaticStep.new_kv_cache(model, N_PAGES, PS)
    step = StaticStep(model, kv, n_slots, CTX, budget, attention="torch")
    lay, _ = _hand_layout(n_slots, budget)
    # entries 2, 3 are stale: they collide with live slot 1 and name slot 2; wild parameters
    lay.sample_slot[:] = torch.tensor([1, 3, 1, 2], dtype=torch.int32)
    lay.params["temperature"][:] = torch.tensor([0.0, 0.0, float("nan"), -1.0])
    lay.params["repetition_penalty"][:] = torch.tensor([1.0, 1.0, 0.0, float("inf")])
    lay.params["min_p"][:] = torch.tensor([0.0, 0.0, float("nan"), 5.0])
    lay.sample_row[3] = 1000  # out of range: must be clamped, not read
    lay.n_samples[0] = 2
    logits = step.run(8, lay)
    greedy = logits.argmax(-1).int()
    assert greedy[2] != greedy[0], "the stale entry must want a different token to be a real test"
    assert lay.next_token.tolist() == [100, int(greedy[0]), 102, int(greedy[1])]

    lay.next_token[:] = torch.tensor([100, 101, 102, 103], dtype=torch.int32)
    lay.n_samples[0] = 0
    step.run(8, lay)
    assert lay.next_token.tolist() == [100, 101, 102, 103]


def test_pad_rows_touch_only_the_scratch_page(model):
    n_slots, budget = 4, 16
    kv = StaticStep.new_kv_cache(model, N_PAGES, PS)
    gen = torch.Generator().manual_seed(3)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    k0, v0 = kv.k.clone(), kv.v.clone()
    step = StaticStep(model, kv, n_slots, CTX, budget, attention="torch")
    lay, rows = _hand_layout(n_slots, budget)
    lay.n_samples[0] = 2
    step.run(16, lay)
    written = torch.zeros(kv.n_pages, PS, dtype=torch.bool)  # [pages, offsets]
    for _, slot, pos in rows:
        page = int(lay.block_table[slot, pos // PS])
        assert not torch.equal(kv.k[:, page, pos % PS], k0[:, page, pos % PS])
        written[page, pos % PS] = True
    written[-1, 0] = True  # the scratch row the pad rows share
    assert torch.equal(kv.k[:, ~written], k0[:, ~written])
    assert torch.equal(kv.v[:, ~written], v0[:, ~written])


# ---- the layout views ----------------------------------------------------------------------------


def test_layout_views_alias_the_scheduler_arrays():
    cfg = RingConfig(
        n_slots=4, max_ctx=64, token_budget=8, sq_size=64, cq_size=2048, arena_size=1 << 12, pending_cap=64
    )
    d = Driver(cfg)
    lay = StepLayout.from_arrays(d.a, "cpu")
    header = d.a["step"][0]
    header["n_tokens"], header["n_segments"], header["n_samples"] = 7, 2, 3
    d.a["seg_n_rows"][1] = 6
    d.a["sample_params"][1]["seed"] = np.uint64(2**63 + 5)
    assert lay.read_counts() == (7, 2, 3) and lay.n_samples.shape == (1,)
    assert int(lay.seg_n_rows[1]) == 6 and lay.seg_slot.shape == (4,)
    assert int(lay.params["seed"][1]) == -(2**63) + 5
    lay.next_token[2] = 77
    assert d.a["next_token"][2] == 77
    assert lay.token_ids.shape == (8,) and lay.sample_row.shape == (4,)
    d.a["block_table"][5] = 9  # slot 1's second page
    assert lay.block_table.shape == (4, cfg.pages_per_slot) and int(lay.block_table[1, 1]) == 9


def test_layout_over_a_byte_buffer_aliases_the_scheduler_arrays():
    """The CUDA backend's form (StepLayout.over_buffer(DeviceMemory.tensor)): arrays viewed from
    raw bytes, the counts at their words in the step header."""
    cfg = RingConfig(
        n_slots=4, max_ctx=64, token_budget=8, sq_size=64, cq_size=2048, arena_size=1 << 12, pending_cap=64
    )
    d = Driver(cfg)
    lay = StepLayout.over_buffer(lambda name, dtype: torch.from_numpy(d.a[name].view(np.uint8)).view(dtype))
    header = d.a["step"][0]
    header["n_tokens"], header["bucket"], header["n_segments"], header["n_samples"] = 7, 8, 2, 3
    d.a["sample_params"][2]["temperature"] = 0.5
    d.a["sample_params"][3]["top_k"] = -1
    assert lay.read_counts() == (7, 2, 3)
    assert lay.params["temperature"].dtype == torch.float32 and float(lay.params["temperature"][2]) == 0.5
    assert lay.params["top_k"].tolist() == [0, 0, 0, -1]
    lay.next_token[1] = 9
    assert d.a["next_token"][1] == 9
    d.a["block_table"][:] = np.arange(d.a["block_table"].size)[::-1]
    assert lay.block_table.shape == (4, cfg.pages_per_slot) and int(lay.block_table[0, 0]) == 15
    copy = StepLayout.allocate(
        4, 8, "cpu", cfg.pages_per_slot, score_rows=cfg.score_rows
    )  # host mode's upload
    copy.copy_from_arrays(d.a)
    assert torch.equal(copy.block_table, lay.block_table)


def test_rejects_a_bucket_over_the_budget_and_a_table_short_of_max_ctx(model):
    step = StaticStep(model, StaticStep.new_kv_cache(model, N_PAGES, PS), 4, CTX, 16, attention="torch")
    with pytest.raises(ValueError, match="bucket"):
        step.run(17, StepLayout.allocate(4, 16, "cpu", M))
    with pytest.raises(ValueError, match=f"max_ctx {CTX}"):
        step.run(16, StepLayout.allocate(4, 16, "cpu", M - 1))


def test_eager_step_refuses_a_bucket_below_its_rows(model):
    eager = EagerStep(model, model.new_kv_cache(4, 32))
    lay = StepLayout.allocate(4, 16, "cpu", 2)
    lay.n_tokens[0] = 5
    with pytest.raises(ValueError, match="bucket 4"):
        eager.run(4, lay)
