"""The static-shape step (CUDA-graph form) against the eager ragged step, on the CPU.

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

from ringleader.device.model import EagerStep, LlamaModel, StepBatch
from ringleader.device.model.static_step import StaticStep
from ringleader.device.model.step_layout import StepLayout
from ringleader.device.model.triton_attention import ragged_attention_reference
from ringleader.ipc import layout as L
from ringleader.ipc.rings import RingConfig
from tests.sched_driver import Driver, scheduler
from tests.triton_interpreter import run_interpreted_checks_of


def test_triton_under_interpreter():
    run_interpreted_checks_of("tests.test_static_step", "interpreted checks passed")


def run_interpreted_checks() -> None:
    """Entry point of the child process (TRITON_INTERPRET=1 set before anything imported triton)."""
    from ringleader.device.model import triton_attention as ta

    assert ta.triton_interpreted(), "triton was imported before TRITON_INTERPRET=1 took effect"
    model = LlamaModel.from_preset("tiny", torch.float32, "cpu", seed=0)
    _, seen = _drive(model, ta.ragged_attention_triton, max_steps=7)
    assert seen["mixed"] and seen["padded"], seen
    # the product path: Triton attention, the fused pointwise kernels, the Triton uniform
    step = StaticStep(model, StaticStep.new_kv_cache(model, N_SLOTS, MAX_CTX), N_SLOTS, MAX_CTX, BUDGET)
    assert step.fused
    _, seen = _drive(model, "triton", max_steps=7)
    assert seen["mixed"] and seen["padded"], seen
    print("interpreted checks passed")


def test_reference_matches_eager_ragged_attention():
    from ringleader.device.model.eager_attention import ragged_attention

    gen = torch.Generator().manual_seed(1)
    k = torch.randn(4, 40, 2, 16, generator=gen)
    v = torch.randn(4, 40, 2, 16, generator=gen)
    batch = StepBatch.from_segments([(2, [0] * 1, 7), (0, [0] * 1, 30), (1, [0] * 6, 10), (3, [0] * 1, 0)])
    q = torch.randn(batch.n_rows, 4, 16, generator=gen)
    eager = ragged_attention(q, batch, batch.get_plan(), k, v)
    ref = ragged_attention_reference(q, k, v, batch.slot_of.int(), batch.positions.int(), 16**-0.5)
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
    )
    d = Driver(cfg)
    rng = np.random.default_rng(5)
    for plen, *params in REQUESTS:
        _submit(d, rng.integers(3, 250, plen), *params)
    kv_eager = model.new_kv_cache(N_SLOTS, MAX_CTX)
    eager = EagerStep(model, kv_eager)
    kv_static = StaticStep.new_kv_cache(model, N_SLOTS, MAX_CTX)
    step = StaticStep(model, kv_static, N_SLOTS, MAX_CTX, BUDGET, attention=attention)
    a = d.a
    lay = StepLayout.from_arrays(a, "cpu")  # views: each step writes the scheduler's next_token
    seen = {"mixed": 0, "padded": 0, "stale": 0}
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
        logits_e = eager.run(bucket, lay)
        expected = a["next_token"].copy()
        unsampled = np.setdiff1d(np.arange(N_SLOTS), a["sample_slot"][:ns])
        np.testing.assert_array_equal(expected[unsampled], before[unsampled])
        a["next_token"][:] = before
        logits_s = step.run(bucket, lay)
        assert logits_e.shape[0] == ns
        torch.testing.assert_close(logits_s[:ns], logits_e, atol=1e-4, rtol=1e-4)
        np.testing.assert_array_equal(a["next_token"], expected)
        # the real slots' caches agree; pad rows only ever wrote the scratch slot
        torch.testing.assert_close(kv_static.k[:, :N_SLOTS], kv_eager.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv_static.v[:, :N_SLOTS], kv_eager.v, atol=1e-5, rtol=1e-5)
        d.drain_cq()
    return d, seen


def test_static_step_torch_matches_eager(model):
    d, seen = _drive(model, "torch", max_steps=200)
    assert all(r.done for r in d.records.values()), "every request finished"
    assert all(len(r.tokens) == r.max_tokens for r in d.records.values())
    assert seen["mixed"] and seen["padded"] and seen["stale"], seen


# ---- masked sample writes ----------------------------------------------------------------------


def _hand_layout(n_slots, budget):
    lay = StepLayout.allocate(n_slots, budget, "cpu")
    # bucket 8: decode rows for slots 1 and 3, then a 3-row chunk of slot 2 (positions 4-6; a
    # zero cache before it), then pad rows; slot 0 is idle
    rows = [(5, 1, 0), (7, 3, 0), (9, 2, 4), (10, 2, 5), (11, 2, 6)]
    for r, (tok, slot, pos) in enumerate(rows):
        lay.token_ids[r], lay.slot_of[r], lay.positions[r] = tok, slot, pos
    lay.sample_row[:] = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    lay.next_token[:] = torch.tensor([100, 101, 102, 103], dtype=torch.int32)
    return lay


def test_stale_sample_entries_never_write(model):
    n_slots, budget = 4, 16
    kv = StaticStep.new_kv_cache(model, n_slots, 32)
    step = StaticStep(model, kv, n_slots, 32, budget, attention="torch")
    lay = _hand_layout(n_slots, budget)
    # entries 2, 3 are stale: they collide with live slot 1 and name slot 2; wild parameters
    lay.sample_slot[:] = torch.tensor([1, 3, 1, 2], dtype=torch.int32)
    lay.sample_temperature[:] = torch.tensor([0.0, 0.0, float("nan"), -1.0])
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


def test_pad_rows_touch_only_the_scratch_slot(model):
    n_slots, budget = 4, 16
    kv = StaticStep.new_kv_cache(model, n_slots, 32)
    gen = torch.Generator().manual_seed(3)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    k0, v0 = kv.k.clone(), kv.v.clone()
    step = StaticStep(model, kv, n_slots, 32, budget, attention="torch")
    lay = _hand_layout(n_slots, budget)
    lay.n_samples[0] = 2
    step.run(16, lay)
    written = torch.zeros(kv.k.shape[1:3], dtype=torch.bool)  # [slots, positions]
    written[1, 0] = written[3, 0] = True
    written[2, 4:7] = True
    written[n_slots, 0] = True  # the scratch row the pad rows share
    assert torch.equal(kv.k[:, ~written], k0[:, ~written])
    assert torch.equal(kv.v[:, ~written], v0[:, ~written])
    assert not torch.equal(kv.k[:, 1, 0], k0[:, 1, 0])


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
    d.a["sample_seed"][1] = np.uint64(2**63 + 5)
    assert lay.read_counts() == (7, 2, 3) and lay.n_samples.shape == (1,)
    assert int(lay.seg_n_rows[1]) == 6 and lay.seg_slot.shape == (4,)
    assert int(lay.sample_seed[1]) == -(2**63) + 5
    lay.next_token[2] = 77
    assert d.a["next_token"][2] == 77
    assert lay.token_ids.shape == (8,) and lay.sample_row.shape == (4,)


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
    d.a["sample_temperature"][2] = 0.5
    assert lay.read_counts() == (7, 2, 3)
    assert lay.sample_temperature.dtype == torch.float32 and float(lay.sample_temperature[2]) == 0.5
    lay.next_token[1] = 9
    assert d.a["next_token"][1] == 9


def test_rejects_a_cache_without_scratch_slot(model):
    with pytest.raises(ValueError, match="n_slots \\+ 1"):
        StaticStep(model, model.new_kv_cache(4, 32), 4, 32, 16, attention="torch")
    step = StaticStep(model, StaticStep.new_kv_cache(model, 4, 32), 4, 32, 16, attention="torch")
    with pytest.raises(ValueError, match="bucket"):
        step.run(17, StepLayout.allocate(4, 16, "cpu"))


def test_eager_step_refuses_a_bucket_below_its_rows(model):
    eager = EagerStep(model, model.new_kv_cache(4, 32))
    lay = StepLayout.allocate(4, 16, "cpu")
    lay.n_tokens[0] = 5
    with pytest.raises(ValueError, match="bucket 4"):
        eager.run(4, lay)
