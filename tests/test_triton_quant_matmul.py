"""The int4 dequantize-in-the-matmul kernel (device/weights/triton_quant_matmul.py) against the
dense float32 reference, and the packing, the digit checks and the launch plan on their own.

The kernel runs under the Triton interpreter in a child process started with TRITON_INTERPRET=1
(`run_interpreted_checks`, as in test_triton_fused.py); the test skips without triton. The
interpreter cannot take a bfloat16 dot (it multiplies bf16's uint16 storage as integers) and
truncates fp32 -> bf16 casts: the child widens bf16 dot operands to float32 (exact: what the
tensor cores multiply) and rounds the casts to nearest even, as the GPU does.
"""

from __future__ import annotations

import time

import pytest
import torch

from ringleader.device.step import triton_attention
from ringleader.device.step.triton_launch import Launch, LaunchRecorder
from ringleader.device.weights.triton_quant_matmul import (
    HAVE_TRITON,
    MAX_SPLITS,
    TritonInt4Weight,
    choose_splits,
    dense_digits,
    pack_codes,
    reference_matmul,
)
from tests.triton_interpreter import run_interpreted_checks_of


def random_digits(n: int, k: int, group: int, n_digits: int, seed: int = 0) -> list[tuple]:
    """GGUF-like digits: scales of either sign around 0.05, zeros near -8 * scale (codes centred
    on 0, as Q4_0's), the second digit the finer one of a two-digit type."""
    gen = torch.Generator().manual_seed(seed)
    digits = []
    for d in range(n_digits):
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scale = (torch.rand(n, k // group, generator=gen) + 0.5) * 0.05 / 16**d
        scale = scale * torch.where(torch.rand(n, k // group, generator=gen) < 0.2, -1.0, 1.0)
        zero = -8 * scale + 0.01 * torch.randn(n, k // group, generator=gen)
        digits.append((codes, scale, zero))
    return digits


def test_kernel_under_interpreter():
    run_interpreted_checks_of("tests.test_triton_quant_matmul", "quant matmul interpreted checks passed")


# ---- packing, the reference, the checks --------------------------------------------------------


@pytest.mark.parametrize("group", [32, 64, 128])
def test_packing_puts_a_groups_halves_in_one_byte(group):
    codes = torch.randint(
        0, 16, (3, 2 * group), generator=torch.Generator().manual_seed(1), dtype=torch.uint8
    )
    packed = pack_codes(codes, group)
    assert packed.dtype == torch.uint8 and packed.shape == (3, group)
    half = group // 2
    for g in range(2):
        run = packed[:, g * half : (g + 1) * half]  # group g: one contiguous run of bytes
        assert torch.equal(run & 15, codes[:, g * group : g * group + half])
        assert torch.equal(run >> 4, codes[:, g * group + half : (g + 1) * group])


def test_reference_is_the_sum_of_the_digits():
    digits = random_digits(5, 64, 32, 2)
    w = dense_digits(digits, 32)
    for n, k in ((0, 0), (4, 63), (2, 33)):
        want = sum(float(c[n, k]) * float(s[n, k // 32]) + float(z[n, k // 32]) for c, s, z in digits)
        assert w[n, k].item() == pytest.approx(want, rel=1e-6)
    x = torch.randn(3, 64)
    torch.testing.assert_close(reference_matmul(x, digits, 32), x @ w.T)
    assert reference_matmul(x.bfloat16(), digits, 32).dtype == torch.bfloat16


def test_weight_holds_packed_codes_and_groups():
    digits = random_digits(10, 128, 32, 2)
    w = TritonInt4Weight.from_digits(digits, 32, "cpu")
    assert (w.n, w.k, w.n_digits, w.group_size) == (10, 128, 2, 32)
    assert w.nbytes == 2 * 10 * 64 + 2 * 2 * 10 * 4 * 4  # codes at half a byte; scale + zero fp32
    half = TritonInt4Weight.from_digits(digits, 32, "cpu", scale_dtype=torch.bfloat16)
    assert half.nbytes == 2 * 10 * 64 + 2 * 2 * 10 * 4 * 2 and half.scale.dtype == torch.bfloat16


def _bad(digits, group=32, match=""):
    with pytest.raises(ValueError, match=match):
        TritonInt4Weight.from_digits(digits, group, "cpu")


def test_bad_digits_say_what_is_wrong():
    (codes, scale, zero), (codes1, scale1, zero1) = random_digits(4, 64, 32, 2)
    over = codes.clone()
    over[1, 5] = 16
    _bad([(over, scale, zero)], match=r"digit 0: codes must lie in \[0, 15\], got values in \[0, 16\]")
    _bad(
        [(codes, scale, zero), (codes1.to(torch.int16) - 1, scale1, zero1)],
        match=r"digit 1: codes .*\[-1, 14\]",
    )
    _bad([(codes[:, :48], scale[:, :1], zero[:, :1])], match="K=48 is not a multiple of the group size 32")
    _bad(
        [(codes, scale, zero), (codes1[:3], scale1[:3], zero1[:3])],
        match=r"digit 1: codes shape \(3, 64\) differs",
    )
    _bad(
        [(codes, scale[:, :1], zero)], match=r"digit 0: scale shape \(4, 1\) is not \[N, K // G\] = \(4, 2\)"
    )
    _bad([(codes, scale, zero.T)], match=r"digit 0: zero shape \(2, 4\)")
    _bad([(codes.float(), scale, zero)], match="codes must be integers")
    _bad([(codes[0], scale, zero)], match="codes must be 2-D")
    _bad([(codes, scale, zero)] * 3, match="1 to 2 digits, got 3")
    _bad([], match="got 0")
    _bad([(codes, scale, zero)], group=16, match="group size 16 is not one of")


# ---- the launch plan ----------------------------------------------------------------------------


def test_choose_splits_fills_the_sms_only_for_long_k():
    assert choose_splits(448, 4096, 132) == 1  # llama-8b gate_up at one row: enough programs
    assert choose_splits(64, 4096, 132) == 4  # o: two waves would be 5, K holds 4 splits
    assert choose_splits(64, 14336, 132) == 5  # down: ceil(264 / 64)
    assert choose_splits(9, 576, 132) == 1  # SmolLM2's o: too short to split
    assert choose_splits(1, 1 << 20, 132) == MAX_SPLITS


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_launches_on_the_meta_device():
    """What the kernel is launched with, recorded without running it: the grid, split-K's float32
    partials, and the 16-row decode block."""
    meta = dict(device="meta")
    digit = (
        torch.empty(4096, 4096, dtype=torch.uint8, **meta),
        torch.empty(4096, 128, **meta),
        torch.empty(4096, 128, **meta),
    )
    weight = TritonInt4Weight.from_digits([digit, digit], 32, "meta")
    seen: list[Launch] = []
    with triton_attention.planning_for_sms(132), LaunchRecorder(seen.append) as rec:
        y1 = weight.matmul(torch.empty(1, 4096, dtype=torch.bfloat16, **meta))
        y256 = weight.matmul(torch.empty(2, 128, 4096, dtype=torch.bfloat16, **meta))
        y_forced = weight.matmul(torch.empty(3, 4096, dtype=torch.float32, **meta), n_splits=3)
    assert rec.counts == {"_int4_matmul_kernel": 3}
    assert y1.shape == (1, 4096) and y1.dtype == torch.bfloat16
    assert y256.shape == (2, 128, 4096) and y_forced.dtype == torch.float32
    decode, prefill, forced = seen
    assert decode.grid == (1, 64, 4) and decode.args[4].dtype == torch.float32  # partials
    assert decode.meta["BLOCK_M"] == 16 and decode.meta["N_DIGITS"] == 2
    assert prefill.grid == (4, 64, 1) and prefill.args[4].dtype == torch.bfloat16  # straight into y
    assert forced.grid[2] == 3 and forced.meta["DOT_PRECISION"] == "tf32x3"


# ---- the kernel, in the interpreted child -------------------------------------------------------


def _interpreter_dots_bf16() -> None:
    """Widens the interpreter's bf16 dot operands (uint16 storage) to float32, exactly."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot = builder.create_dot

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


# (N, K, group): N past a 64-row block's edge; one or several K tiles; each group size
SHAPES = [(72, 256, 32), (40, 192, 64), (24, 256, 128)]
SPLIT_SHAPE = (40, 768, 32)


def _tolerance(dtype: torch.dtype, ref: torch.Tensor) -> dict:
    scale = ref.float().abs().max().item()
    # bf16 / fp16: W rounded once to x's dtype (a relative 2^-9 / 2^-12 per element), y rounded once
    rel = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    return dict(rtol=rel, atol=rel * scale)


def check_matmul(shape, n_digits, m, dtype, n_splits=None, strided=False, device="cpu"):
    n, k, group = shape
    digits = random_digits(n, k, group, n_digits, seed=n * 7 + k + n_digits)
    weight = TritonInt4Weight.from_digits(digits, group, device)
    x = torch.randn(m, 2 * k if strided else k, generator=torch.Generator().manual_seed(m)).to(dtype)
    if strided:
        x = x[:, ::2]  # a column stride of 2
    got = weight.matmul(x.to(device), n_splits=n_splits)
    assert got.device.type == device
    got = got.cpu()
    ref = reference_matmul(x, digits, group)
    assert got.dtype == dtype and got.shape == (m, n)
    what = f"N={n} K={k} G={group} digits={n_digits} M={m} {dtype} splits={n_splits}"
    torch.testing.assert_close(
        got.float(), ref.float(), **_tolerance(dtype, ref), msg=lambda s: f"{what}: {s}"
    )
    return got


def splits_launched(shape, m: int, dtype: torch.dtype, n_splits: int) -> int:
    """The K splits of the launch check_matmul makes, recorded instead of run."""
    n, k, group = shape
    weight = TritonInt4Weight.from_digits(random_digits(n, k, group, 2), group, "cpu")
    seen: list[Launch] = []
    with LaunchRecorder(seen.append):
        weight.matmul(torch.zeros(m, k, dtype=dtype), n_splits=n_splits)
    (only,) = seen
    return only.grid[2]


def run_interpreted_checks() -> None:
    """Entry point of the child process (TRITON_INTERPRET=1 set before anything imported triton)."""
    from ringleader.device.weights import triton_quant_matmul as tq
    from tests.test_triton_fused import _interpreter_rounds_bf16_to_nearest

    assert type(tq._int4_matmul_kernel).__name__ == "InterpretedFunction", "triton imported too early"
    _interpreter_dots_bf16()
    assert _interpreter_rounds_bf16_to_nearest(), "this triton's interpreter has no cast hook"
    t0 = time.perf_counter()
    check_every_case("cpu")
    print(f"quant matmul interpreted checks passed in {time.perf_counter() - t0:.1f} s")


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA device and triton")
def test_compiled_kernel_on_the_gpu():
    """The same cases as the interpreted child, compiled and run on the GPU (its tensor-core dots
    and real split-K partials) against the dense float32 reference on the CPU."""
    check_every_case("cuda")


def check_every_case(device: str) -> None:
    for shape in SHAPES:
        for n_digits in (1, 2):
            for m in (1, 3, 16, 33):
                for dtype in (torch.float32, torch.bfloat16):
                    check_matmul(shape, n_digits, m, dtype, device=device)
    check_matmul(SHAPES[0], 2, 5, torch.float16, device=device)
    check_matmul(SHAPES[0], 1, 2, torch.float32, strided=True, device=device)
    # split-K: each split a run of K tiles (fp32 partials summed), as close as one launch; K of
    # 24 groups is 6 decode tiles in bf16 (2 per split at 3 splits) and 12 in fp32
    for n_splits in (2, 3, 6):
        for dtype in (torch.float32, torch.bfloat16):
            whole = check_matmul(SPLIT_SHAPE, 2, 3, dtype, n_splits=1, device=device)
            split = check_matmul(SPLIT_SHAPE, 2, 3, dtype, n_splits=n_splits, device=device)
            torch.testing.assert_close(split.float(), whole.float(), **_tolerance(dtype, whole))
            assert splits_launched(SPLIT_SHAPE, 3, dtype, n_splits) == n_splits
