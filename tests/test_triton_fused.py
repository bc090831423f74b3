"""The fused pointwise kernels (device/step/triton_fused.py) against the torch ops of ops.py.

As in test_static_step.py, the kernels run under the Triton interpreter in a child process
started with TRITON_INTERPRET=1 (`run_interpreted_checks`); the test skips without triton.

Rounding: the interpreter's fp32 -> fp16 cast is numpy's (round to nearest even, as on the
GPU), but its fp32 -> bf16 cast truncates. The child patches that cast to round to nearest even
(`_interpreter_rounds_bf16_to_nearest`), so fp16 and bf16 are both checked to round where torch
rounds: the residual add bit for bit, the norm and silu * up bit for bit but for the rare
element where the fp32 rsqrt / exp differ by an ulp (<= 0.1% of elements, each within 1 ulp),
RoPE equal to its fp32 result rounded once and within a few ulps of torch's per-op rounding.
Should the patch not apply (another triton), bf16 falls back to 2-ulp tolerances.
"""

from __future__ import annotations

import time

import pytest
import torch

from ringleader.device.model import ops
from ringleader.device.model.config import ModelConfig
from ringleader.device.step.triton_fused import HAVE_TRITON
from ringleader.device.step.triton_launch import LaunchRecorder
from tests.triton_interpreter import run_interpreted_checks_of


def test_fused_kernels_under_interpreter():
    run_interpreted_checks_of("tests.test_triton_fused", "interpreted checks passed")


def run_interpreted_checks() -> None:
    """Entry point of the child process (TRITON_INTERPRET=1 set before anything imported triton)."""
    from ringleader.device.step import triton_fused as tf

    global BF16_TRUNCATES
    assert type(tf._silu_mul_kernel).__name__ == "InterpretedFunction", "triton imported too early"
    BF16_TRUNCATES = not _interpreter_rounds_bf16_to_nearest()
    t0 = time.perf_counter()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for hidden, strided in ((72, False), (72, True), (1000, True)):
            check_add_rms_norm(dtype, 5, hidden, strided)
        check_add_rms_norm(dtype, 2, 8192, False)
        for inter, strided in ((300, False), (300, True), (1500, False)):
            check_silu_mul(dtype, 6, inter, strided)
        # heads, kv heads, head_dim, page size, qkv / cache layout
        check_rope_store_kv(dtype, 8, 2, 16, 4, "contiguous")
        check_rope_store_kv(dtype, 4, 4, 64, 16, "transposed")  # one page holds a slot's context
        check_rope_store_kv(dtype, 6, 2, 48, 2, "padded")  # half = 24: not a power of two
    # fp32 activations into an fp16 cache: k rounded once from fp32, v cast
    check_rope_store_kv(torch.float32, 8, 2, 16, 8, "contiguous", cache_dtype=torch.float16)
    check_rope_store_kv(torch.float32, 2, 1, 16, 1, "contiguous")  # a page per position
    check_counter_uniform()
    check_penalize_and_scale()
    rounding = "truncating (2-ulp tolerance)" if BF16_TRUNCATES else "round to nearest even"
    print(f"interpreted checks passed in {time.perf_counter() - t0:.1f} s; bf16 casts {rounding}")


def check_counter_uniform() -> None:
    """The sampler's hash as one Triton launch: bit for bit sampling.counter_uniform, over seeds
    at the int64 edges and counters of either width (so a seed draws the same on every path)."""
    from ringleader.device.sampling.sampler import counter_uniform
    from ringleader.device.sampling.triton_sampler import counter_uniform_triton

    gen = torch.Generator().manual_seed(9)
    seed = torch.randint(-(2**63), 2**63 - 1, (3000,), generator=gen, dtype=torch.int64)
    seed[:5] = torch.tensor([0, -1, 2**32, -(2**63), 2**63 - 1])
    for counter in (
        torch.randint(0, 2**31 - 1, (3000,), generator=gen, dtype=torch.int32),
        torch.randint(-(2**62), 2**62, (3000,), generator=gen, dtype=torch.int64),
    ):
        assert torch.equal(counter_uniform_triton(seed, counter), counter_uniform(seed, counter))


