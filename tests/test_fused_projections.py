"""The fused step's projection kernels (device/step/fused_projections.py) against torch.

Under the Triton interpreter in a child process (tests/triton_interpreter.py), with the two
patches the other kernel tests use: bf16 casts round to nearest even, and bf16 dot operands are
widened exactly (the interpreter multiplies their uint16 storage otherwise). The references are
the layered step's own functions: ops.add_rms_norm / silu_mul / rope_split, dense_matmul, and
for int4 weights the dense digits rounded to the activations' dtype (what the int4 kernels feed
their dot). Only the summation order differs, so outputs agree within a few units in the last
place of the output's dtype; the argmax is checked exactly against the kernel's own logits.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F

from ringleader.device.model import ops
from ringleader.device.model.presets import preset_config
from ringleader.device.step.triton_gemv import FusedWeight, rows_block, tile_meta
from ringleader.device.weights.triton_quant_matmul import TritonInt4Weight, dense_digits
from tests.triton_interpreter import run_interpreted_checks_of

MARKER = "fused projection checks passed"
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
KINDS = ("dense", "bf16-weights", "int4", "int4x2")


def test_fused_projections_under_interpreter():
    run_interpreted_checks_of("tests.test_fused_projections", MARKER, timeout=600)


def test_rows_blocks_and_tiles():
    assert [rows_block(t) for t in (1, 2, 16, 17, 32)] == [1, 16, 16, 32, 32]
    with pytest.raises(ValueError, match="1 to 32 rows"):
        rows_block(33)
    dense = FusedWeight.from_dense(torch.empty(64, 256, dtype=torch.bfloat16))
    assert dense is not None
    one = tile_meta(1, 32, dense, torch.bfloat16)
    assert one["USE_DOT"] is False and one["BLOCK_T"] == 1 and one["BLOCK_K"] == 128
    many = tile_meta(20, 32, dense, torch.bfloat16)
    assert many["USE_DOT"] is True and many["BLOCK_T"] == 32 and many["num_warps"] == 8
    # a 32-row block of narrow columns stays on the FMA path with a K tile that fits registers
    narrow = tile_meta(32, 8, dense, torch.bfloat16)
    assert narrow["USE_DOT"] is False and 32 * 8 * narrow["BLOCK_K"] <= 8192
    odd = FusedWeight.from_int4(_int4(48, 96, 1, "cpu"))  # three groups: one group a K tile
    assert tile_meta(1, 32, odd, torch.float32)["BLOCK_K"] == 32


def test_fused_weight_reads_what_the_model_stores():
    linear = torch.nn.Linear(64, 32, bias=False)
    w = FusedWeight.of(linear)
    assert w is not None and (w.n, w.k) == (32, 64) and not w.is_int4
    int4 = _int4(32, 64, 2, "cpu")
    bound = FusedWeight.of(int4.matmul)  # a tied quantized head is its kernel's bound method
    assert bound is not None and bound.is_int4 and bound.packed.shape[0] == 2
    assert FusedWeight.of(object()) is None  # e.g. row bands of mixed kinds
    assert FusedWeight.from_dense(torch.empty(64, 32).t()) is None  # K strided


def _int4(n: int, k: int, n_digits: int, device: str, group: int = 32) -> TritonInt4Weight:
    g = torch.Generator().manual_seed(n * 1000 + k + n_digits)
    digits = [
        (
            torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
            torch.rand(n, k // group, generator=g) * 0.02 / n_digits + 0.001,
            (torch.rand(n, k // group, generator=g) - 0.5) * 0.1,
        )
        for _ in range(n_digits)
    ]
    return TritonInt4Weight.from_digits(digits, group, device)


def _weight(kind: str, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[FusedWeight, torch.Tensor]:
    """(the kernels' weight, the dense weight the reference multiplies by, in the dot's dtype)."""
    if kind.startswith("int4"):
        w = _int4(n, k, 2 if kind == "int4x2" else 1, "cpu")
        digits = [(w.packed[d], w.scale[d], w.zero[d]) for d in range(w.n_digits)]
        unpacked = [(_unpack(p, w.group_size), s, z) for p, s, z in digits]
        return FusedWeight.from_int4(w), dense_digits(unpacked, w.group_size).to(dtype)
    g = torch.Generator().manual_seed(seed)
    wdtype = torch.bfloat16 if kind == "bf16-weights" else dtype
    dense = (torch.randn(n, k, generator=g) / k**0.5).to(wdtype)
    fused = FusedWeight.from_dense(dense)
    assert fused is not None
    return fused, dense


def _unpack(packed: torch.Tensor, group: int) -> torch.Tensor:
    n, half_k = packed.shape
    by_group = packed.reshape(n, half_k * 2 // group, group // 2)
    return torch.cat([by_group & 15, by_group >> 4], dim=2).reshape(n, half_k * 2)


def _project(x: torch.Tensor, kind: str, w: torch.Tensor) -> torch.Tensor:
    """The layered step's projection output: dense_matmul, or the int4 kernels' rounding."""
    if kind.startswith("int4"):
        return (x.float() @ w.float().T).to(x.dtype)
    return F.linear(x.to(w.dtype), w).to(x.dtype)


def _close(
    got: torch.Tensor, want: torch.Tensor, what: str, ulps: float = 4, rounded: torch.dtype | None = None
) -> None:
    """Within `ulps` units in the last place of the output's dtype at the output's magnitude;
    `rounded`: the projection's output went through this narrower dtype on both sides, so a sum
    that lands next to a rounding boundary may round either way (one ulp of it more: how close
    the two fp32 sums come depends on the order the CPU's GEMM adds them in, which differs
    between AVX2 and AVX-512 builds of torch)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype)
    scale = want.float().abs().amax().clamp(min=1e-6)
    err = (got.float() - want.float()).abs().amax()
    allowed = ulps * EPS[want.dtype] * scale + (EPS[rounded] * scale if rounded is not None else 0.0)
    assert err <= allowed, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def _rounded(kind: str, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a projection's output is rounded to before the dtype it is compared in."""
    return torch.bfloat16 if kind == "bf16-weights" and dtype != torch.bfloat16 else None


def check_add_projection(dtype: torch.dtype, kind: str, T: int, n_splits: int, bias: bool) -> None:
    from ringleader.device.step.fused_projections import add_projection

    N, K = 72, 256
    weight, dense = _weight(kind, N, K, dtype, seed=T)
    g = torch.Generator().manual_seed(T + 7)
    a = torch.randn(T, K, generator=g).to(dtype)
    res = torch.randn(T, N, generator=g).to(dtype)
    b = (torch.randn(N, generator=g) * 0.1).to(dtype) if bias else None
    y = _project(a, kind, dense)
    want = res + (y if b is None else (y.float() + b.float()).to(dtype))
    got = res.clone()
    partials = torch.full((4, 32, N), float("nan"))  # garbage a split must overwrite, never read
    tickets = torch.zeros(8, dtype=torch.int32)
    add_projection(a, weight, b, got, partials, tickets, n_splits)
    _close(got, want, f"add_projection {dtype} {kind} T={T} splits={n_splits}", 6, _rounded(kind, dtype))
    assert not tickets.any(), "a ticket counter was left non-zero"


def check_gate_up_silu(dtype: torch.dtype, kind: str, T: int) -> None:
    from ringleader.device.step.fused_projections import gate_up_silu

    inter, K = 80, 128
    weight, dense = _weight(kind, 2 * inter, K, dtype, seed=T + 1)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, K, generator=g).to(dtype)
    norm_w = (torch.rand(K, generator=g) + 0.5).to(dtype)
    _, h = ops.add_rms_norm(x, None, norm_w, 1e-5)
    want = ops.silu_mul(_project(h, kind, dense))
    what = f"gate_up_silu {dtype} {kind} T={T}"
    _close(gate_up_silu(x, norm_w, 1e-5, weight), want, what, 8, _rounded(kind, dtype))


