"""Ragged attention's Triton kernels (single pass and split-K / flash-decoding) against the
reference, on the CPU.

The kernels run under the Triton interpreter, which has to be switched on before triton is
first imported, so those checks run in a child process started with TRITON_INTERPRET=1
(`run_interpreted_checks`); the test skips when triton is not
installed. choose_splits' rule and the launch count (on the meta device, through
triton_launch's LaunchRecorder) are checked in this process.
"""

from __future__ import annotations

import pytest
import torch

from ringleader.device.model.triton_attention import (
    DEFAULT_SM_COUNT,
    HAVE_TRITON,
    MAX_SPLITS,
    choose_splits,
    ragged_attention_reference,
)
from ringleader.device.model.triton_launch import LaunchRecorder
from tests.triton_interpreter import run_interpreted_checks_of


def test_split_k_under_interpreter():
    run_interpreted_checks_of("tests.test_split_k_attention", "split-k interpreted checks passed")


# ---- the kernels, in the child process --------------------------------------------------------

MAX_CTX = 320  # 5 blocks of BLOCK_N = 64
# heads, kv heads, head_dim: GQA groups 1, 4, 8 (the interpreter runs ~10 ms a program: keep
# the grids small)
SHAPES = [(2, 2, 16), (8, 2, 32), (16, 2, 64)]
# heads, kv heads, head_dim of the single-pass kernel alone (MHA, a head_dim not a power of
# two, a group of 16)
ONE_PASS_SHAPES = [(4, 4, 16), (6, 2, 24), (16, 1, 64)]
SPLITS = [1, 2, 3, 8]  # 8 is more than the 5 blocks of a full-length row
ROWS = [  # (slot, first position, n_rows); slot -1 = pad rows
    (0, 0, 1),  # first token of a request: one position, every other split empty
    (1, 63, 1),
    (2, 64, 1),  # either side of a BLOCK_N boundary
    (-1, 0, 1),  # a pad row in the middle
    (3, 299, 1),  # a long decode row
    (4, 125, 5),  # prefill chunk crossing a block boundary
    (5, MAX_CTX - 1, 1),  # the last position
    (1, 191, 1),  # a second row of slot 1, at a block's last column
    (-1, 0, 2),  # bucket padding at the end
]


def run_interpreted_checks() -> None:
    """Entry point of the child process (TRITON_INTERPRET=1 set before anything imported triton)."""
    from ringleader.device.model import triton_attention as ta

    assert ta.triton_interpreted(), "triton was imported before TRITON_INTERPRET=1 took effect"
    for n_heads, n_kv, head_dim in SHAPES:
        case = make_case(n_heads, n_kv, head_dim, torch.float32)
        for n_splits in SPLITS:
            check_matches_reference(ta.ragged_attention_triton, case, n_splits)
    for n_heads, n_kv, head_dim in ONE_PASS_SHAPES:
        check_matches_reference(
            ta.ragged_attention_triton, make_case(n_heads, n_kv, head_dim, torch.float32), 1
        )
    # the GPU runs bf16, but the interpreter's tl.dot mishandles bf16 (numpy has no bf16);
    # fp16 takes the same low-precision path (p cast to v's dtype, cast on store)
    fp16_cases = [((16, 2, 64), 1), ((16, 2, 64), 3), ((8, 2, 32), 8), ((8, 2, 64), 1)]
    for (n_heads, n_kv, head_dim), n_splits in fp16_cases:
        case = make_case(n_heads, n_kv, head_dim, torch.float16)
        check_matches_reference(ta.ragged_attention_triton, case, n_splits)
    print("split-k interpreted checks passed")


def _rows(spec):
    """spec: [(slot, first_pos, n_rows)] -> slot_of, positions (int32); slot -1 = pad rows."""
    slot_of, pos = [], []
    for slot, p0, n in spec:
        slot_of += [slot] * n
        pos += [0] * n if slot < 0 else list(range(p0, p0 + n))
    return torch.tensor(slot_of, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)


