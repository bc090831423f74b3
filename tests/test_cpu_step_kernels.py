"""device/step/cpu_step_kernels.py: the CPU step's few-row pointwise calls in C++ compute what
device/model/ops.py computes (bit for bit where the math is elementwise), and hand back to it
for the rows and dtypes they do not take."""

from __future__ import annotations

import pytest
import torch

from ringleader.device.model import LlamaModel, ops
from ringleader.device.step.cpu_step_kernels import FEW_ROWS, CpuStepKernels, cpu_step_kernels
from ringleader.device.step.step_batch import StepBatch


@pytest.fixture(scope="module")
def kernels() -> CpuStepKernels:
    k = cpu_step_kernels()
    assert k is not None, "the C++ pointwise kernels did not build"
    return k


@pytest.mark.parametrize("rows", [1, 3, FEW_ROWS])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(kernels, rows, with_delta):
    g = torch.Generator().manual_seed(rows)
    x, delta = torch.randn(rows, 576, generator=g) * 3, torch.randn(rows, 576, generator=g)
    w = torch.rand(576, generator=g) + 0.5
    want = ops.add_rms_norm(x, delta if with_delta else None, w, 1e-5)
    got = kernels.add_rms_norm(x, delta if with_delta else None, w, 1e-5)
    assert torch.equal(got[0], want[0])  # the residual add is one rounding either way
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-6)
    if not with_delta:
        assert got[0] is x


def test_silu_mul_matches_torch(kernels):
    gate_up = torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4
    torch.testing.assert_close(kernels.silu_mul(gate_up), ops.silu_mul(gate_up), rtol=2e-6, atol=1e-6)


def test_rope_store_is_rope_split_and_the_cache_writes_bit_for_bit(kernels):
    g = torch.Generator().manual_seed(2)
    rows, H, KV, D, slots = 4, 9, 3, 64, 40
    qkv = torch.randn(rows, (H + 2 * KV) * D, generator=g)
    angle = torch.rand(rows, D // 2, generator=g) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    cache_row = torch.tensor([7, 0, 39, 12])
    k_want, v_want = torch.zeros(slots, KV, D), torch.zeros(slots, KV, D)
    q_want, k, v = ops.rope_split(qkv, cos, sin, KV, D)
    k_want.index_copy_(0, cache_row, k)
    v_want.index_copy_(0, cache_row, v)
    k_got, v_got = torch.zeros(slots, KV, D), torch.zeros(slots, KV, D)
    q_got = kernels.rope_store(qkv, cos, sin, cache_row, k_got, v_got, KV, D)
    assert q_got is not None
    assert torch.equal(q_got, q_want) and torch.equal(k_got, k_want) and torch.equal(v_got, v_want)


def test_what_it_does_not_take_goes_to_torch(kernels):
    many = torch.randn(FEW_ROWS + 1, 64)
    w = torch.ones(64)
    assert torch.equal(kernels.add_rms_norm(many, None, w, 1e-5)[1], ops.add_rms_norm(many, None, w, 1e-5)[1])
    bf16 = torch.randn(2, 64, dtype=torch.bfloat16)
    assert kernels.silu_mul(bf16).dtype == torch.bfloat16
    assert torch.equal(kernels.silu_mul(bf16), ops.silu_mul(bf16))
    strided = torch.randn(2, 3 * 64 * 3)[:, ::3]
    caches = torch.zeros(4, 1, 64), torch.zeros(4, 1, 64)
    assert (
        kernels.rope_store(
            strided, torch.ones(2, 64), torch.zeros(2, 64), torch.tensor([0, 1]), *caches, 1, 64
        )
        is None
    )


@torch.inference_mode()
def test_the_tiny_models_steps_equal_torchs_ops():
    model = LlamaModel.from_preset("tiny", seed=3)
    prompts = [list(range(5, 40)), [1, 2, 3]]

    def run(use_cpu_kernels: bool) -> list[torch.Tensor]:
        import ringleader.device.model.llama as llama

        saved = llama.cpu_step_kernels
        if not use_cpu_kernels:
            llama.cpu_step_kernels = lambda: None  # the module's own switch point: torch's ops
        try:
            kv = model.new_kv_cache(2, 128)
            out = [model.step(StepBatch.from_segments([(s, p, 0) for s, p in enumerate(prompts)]), kv)]
            for i in range(6):  # decode rows: the few-row path
                segs = [(s, [100 + i], len(p) + i) for s, p in enumerate(prompts)]
                out.append(model.step(StepBatch.from_segments(segs), kv))
            return out
        finally:
            llama.cpu_step_kernels = saved

    fast, reference = run(True), run(False)
    for a, b in zip(fast, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("rows_subset", [False, True])
def test_decode_attention_reads_the_pages_in_place_as_the_gathered_sdpa_does(kernels, rows_subset):
    from ringleader.device.step.eager_attention import StepGathers, attend_gathered
    from ringleader.device.step.step_batch import StepPlan

    g = torch.Generator().manual_seed(4)
    T, H, KV, D, PS, P = 5, 9, 3, 64, 16, 40
    k_cache, v_cache = torch.randn(P, PS, KV, D, generator=g), torch.randn(P, PS, KV, D, generator=g)
    block_table = torch.randperm(P, generator=g)[: 5 * 8].view(5, 8)  # each slot's pages, scattered
    positions = torch.tensor([0, 17, 100, 63, 5])
    segments = [(s, [9], int(p)) for s, p in enumerate(positions)]
    batch = StepBatch.from_segments(segments, block_table=block_table)
    q = torch.randn(T, H, D, generator=g)
    rows = torch.tensor([1, 2, 4]) if rows_subset else None
    plan = StepPlan([(rows, int(positions.max()) + 1)], T if rows is None else len(rows), [])
    gathers = StepGathers.build(batch, plan, block_table, P, PS, H // KV)
    want = attend_gathered(q, gathers, k_cache, v_cache)
    got = torch.zeros_like(q)
    assert kernels.attends_in_place(q, k_cache, v_cache, batch.slot_of, batch.positions, block_table)
    kernels.decode_attention(q, rows, batch.slot_of, batch.positions, block_table, k_cache, v_cache, got)
    picked = slice(None) if rows is None else rows
    torch.testing.assert_close(got[picked], want[picked], rtol=1e-5, atol=1e-5)
    if rows is not None:
        assert not got[torch.tensor([0, 3])].any()  # rows not listed are left alone