def check_qkv_rope_store(dtype: torch.dtype, kind: str, T: int, H: int, KV: int, D: int, bias: bool) -> None:
    from ringleader.device.step.fused_projections import qkv_rope_store

    hidden, PS, n_slots, max_ctx = 128, 4, 3, 24
    weight, dense = _weight(kind, (H + 2 * KV) * D, hidden, dtype, seed=T + H)
    g = torch.Generator().manual_seed(T + D)
    x = torch.randn(T, hidden, generator=g).to(dtype)
    norm_w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    b = (torch.randn((H + 2 * KV) * D, generator=g) * 0.1).to(dtype) if bias else None
    pages = n_slots * max_ctx // PS + 1  # the last is the scratch page
    block_table = torch.randperm(pages - 1, generator=g).to(torch.int32).reshape(n_slots, -1)
    slot_of = torch.randint(0, n_slots, (T,), generator=g, dtype=torch.int32)
    if T > 1:
        slot_of[T // 2] = -1  # a pad row: the scratch page at offset 0
    positions = torch.randint(0, max_ctx + 5, (T,), generator=g, dtype=torch.int32)  # some past the end
    cos, sin = ops.rope_tables(dataclasses.replace(preset_config("tiny"), head_dim=D), 64, dtype, "cpu")
    k_cache = torch.zeros(pages, PS, KV, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    _, h = ops.add_rms_norm(x, None, norm_w, 1e-5)
    qkv = _project(h, kind, dense)
    qkv = qkv if b is None else (qkv.float() + b.float()).to(dtype)
    pos = positions.long().clamp(0, max_ctx - 1)
    # rotated in fp32 from the rounded projection and rounded once, as the kernel does
    q_want, k_want, v_want = ops.rope_split(qkv.float(), cos[pos].float(), sin[pos].float(), KV, D)
    live = slot_of >= 0
    page = block_table[slot_of.long().clamp(min=0), pos // PS].long()
    row = torch.where(live, page * PS + pos % PS, (pages - 1) * PS)
    k_ref, v_ref = k_cache.clone().view(-1, KV, D), v_cache.clone().view(-1, KV, D)
    order = torch.arange(T)  # last writer wins where rows share a cache row (pad rows)
    for t in order.tolist():
        k_ref[row[t]], v_ref[row[t]] = k_want[t].to(dtype), v_want[t].to(dtype)
    q = qkv_rope_store(x, norm_w, 1e-5, weight, b, cos[:max_ctx], sin[:max_ctx], block_table, slot_of,
                       positions, k_cache, v_cache, pages - 1, H, KV)  # fmt: skip
    what = f"qkv_rope_store {dtype} {kind} T={T} H={H} KV={KV} D={D}"
    via = _rounded(kind, dtype)
    _close(q, q_want.to(dtype), what + " q", 8, via)
    live_rows = row[live].unique()
    _close(k_cache.view(-1, KV, D)[live_rows], k_ref[live_rows], what + " k", 8, via)
    _close(v_cache.view(-1, KV, D)[live_rows], v_ref[live_rows], what + " v", 8, via)
    untouched = torch.ones(pages * PS, dtype=torch.bool)
    untouched[row] = False
    assert not k_cache.view(-1, KV, D)[untouched].any(), what + ": a cache row no row names was written"


def check_lm_head_argmax(dtype: torch.dtype, kind: str, T: int, M: int) -> None:
    from ringleader.device.step.fused_projections import lm_head_argmax

    V, K = 700, 128  # 11 tiles of 64, the last partial
    weight, dense = _weight(kind, V, K, dtype, seed=M)
    g = torch.Generator().manual_seed(T * 31 + M)
    x = torch.randn(T, K, generator=g).to(dtype)
    norm_w = (torch.rand(K, generator=g) + 0.5).to(dtype)
    sample_row = torch.randint(0, T, (M,), generator=g, dtype=torch.int32)
    sample_row[-1] = T + 40  # a stale entry: clamped into the bucket
    best = torch.empty(16, 32)
    best_idx = torch.empty(16, 32, dtype=torch.int32)
    ticket = torch.zeros(1, dtype=torch.int32)
    logits, greedy = lm_head_argmax(x, sample_row, T, norm_w, 1e-5, weight, best, best_idx, ticket)
    rows = sample_row.long().clamp(0, T - 1)
    _, h = ops.add_rms_norm(x[rows], None, norm_w, 1e-5)
    want = _project(h, kind, dense).float()
    what = f"lm_head {dtype} {kind} T={T} M={M}"
    _close(logits.to(dtype), want.to(dtype), what, 6, _rounded(kind, dtype))
    assert torch.equal(greedy.long(), logits.argmax(-1)), what + ": argmax"
    assert ticket.item() == 0, what + ": the ticket was left non-zero"


def check_argmax_ties_take_the_first_index() -> None:
    from ringleader.device.step.fused_projections import lm_head_argmax

    V, K = 300, 64
    w = torch.zeros(V, K)
    w[[5, 77, 250], 0] = 1.0  # three equal logits, in three tiles; everything else 0
    w[[3, 130], 1] = 1.0  # row 1's tie inside one tile and across two
    weight = FusedWeight.from_dense(w)
    x = torch.zeros(2, K)
    x[0, 0] = x[1, 1] = 1.0
    best, best_idx = torch.empty(8, 32), torch.empty(8, 32, dtype=torch.int32)
    _, greedy = lm_head_argmax(x, torch.tensor([0, 1], dtype=torch.int32), 2, torch.ones(K), 1e-5, weight,
                               best, best_idx, torch.zeros(1, dtype=torch.int32))  # fmt: skip
    assert greedy.tolist() == [5, 3], greedy


def check_bad_arguments() -> None:
    from ringleader.device.step.fused_projections import add_projection, lm_head_argmax

    weight = FusedWeight.from_dense(torch.randn(64, 128))
    a, res = torch.randn(2, 128), torch.randn(2, 64)
    with pytest.raises(ValueError, match="partials"):
        add_projection(a, weight, None, res, torch.empty(1, 32, 64), torch.zeros(2, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="tickets"):
        add_projection(a, weight, None, res, torch.empty(2, 32, 64), torch.zeros(2, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="input"):
        add_projection(torch.randn(2, 100), weight, None, res, torch.empty(2, 32, 64), torch.zeros(2), 1)
    with pytest.raises(ValueError, match="sample_row"):
        lm_head_argmax(a, torch.zeros(40, dtype=torch.int32), 2, torch.ones(128), 1e-5, weight,
                       torch.empty(1, 32), torch.empty(1, 32, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))  # fmt: skip


def run_interpreted_checks() -> None:
    """Entry point of the child process (TRITON_INTERPRET=1 set before anything imported triton)."""
    from ringleader.device.step import fused_projections as fp
    from tests.test_triton_fused import _interpreter_rounds_bf16_to_nearest
    from tests.test_triton_quant_matmul import _interpreter_dots_bf16

    assert type(fp._add_projection_kernel).__name__ == "InterpretedFunction", "triton imported too early"
    _interpreter_dots_bf16()
    assert _interpreter_rounds_bf16_to_nearest(), "this triton's interpreter has no cast hook"
    t0 = time.perf_counter()
    for dtype in (torch.float32, torch.bfloat16):
        for kind in KINDS:
            if kind == "bf16-weights" and dtype != torch.float32:
                continue  # bf16 weights are kept beside fp32 activations only
            for T in (1, 3, 17, 32):  # each row block: the FMA path, 16- and 32-row dots
                check_add_projection(dtype, kind, T, n_splits=1 if T == 3 else 3, bias=T == 17)
                check_gate_up_silu(dtype, kind, T)
                check_lm_head_argmax(dtype, kind, T, M=min(T, 5) if T > 1 else 1)
            check_qkv_rope_store(dtype, kind, 1, 4, 2, 32, bias=False)
            check_qkv_rope_store(dtype, kind, 9, 4, 2, 32, bias=True)  # 16-wide halves: the dot
            check_qkv_rope_store(dtype, kind, 20, 2, 1, 16, bias=False)  # 8-wide halves: FMA on 32 rows
    check_add_projection(torch.float16, "dense", 5, n_splits=2, bias=True)
    check_argmax_ties_take_the_first_index()
    check_bad_arguments()
    print(f"{MARKER} in {time.perf_counter() - t0:.1f} s")