def make_case(n_heads, n_kv, head_dim, dtype):
    """Inputs, the reference output and the caches poisoned with NaN wherever no row may read."""
    gen = torch.Generator().manual_seed(n_heads * 100 + n_kv * 10 + head_dim)
    n_slots = 6  # slot 6 = scratch, never read
    shape = (n_slots + 1, MAX_CTX, n_kv, head_dim)
    k, v = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    slot_of, positions = _rows(ROWS)
    q = torch.randn(slot_of.shape[0], n_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    ref = ragged_attention_reference(q, k, v, slot_of, positions, scale)
    kp, vp = k.clone(), v.clone()
    for s in range(n_slots + 1):
        mine = positions[slot_of == s]
        end = int(mine.max()) + 1 if mine.numel() else 0
        kp[s, end:] = float("nan")
        vp[s, end:] = float("nan")
    return dict(q=q, k=kp, v=vp, v_clean=v, slot_of=slot_of, positions=positions, scale=scale, ref=ref)


def check_matches_reference(attention, case, n_splits):
    q, slot_of = case["q"], case["slot_of"]
    T, H, D = q.shape
    # a strided output prefilled with NaN: every element (pad rows too) must be written
    out = torch.full((T, H, 2 * D), float("nan"), dtype=q.dtype)[..., :D]
    got = attention(
        q, case["k"], case["v"], slot_of, case["positions"], case["scale"], out=out, n_splits=n_splits
    )
    assert got.data_ptr() == out.data_ptr() and got.dtype == q.dtype
    tol = dict(atol=2e-5, rtol=1e-5) if q.dtype == torch.float32 else dict(atol=3e-3, rtol=1e-2)
    msg = f"shape {tuple(q.shape)}, kv {case['k'].shape[2]}, {q.dtype}, n_splits={n_splits}"
    torch.testing.assert_close(got.float(), case["ref"].float(), **tol, msg=lambda m: f"{msg}: {m}")
    assert torch.all(got[slot_of < 0] == 0), msg
    # a decode row over one cached position returns that position's v (GQA mapping), whatever
    # the number of empty splits beside it
    g = H // case["k"].shape[2]
    expect = case["v_clean"][0, 0].repeat_interleave(g, dim=0)
    torch.testing.assert_close(got[0], expect, atol=1e-6, rtol=1e-6, msg=msg)


# ---- choose_splits ------------------------------------------------------------------------------


def test_choose_splits_fills_the_sms_for_a_long_decode():
    # one decode row, 8 kv heads on an H100: 8 programs alone; split to the cap
    assert choose_splits(1, 4096, 8, 132) == MAX_SPLITS
    # 4 rows x 8 kv heads = 32 programs: ceil(264 / 32) = 9 splits, >= 2 waves
    assert choose_splits(4, 4096, 8, 132) == 9
    assert 9 * 4 * 8 >= 2 * 132
    # a shorter cache caps the splits at its block count
    assert choose_splits(1, 320, 8, 132) == 5
    assert choose_splits(1, 320, 8, 132, block_n=32) == 10


def test_choose_splits_is_one_when_splitting_cannot_help():
    assert choose_splits(17, 4096, 8, 132) == 1  # 136 programs already fill 132 SMs
    assert choose_splits(512, 8192, 8, 132) == 1
    assert choose_splits(1, 128, 8, 132) == 1  # max_ctx <= 2 * BLOCK_N
    assert choose_splits(1, 64, 1, 132) == 1
    assert choose_splits(1, 129, 8, 132) == 3  # past that: the block count caps it


def test_choose_splits_bounds_and_monotonic():
    rows_list = [1, 2, 3, 4, 8, 16, 17, 32, 64, 256]
    ctx_list = [1, 64, 128, 129, 192, 256, 1000, 2048, 4096, 32768]
    for n_kv in (1, 2, 8):
        for n_sms in (16, 108, 132):
            for n_rows in rows_list:
                row = [choose_splits(n_rows, c, n_kv, n_sms) for c in ctx_list]
                assert row == sorted(row), (n_rows, n_kv, n_sms, row)  # longer caches: no fewer
                for c, s in zip(ctx_list, row):
                    assert 1 <= s <= min(MAX_SPLITS, -(-c // 64)), (n_rows, c, s)
            for c in ctx_list:
                col = [choose_splits(r, c, n_kv, n_sms) for r in rows_list]
                assert col == sorted(col, reverse=True), (c, n_kv, n_sms, col)  # more rows: no more


# ---- launches, counted on the meta device ------------------------------------------------------


def _meta_inputs(T=3, H=32, KV=8, D=128, S=5, C=4096):
    meta = dict(device="meta")
    q = torch.empty(T, H, D, dtype=torch.bfloat16, **meta)
    k = torch.empty(S, C, KV, D, dtype=torch.bfloat16, **meta)
    slot_of = torch.empty(T, dtype=torch.int32, **meta)
    return q, k, torch.empty_like(k), slot_of, torch.empty_like(slot_of)


@pytest.mark.parametrize(
    ("n_splits", "kernels"),
    [
        (4, {"_ragged_attention_split_kernel": 1, "_combine_splits_kernel": 1}),
        (None, {"_ragged_attention_split_kernel": 1, "_combine_splits_kernel": 1}),  # 3 x 8 programs
        (1, {"_ragged_attention_kernel": 1}),
    ],
)
def test_launches_recorded_on_meta_tensors(n_splits, kernels):
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.model.triton_attention import ragged_attention_triton

    q, k, v, slot_of, positions = _meta_inputs()
    with LaunchRecorder() as rec:
        out = ragged_attention_triton(q, k, v, slot_of, positions, 0.1, n_splits=n_splits)
    assert dict(rec.counts) == kernels
    assert out.shape == q.shape and out.device.type == "meta"


def test_auto_splits_on_a_full_bucket_is_the_single_launch():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.model.triton_attention import ragged_attention_triton

    T = -(-DEFAULT_SM_COUNT // 8)  # T x 8 kv heads programs fill the SMs on their own
    q, k, v, slot_of, positions = _meta_inputs(T=T)
    with LaunchRecorder() as rec:
        ragged_attention_triton(q, k, v, slot_of, positions, 0.1)
    assert dict(rec.counts) == {"_ragged_attention_kernel": 1}


def test_rejects_zero_splits():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.model.triton_attention import ragged_attention_triton

    with pytest.raises(ValueError, match="n_splits"):
        ragged_attention_triton(*_meta_inputs(), 0.1, n_splits=0)