def check_penalize_and_scale() -> None:
    """The penalties and the temperature division as one Triton launch: bit for bit
    sampling.penalize_and_scale, reading the count table through each row's slot (stale slots
    clamped into it), the penalties as strided views of the step layout's sample entries, into a
    new tensor (the logits stay raw); a row without a penalty is only divided, whatever its
    counts hold."""
    from ringleader.device.sampling.sampler import SamplingTensors, penalize_and_scale
    from ringleader.device.sampling.triton_sampler import penalize_and_scale_triton
    from ringleader.device.step.step_layout import StepLayout
    from ringleader.ipc.layout import PROMPT_MARK

    gen = torch.Generator().manual_seed(4)
    n_slots, vocab, m = 6, 2500, 5  # vocab: two and a half blocks
    lay = StepLayout.allocate(n_slots, 8, "cpu", 2, vocab)
    counts = torch.randint(0, 4, (n_slots, vocab), generator=gen, dtype=torch.int32)
    counts += PROMPT_MARK * (torch.rand(n_slots, vocab, generator=gen) < 0.2).int()
    lay.token_counts.copy_(counts)
    lay.sample_slot[:m] = torch.tensor([3, 0, 99, -4, 5], dtype=torch.int32)  # 99, -4: stale
    penalties = {
        "repetition_penalty": [1.3, 1.0, 0.7, 1.0, 2.5],
        "frequency_penalty": [0.0, 0.0, 1.5, -2.0, 0.25],
        "presence_penalty": [0.0, 0.0, -0.5, 1.0, 2.0],
    }
    for name, values in penalties.items():
        lay.params[name][:m] = torch.tensor(values)
    params = lay.sampling(m)
    assert params.repetition_penalty.stride(0) > 1  # views of the entries, as the step passes them
    logits = torch.randn(m, vocab, generator=gen) * 4
    logits[:, :7] = torch.tensor([0.0, -0.0, 3.0, -3.0, 1e-30, -1e-30, 50.0])
    raw = logits.clone()
    divisor = torch.tensor([1.0, 0.7, 1.0, 1.3, 0.05])  # greedy rows divide by 1
    want = penalize_and_scale(logits, params, divisor)
    got = penalize_and_scale_triton(logits, params, divisor)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(logits.view(torch.int32), raw.view(torch.int32)), "the logits were written"
    assert torch.equal(got[1], logits[1] / 0.7) and not torch.equal(got[0], logits[0])
    # rows as the counts' own rows (no slots), and a wide logits tensor sliced to its first rows
    plain = SamplingTensors(
        torch.zeros(3, dtype=torch.int32),
        counts[:3],
        **{k: torch.tensor(v[:3]) for k, v in penalties.items()},
    )
    wide = torch.randn(4, vocab + 40, generator=gen)[:3, :vocab]
    got = penalize_and_scale_triton(wide, plain, divisor[:3])
    assert torch.equal(got.view(torch.int32), penalize_and_scale(wide, plain, divisor[:3]).view(torch.int32))


def _interpreter_rounds_bf16_to_nearest() -> bool:
    """Makes the interpreter's fp32 -> bf16 cast round to nearest even as the GPU does (it
    truncates); False where this triton's interpreter has no such hook."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    cast = getattr(builder, "cast_impl", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if cast is None or handle is None:
        return False

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f32 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # stored as uint16
            return handle(bits.reshape(np.shape(src.data)), dst_type.scalar)
        return cast(self, src, dst_type)

    builder.cast_impl = cast_impl
    return True


# ---- tolerances ------------------------------------------------------------------------------

_EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
BF16_TRUNCATES = False  # set in the interpreted child when its bf16 cast could not be patched


def _truncated(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and BF16_TRUNCATES


def _assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float, what: str) -> None:
    """|got - want| <= ulps units in the last place of want's dtype (relative to |want|)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    g, w = got.double(), want.double()
    eps = _EPS[want.dtype]
    tiny = 1e-30 if want.dtype == torch.float32 else 1e-6  # away from the subnormal range
    bound = ulps * eps * w.abs().clamp_min(tiny) * 1.0001
    bad = (g - w).abs() > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off by more than {ulps} ulp(s)"


def _mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    return int((got != want).sum())


def _assert_rounded_alike(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """got rounds where want rounds: fp32 tight; fp16 / bf16 equal but for <= 0.1% of elements
    (an fp32 ulp of exp / rsqrt surviving the rounding), each within 1 ulp."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    elif _truncated(want.dtype):  # truncated on the way (twice at most)
        _assert_within_ulps(got, want, 2.0, what)
    else:
        _assert_within_ulps(got, want, 1.0, what)
        bad = _mismatches(got, want)
        assert bad <= max(1, got.numel() // 1000), f"{what}: {bad} of {got.numel()} elements differ"


# ---- add_rms_norm ----------------------------------------------------------------------------


def _rows(T: int, n: int, dtype: torch.dtype, gen: torch.Generator, strided: bool, scale: float = 1.0):
    """[T, n] in dtype, as a column slice of a wider buffer when strided (row stride > n)."""
    if strided:
        return (torch.randn(T, n + 13, generator=gen) * scale).to(dtype)[:, 5 : 5 + n]
    return (torch.randn(T, n, generator=gen) * scale).to(dtype)


def check_add_rms_norm(dtype: torch.dtype, T: int, hidden: int, strided: bool) -> None:
    from ringleader.device.step.triton_fused import add_rms_norm

    gen = torch.Generator().manual_seed(hidden + T)
    eps = 1e-5
    x = _rows(T, hidden, dtype, gen, strided, scale=3.0)
    delta = _rows(T, hidden, dtype, gen, strided)
    weight = (1.0 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    residual, normed = add_rms_norm(x, delta, weight, eps)
    assert residual.shape == normed.shape == (T, hidden) and normed.dtype == dtype
    if _truncated(dtype):  # the norm below is then checked on the kernel's own residual
        _assert_within_ulps(residual, x + delta, 1.0, "bf16 residual")
    else:
        assert torch.equal(residual, x + delta), f"{dtype} residual"
    _assert_rounded_alike(normed, ops.rms_norm(residual, weight, eps), f"{dtype} normed")

    same, normed = add_rms_norm(x, None, weight, eps)
    assert same is x  # no add: the residual is x itself
    _assert_rounded_alike(normed, ops.rms_norm(x, weight, eps), f"{dtype} normed, no delta")


# ---- silu_mul ----------------------------------------------------------------------------


def check_silu_mul(dtype: torch.dtype, T: int, inter: int, strided: bool) -> None:
    from ringleader.device.step.triton_fused import silu_mul

    gen = torch.Generator().manual_seed(inter + T)
    if strided:  # column stride T: a transposed buffer
        gate_up = (torch.randn(2 * inter, T, generator=gen) * 4).to(dtype).t()
    else:
        gate_up = (torch.randn(T, 2 * inter, generator=gen) * 4).to(dtype)
    out = silu_mul(gate_up)
    assert out.shape == (T, inter) and out.dtype == dtype
    # silu rounded to the dtype before the product, as torch does (rounding once would differ
    # from torch in ~25% of the elements)
    _assert_rounded_alike(out, ops.silu_mul(gate_up), f"{dtype} silu_mul")


# ---- rope_store_kv ---------------------------------------------------------------------------

N_SLOTS, CTX = 5, 12  # a case's max_ctx is CTX rounded up to whole pages


def rope_rows(max_ctx: int) -> list[tuple[int, int]]:
    """(slot, position): slot -1 = pad row."""
    return [
        (0, 0),
        (1, max_ctx - 1),  # the last position
        (-1, 0),  # pad row: scratch page, offset 0
        (2, 3),
        (2, 4),
        (2, 5),  # a prefill chunk (across a page boundary at page sizes 2 and 4)
        (-1, 7),  # pad row with a stale position: still the scratch page's offset 0
        (3, max_ctx + 4),  # clamped to the last position
        (4, 9),
    ]


def _paged_pool(
    rows: list[tuple[int, int]], pages_per_slot: int, page_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, int, int]:
    """A block table [N_SLOTS, pages_per_slot] over a pool of shuffled pages, the pool's size and
    the scratch page (one no slot owns). Only the entries the rows write through are real pages
    of their slot; every other entry is a random page of the pool, so a kernel reading one
    writes a cell it must not."""
    n_pages = N_SLOTS * pages_per_slot + 3
    perm = torch.randperm(n_pages, generator=gen)
    owned = perm[: N_SLOTS * pages_per_slot].view(N_SLOTS, pages_per_slot)
    table = torch.randint(n_pages, (N_SLOTS, pages_per_slot), generator=gen)
    max_ctx = pages_per_slot * page_size
    for s, p in rows:
        if s >= 0:
            entry = min(max(p, 0), max_ctx - 1) // page_size
            table[s, entry] = owned[s, entry]
    return table.to(torch.int32), n_pages, int(perm[-1])


def _rope_reference(
    qkv, cos_table, sin_table, block_table, slot_of, positions, page_size, scratch_page, H, KV, D
):
    """ops.apply_rope on the q / k views, and the cell each row's k / v go to: returns q [T, H, D],
    k and v [T, KV, D], and each row's page and offset [T]."""
    T = qkv.shape[0]
    max_ctx = block_table.shape[1] * page_size
    pos = positions.long().clamp(0, min(cos_table.shape[0], max_ctx) - 1)
    cos, sin = cos_table.index_select(0, pos), sin_table.index_select(0, pos)
    q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
    q = ops.apply_rope(q.reshape(T, H, D), cos, sin)
    k = ops.apply_rope(k.reshape(T, KV, D), cos, sin)
    live = slot_of >= 0
    page = torch.where(live, block_table[slot_of.clamp(min=0).long(), pos // page_size].long(), scratch_page)
    offset = torch.where(live, pos % page_size, 0)
    return q, k, v.reshape(T, KV, D), page, offset


def _stored(
    cache: torch.Tensor, page: torch.Tensor, offset: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """A copy of cache with rows written at (page, offset), cast to the cache's dtype."""
    out = cache.clone()
    out[page, offset] = rows.to(cache.dtype)
    return out


def check_rope_store_kv(
    dtype: torch.dtype,
    H: int,
    KV: int,
    D: int,
    page_size: int,
    layout: str,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """layout: "contiguous"; "transposed" (qkv column stride T, pages stored [P, KV, PS, D]);
    "padded" (qkv a column slice of a wider buffer, pages layer 1 of a [2, P, PS, KV, D] pair)."""
    from ringleader.device.step.triton_fused import rope_store_kv

    cache_dtype = cache_dtype or dtype
    gen = torch.Generator().manual_seed(H * 100 + D + page_size)
    pages_per_slot = -(-CTX // page_size)
    max_ctx = pages_per_slot * page_size
    rows = rope_rows(max_ctx)
    T, width = len(rows), (H + 2 * KV) * D
    slot_of = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    positions = torch.tensor([p for _, p in rows], dtype=torch.int32)
    block_table, n_pages, scratch = _paged_pool(rows, pages_per_slot, page_size, gen)
    config = ModelConfig(
        vocab_size=8,
        hidden_size=H * D,
        intermediate_size=8,
        num_layers=1,
        num_heads=H,
        num_kv_heads=KV,
        head_dim=D,
    )
    # a table longer than the cache: the cache bounds the clamp
    n_table = max_ctx + 4 if layout == "padded" else max_ctx
    cos_table, sin_table = ops.rope_tables(config, n_table, dtype, "cpu")

    def cache_init() -> torch.Tensor:
        full = torch.randn(2, n_pages, page_size, KV, D, generator=gen).to(cache_dtype)
        if layout == "transposed":
            return full[0].permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # [P, PS, KV, D] view
        return full[1] if layout == "padded" else full[0].clone()

    if layout == "transposed":
        qkv = (torch.randn(width, T, generator=gen) * 2).to(dtype).t()
    elif layout == "padded":
        qkv = (torch.randn(T, width + 24, generator=gen) * 2).to(dtype)[:, 8 : 8 + width]
    else:
        qkv = (torch.randn(T, width, generator=gen) * 2).to(dtype)
    k_cache, v_cache = cache_init(), cache_init()
    other_layer = k_cache._base.select(0, 0).clone() if layout == "padded" else None
    paging = (block_table, slot_of, positions, page_size, scratch, H, KV, D)
    want_q, want_k, v, page, offset = _rope_reference(qkv, cos_table, sin_table, *paging)
    # the fp32 result rounded once: what the kernel computes
    once_q, once_k, *_ = _rope_reference(qkv.float(), cos_table.float(), sin_table.float(), *paging)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    q = rope_store_kv(
        qkv, cos_table, sin_table, block_table, slot_of, positions, k_cache, v_cache, scratch, H, KV, D
    )
    assert q.shape == (T, H, D) and q.dtype == dtype and k_cache.dtype == cache_dtype

    # exactly the rows' cells (page, offset) changed, in k and v alike; pad rows' is the
    # scratch page's first cell
    written = torch.zeros(n_pages, page_size, dtype=torch.bool)
    written[page, offset] = True
    assert written[scratch].tolist() == [True] + [False] * (page_size - 1)
    assert torch.equal(k_cache[~written], k_before[~written]), "k cache changed outside the written cells"
    assert torch.equal(v_cache[~written], v_before[~written]), "v cache changed outside the written cells"
    if other_layer is not None:
        assert torch.equal(k_cache._base.select(0, 0), other_layer), "the other layer was written"

    # real cells, one row each: v stored as is (cast), k rotated in fp32 and rounded once
    real = written.clone()
    real[scratch] = False
    assert torch.equal(v_cache[real], _stored(v_before, page, offset, v)[real]), "v is stored as is"
    _assert_rounded_alike(k_cache[real], _stored(k_before, page, offset, once_k)[real], f"{cache_dtype} k")
    _assert_rounded_alike(q, once_q.to(dtype), f"{dtype} q")
    torch_k = _stored(k_before, page, offset, want_k)[real]
    if dtype == torch.float32:
        torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-5)
    if cache_dtype == torch.float32:
        torch.testing.assert_close(k_cache[real], torch_k, atol=1e-6, rtol=1e-5)
    if dtype != torch.float32:  # and close to torch's per-op rounding, within a few ulps of |x|
        atol = 24 * _EPS[dtype]  # 3 ulps at |qkv| ~ 8 (randn * 2); cos / sin <= 1
        torch.testing.assert_close(q, want_q, atol=atol, rtol=0)
        torch.testing.assert_close(k_cache[real], torch_k, atol=atol, rtol=0)
    # the scratch cell holds one of the pad rows' k / v (which one lands there is left open)
    pad_rows = torch.nonzero(slot_of < 0).flatten().tolist()
    assert any(torch.equal(v_cache[scratch, 0], v[t].to(cache_dtype)) for t in pad_rows), "scratch v"
    k_tol = dict(atol=24 * _EPS[cache_dtype], rtol=0)
    scratch_k = k_cache[scratch, 0]
    assert any(torch.allclose(scratch_k, once_k[t].to(cache_dtype), **k_tol) for t in pad_rows), "scratch k"

    # a bucket of pad rows alone touches the scratch page's first cell and nothing else
    k_before, v_before = k_cache.clone(), v_cache.clone()
    no_slot = torch.full_like(slot_of, -1)
    rope_store_kv(
        qkv, cos_table, sin_table, block_table, no_slot, positions, k_cache, v_cache, scratch, H, KV, D
    )
    scratch_cell = torch.zeros(n_pages, page_size, dtype=torch.bool)
    scratch_cell[scratch, 0] = True
    assert torch.equal(k_cache[~scratch_cell], k_before[~scratch_cell]), "a pad row wrote a real page"
    assert torch.equal(v_cache[~scratch_cell], v_before[~scratch_cell]), "a pad row wrote a real page"


# ---- launches, on the meta device ---------------------------------------------------------------


def test_each_wrapper_is_one_launch_on_meta():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.step.triton_fused import add_rms_norm, rope_store_kv, silu_mul

    meta = dict(device="meta", dtype=torch.bfloat16)
    T, hidden, inter, H, KV, D, S, C, PS = 7, 4096, 14336, 32, 8, 128, 9, 64, 16
    x, delta, w = torch.empty(T, hidden, **meta), torch.empty(T, hidden, **meta), torch.empty(hidden, **meta)
    with LaunchRecorder() as rec:
        residual, normed = add_rms_norm(x, delta, w, 1e-5)
    assert dict(rec.counts) == {"_add_rms_norm_kernel": 1}
    assert residual.shape == normed.shape == (T, hidden) and residual.dtype == normed.dtype == torch.bfloat16
    assert residual.device.type == normed.device.type == "meta"
    with LaunchRecorder() as rec:
        same, normed = add_rms_norm(x, None, torch.empty(hidden, device="meta", dtype=torch.float32), 1e-5)
    assert dict(rec.counts) == {"_add_rms_norm_kernel": 1}
    assert same is x and normed.dtype == torch.float32  # weight * x promotes, as ops.rms_norm

    qkv = torch.empty(T, (H + 2 * KV) * D, **meta)
    cos, sin = torch.empty(C, D, **meta), torch.empty(C, D, **meta)
    slot_of = torch.empty(T, device="meta", dtype=torch.int32)
    positions = torch.empty(T, device="meta", dtype=torch.int32)
    block_table = torch.empty(S, C // PS, device="meta", dtype=torch.int32)
    k_cache, v_cache = torch.empty(2, S * C // PS + 1, PS, KV, D, **meta).unbind(0)
    scratch_page = k_cache.shape[0] - 1
    with LaunchRecorder() as rec:
        q = rope_store_kv(
            qkv, cos, sin, block_table, slot_of, positions, k_cache, v_cache, scratch_page, H, KV, D
        )
    assert dict(rec.counts) == {"_rope_store_kv_kernel": 1}
    assert q.shape == (T, H, D) and q.dtype == torch.bfloat16 and q.device.type == "meta"

    with LaunchRecorder() as rec:
        out = silu_mul(torch.empty(T, 2 * inter, **meta))
    assert dict(rec.counts) == {"_silu_mul_kernel": 1}
    assert out.shape == (T, inter) and out.dtype == torch.bfloat16 and out.device.type == "meta"


def test_shape_errors():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.step.triton_fused import add_rms_norm, rope_store_kv, silu_mul

    meta = dict(device="meta", dtype=torch.float16)
    with pytest.raises(ValueError):
        add_rms_norm(torch.empty(3, 8, **meta), None, torch.empty(9, **meta), 1e-5)
    with pytest.raises(ValueError):
        silu_mul(torch.empty(3, 7, **meta))
    idx = torch.empty(3, device="meta", dtype=torch.int32)
    table = torch.empty(2, 4, device="meta", dtype=torch.int32)
    cache = torch.empty(9, 8, 2, 16, **meta)  # 9 pages of 8 positions
    cos = torch.empty(32, 16, **meta)
    qkv = torch.empty(3, 128, **meta)
    with pytest.raises(ValueError):  # 4 q + 2 * 2 kv heads of 16 columns is 128, not 120
        rope_store_kv(torch.empty(3, 120, **meta), cos, cos, table, idx, idx, cache, cache, 8, 4, 2, 16)
    with pytest.raises(ValueError):  # the scratch page must be one of the pool's pages
        rope_store_kv(qkv, cos, cos, table, idx, idx, cache, cache, 9, 4, 2, 16)
    with pytest.raises(ValueError):  # pages of 6 positions: the page size must be a power of two
        odd = torch.empty(9, 6, 2, 16, **meta)
        rope_store_kv(qkv, cos, cos, table, idx, idx, odd, odd, 8, 4, 2, 16)
    with pytest.raises(ValueError):  # the block table is [n_slots, pages per slot]
        rope_store_kv(qkv, cos, cos, table[0], idx, idx, cache, cache, 8, 4, 2, 16)
