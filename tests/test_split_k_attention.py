"""Ragged attention over a paged KV cache: the Triton kernels (single pass and split-K /
flash-decoding) against the reference on the CPU, and the reference against a plain per-slot
computation.

The kernels run under the Triton interpreter, which has to be switched on before triton is
first imported, so those checks run in a child process started with TRITON_INTERPRET=1
(`run_interpreted_checks`); the test skips when triton is not
installed. choose_splits' rule, the paged reference, the launch count (on the meta device,
through triton_launch's LaunchRecorder: split-K is one launch too), the PDL launch option and
the checks on a caller's ticket counters are checked in this process.

Paging is exercised for real: pages handed out in a random order (a slot's pages scattered
over the pool), page sizes below, at and above BLOCK_N (64), contexts ending mid-page, NaN in every
cache cell no row may read (a page's tail past its slot's context, the unallocated pages) and
block-table entries past a slot's context pointing at those NaN pages or out of the pool.
Split-K merges its partials in the kernel, the last split of a (row, kv head) to take a ticket
doing it: every call must leave the ticket counters zero, and a second call on the same
counters (a graph replay) must give the same output bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from ringleader.device.step.triton_attention import (
    DEFAULT_SM_COUNT,
    HAVE_TRITON,
    MAX_SPLITS,
    choose_splits,
    ragged_attention_reference,
)
from ringleader.device.step.triton_launch import LaunchRecorder
from tests.triton_interpreter import run_interpreted_checks_of


def test_split_k_under_interpreter():
    run_interpreted_checks_of("tests.test_split_k_attention", "split-k interpreted checks passed")


# ---- paged caches ------------------------------------------------------------------------------


def _rows(spec):
    """spec: [(slot, first_pos, n_rows)] -> slot_of, positions (int32); slot -1 = pad rows."""
    slot_of, pos = [], []
    for slot, p0, n in spec:
        slot_of += [slot] * n
        pos += [0] * n if slot < 0 else list(range(p0, p0 + n))
    return torch.tensor(slot_of, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)


def slot_lengths(slot_of, positions, n_slots):
    """Each slot's context length: one past its rows' last position (0 for a slot with none)."""
    ends = [0] * n_slots
    for s, p in zip(slot_of.tolist(), positions.tolist()):
        if s >= 0:
            ends[s] = max(ends[s], p + 1)
    return ends


def random_block_table(lengths, pages_per_slot, page_size, n_pages, gen, dtype=torch.int32):
    """[len(lengths), pages_per_slot] block table over a pool of n_pages: each slot's pages drawn
    from a random permutation of the pool, and every entry past a slot's context garbage (a page
    no slot owns, or an id outside the pool). Returns the table (a column slice of a wider one,
    so its row stride is not pages_per_slot) and the pages no slot owns."""
    n_slots = len(lengths)
    perm = torch.randperm(n_pages, generator=gen)
    owned = perm[: n_slots * pages_per_slot].view(n_slots, pages_per_slot)
    spare = perm[n_slots * pages_per_slot :]
    assert spare.numel() >= 1, "the pool needs a page no slot owns"
    wide = torch.full((n_slots, pages_per_slot + 3), -1, dtype=torch.int64)
    wide[:, :pages_per_slot] = owned
    for s, length in enumerate(lengths):
        past = torch.arange(pages_per_slot + 3) >= -(-length // page_size)
        garbage = spare[torch.randint(spare.numel(), (pages_per_slot + 3,), generator=gen)]
        garbage[::3] = n_pages + 1000  # out of the pool: reading it would fault or read junk
        wide[s, past] = garbage[past]
    return wide.to(dtype)[:, :pages_per_slot], spare


def paged_copy(contiguous, block_table, lengths, n_pages):
    """contiguous [S, max_ctx, ...] -> pages [n_pages, PS, ...] holding each slot's first
    lengths[s] positions where the block table puts them; NaN everywhere else."""
    S, max_ctx = contiguous.shape[:2]
    page_size = max_ctx // block_table.shape[1]
    pages = torch.full((n_pages, page_size, *contiguous.shape[2:]), float("nan"), dtype=contiguous.dtype)
    for s in range(S):
        for p in range(lengths[s]):
            pages[block_table[s, p // page_size], p % page_size] = contiguous[s, p]
    return pages


def contiguous_attention(q, k, v, slot_of, positions, scale):
    """q [T, H, D]; k/v [S, C, KV, D] per-slot contiguous caches: row by row, in fp64."""
    T, H, D = q.shape
    G = H // k.shape[2]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        s, p = int(slot_of[t]), int(positions[t])
        if s < 0:
            continue
        kt = k[s, : p + 1].double().repeat_interleave(G, dim=1)  # [n, H, D]
        vt = v[s, : p + 1].double().repeat_interleave(G, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[t].double(), kt) * scale, dim=-1)
        out[t] = torch.einsum("hn,nhd->hd", weights, vt)
    return out


def test_paged_reference_is_the_contiguous_computation():
    """Contiguous per-slot caches scattered into shuffled pages: the paged reference gives what
    the plain per-slot computation gives, at page sizes below, at and above a row's length."""
    for page_size in (1, 4, 16, 64):
        gen = torch.Generator().manual_seed(page_size)
        H, KV, D, n_slots, max_ctx = 6, 2, 8, 4, 64
        slot_of, positions = _rows([(0, 0, 1), (1, 17, 3), (-1, 0, 1), (2, 63, 1), (3, 30, 1), (-1, 0, 2)])
        lengths = slot_lengths(slot_of, positions, n_slots)
        pages_per_slot = max_ctx // page_size
        n_pages = n_slots * pages_per_slot + 3
        table, _ = random_block_table(lengths, pages_per_slot, page_size, n_pages, gen)
        k = torch.randn(n_slots, max_ctx, KV, D, generator=gen)
        v = torch.randn(n_slots, max_ctx, KV, D, generator=gen)
        q = torch.randn(slot_of.shape[0], H, D, generator=gen)
        k_pages = paged_copy(k, table, lengths, n_pages)
        v_pages = paged_copy(v, table, lengths, n_pages)
        got = ragged_attention_reference(q, k_pages, v_pages, table, slot_of, positions, D**-0.5)
        want = contiguous_attention(q, k, v, slot_of, positions, D**-0.5)
        assert got.dtype == q.dtype and not got.isnan().any(), page_size
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=f"page size {page_size}")
        assert torch.all(got[slot_of < 0] == 0)


# ---- the kernels, in the child process --------------------------------------------------------

CTX = 320  # 5 blocks of BLOCK_N = 64; a case's max_ctx is this rounded up to whole pages


class Case(NamedTuple):
    n_heads: int
    n_kv: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    splits: tuple[int, ...]
    layout: str = "contiguous"  # or "transposed": pages stored [P, KV, PS, D], viewed [P, PS, KV, D]
    table_dtype: torch.dtype = torch.int32


# GQA groups 1, 3, 4, 8, 16; page sizes 1 to 256 around BLOCK_N = 64 (the interpreter runs
# ~10 ms a program: keep the grids small); 8 splits is more than the 5 blocks of a full row
CASES = [
    Case(2, 2, 16, 16, torch.float32, (1, 2, 3, 4, 8)),
    Case(8, 2, 32, 64, torch.float32, (1, 2, 3, 4, 8), table_dtype=torch.int64),
    Case(16, 2, 64, 128, torch.float32, (1, 2, 3, 4, 8)),
    Case(2, 2, 16, 1, torch.float32, (1, 3)),
    # the single-pass kernel alone: MHA, a head_dim not a power of two, a group of 16
    Case(4, 4, 16, 8, torch.float32, (1,)),
    Case(6, 2, 24, 16, torch.float32, (1,), layout="transposed"),
    Case(16, 1, 64, 256, torch.float32, (1,)),
    # the GPU runs bf16, but the interpreter's tl.dot mishandles bf16 (numpy has no bf16);
    # fp16 takes the same low-precision path (p cast to v's dtype, cast on store)
    Case(16, 2, 64, 16, torch.float16, (1, 3)),
    Case(8, 2, 32, 64, torch.float16, (8,)),
    Case(8, 2, 64, 128, torch.float16, (1,), layout="transposed"),
]


def rows_for(max_ctx):
    """(slot, first position, n_rows); slot -1 = pad rows."""
    return [
        (0, 0, 1),  # first token of a request: one position, every other split empty
        (1, 63, 1),
        (2, 64, 1),  # either side of a BLOCK_N boundary
        (-1, 0, 1),  # a pad row in the middle
        (3, 299, 1),  # a long decode row, ending mid-page for every page size > 4
        (4, 125, 5),  # prefill chunk crossing a block boundary
        (5, max_ctx - 1, 1),  # the last position
        (1, 191, 1),  # a second row of slot 1, at a block's last column
        (-1, 0, 2),  # bucket padding at the end
    ]


def run_interpreted_checks() -> None:
    """Entry point of the child process (TRITON_INTERPRET=1 set before anything imported triton)."""
    from ringleader.device.step import triton_attention as ta

    assert ta.triton_interpreted(), "triton was imported before TRITON_INTERPRET=1 took effect"
    check_pdl_is_off_when_interpreted(ta.ragged_attention_triton, make_inputs(CASES[0]))
    for case in CASES:
        inputs = make_inputs(case)
        single = None
        for n_splits in case.splits:
            got = check_matches_reference(ta.ragged_attention_triton, inputs, n_splits)
            if n_splits == 1:
                single = got
            elif single is not None:  # split-K against the single launch, as tight
                torch.testing.assert_close(got, single, **_tolerance(got.dtype), msg=f"{case}, {n_splits}")
    print("split-k interpreted checks passed")


def make_inputs(case: Case):
    """Inputs, the reference output, and paged caches NaN wherever no row may read."""
    gen = torch.Generator().manual_seed(case.n_heads * 1000 + case.head_dim * 10 + case.page_size)
    n_slots = 7  # slot 6 has no rows: its block-table row is all garbage
    pages_per_slot = -(-CTX // case.page_size)
    max_ctx = pages_per_slot * case.page_size
    slot_of, positions = _rows(rows_for(max_ctx))
    lengths = slot_lengths(slot_of, positions, n_slots)
    n_pages = n_slots * pages_per_slot + 2
    table, spare = random_block_table(lengths, pages_per_slot, case.page_size, n_pages, gen, case.table_dtype)
    shape = (n_pages, case.page_size, case.n_kv, case.head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(slot_of.shape[0], case.n_heads, case.head_dim, generator=gen).to(case.dtype)
    # NaN in every cell no row reads: unowned pages, and each slot's pages past its context
    readable = torch.zeros(n_pages, case.page_size, dtype=torch.bool)
    for s, length in enumerate(lengths):
        for p in range(length):
            readable[table[s, p // case.page_size], p % case.page_size] = True
    assert not readable[spare].any()
    k, v = (x.masked_fill(~readable[:, :, None, None], float("nan")).to(case.dtype) for x in (k, v))
    if case.layout == "transposed":
        k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    scale = case.head_dim**-0.5
    ref = ragged_attention_reference(q, k, v, table, slot_of, positions, scale)
    assert not ref.isnan().any(), "the reference read a cell no row may read"
    return dict(
        case=case, q=q, k=k, v=v, table=table, slot_of=slot_of, positions=positions, scale=scale, ref=ref
    )


def _tolerance(dtype):
    return dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-3, rtol=1e-2)


def check_matches_reference(attention, inputs, n_splits):
    q, slot_of, table, k = inputs["q"], inputs["slot_of"], inputs["table"], inputs["k"]
    T, H, D = q.shape
    msg = f"{inputs['case']}, n_splits={n_splits}"
    # more counters than the T * n_kv_heads used: the spare ones must stay untouched (zero)
    tickets = torch.zeros(T * k.shape[2] + 3, dtype=torch.int32)

    def call():
        # a strided output prefilled with NaN: every element (pad rows too) must be written
        out = torch.full((T, H, 2 * D), float("nan"), dtype=q.dtype)[..., :D]
        got = attention(
            q,
            k,
            inputs["v"],
            table,
            slot_of,
            inputs["positions"],
            inputs["scale"],
            out=out,
            n_splits=n_splits,
            tickets=tickets,
        )
        assert got.data_ptr() == out.data_ptr() and got.dtype == q.dtype
        # every (row, kv head) merged once (short rows' empty splits took their tickets too)
        assert torch.all(tickets == 0), f"{msg}: tickets left {tickets.tolist()}"
        return got

    got = call()
    if n_splits > 1:  # a replay on the same counters: the same merge, bit for bit
        assert torch.equal(call(), got), msg
    torch.testing.assert_close(got, inputs["ref"], **_tolerance(q.dtype), msg=lambda m: f"{msg}: {m}")
    assert torch.all(got[slot_of < 0] == 0), msg
    # a decode row over one cached position returns that position's v (GQA mapping), whatever
    # the number of empty splits beside it
    expect = inputs["v"][table[0, 0].long(), 0].repeat_interleave(H // k.shape[2], dim=0)
    torch.testing.assert_close(got[0], expect, atol=1e-6, rtol=1e-6, msg=msg)
    return got


def check_pdl_is_off_when_interpreted(attention, inputs):
    """use_pdl=True under the interpreter (which has no griddepcontrol) runs without it."""
    args = [inputs[name] for name in ("q", "k", "v", "table", "slot_of", "positions", "scale")]
    for n_splits in (1, 2):
        got = attention(*args, n_splits=n_splits, use_pdl=True)
        torch.testing.assert_close(got, inputs["ref"], **_tolerance(got.dtype))


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


def _meta_inputs(T=3, H=32, KV=8, D=128, S=5, max_ctx=4096, page_size=16, n_pages=None):
    """q, k/v pages, block table, slot_of, positions on the meta device; the pool defaults to
    every slot's pages."""
    meta = dict(device="meta")
    pages_per_slot = max_ctx // page_size
    n_pages = S * pages_per_slot if n_pages is None else n_pages
    q = torch.empty(T, H, D, dtype=torch.bfloat16, **meta)
    k = torch.empty(n_pages, page_size, KV, D, dtype=torch.bfloat16, **meta)
    table = torch.empty(S, pages_per_slot, dtype=torch.int32, **meta)
    slot_of = torch.empty(T, dtype=torch.int32, **meta)
    return q, k, torch.empty_like(k), table, slot_of, torch.empty_like(slot_of)


@pytest.mark.parametrize(
    ("n_splits", "kernels"),
    [
        (4, {"_ragged_attention_split_kernel": 1}),  # the splits merged in the same launch
        (None, {"_ragged_attention_split_kernel": 1}),  # 3 x 8 programs
        (1, {"_ragged_attention_kernel": 1}),
    ],
)
def test_launches_recorded_on_meta_tensors(n_splits, kernels):
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.step.triton_attention import ragged_attention_triton

    q, k, v, table, slot_of, positions = _meta_inputs()
    with LaunchRecorder() as rec:
        out = ragged_attention_triton(q, k, v, table, slot_of, positions, 0.1, n_splits=n_splits)
    assert dict(rec.counts) == kernels
    assert out.shape == q.shape and out.device.type == "meta"


def test_auto_splits_on_a_full_bucket_is_the_single_launch():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.step.triton_attention import ragged_attention_triton

    T = -(-DEFAULT_SM_COUNT // 8)  # T x 8 kv heads programs fill the SMs on their own
    q, k, v, table, slot_of, positions = _meta_inputs(T=T)
    with LaunchRecorder() as rec:
        ragged_attention_triton(q, k, v, table, slot_of, positions, 0.1)
    assert dict(rec.counts) == {"_ragged_attention_kernel": 1}


@pytest.mark.parametrize(("max_ctx", "page_size"), [(128, 16), (128, 128), (4096, 16), (4096, 256)])
def test_auto_splits_plan_for_the_block_tables_reach(max_ctx, page_size):
    """choose_splits sees max_ctx = pages per slot * page size, not the pool's size."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.step.triton_attention import launch_config, ragged_attention_triton

    seen = []
    q, k, v, table, slot_of, positions = _meta_inputs(T=1, max_ctx=max_ctx, page_size=page_size, n_pages=4096)
    with LaunchRecorder(on_launch=seen.append) as rec:
        ragged_attention_triton(q, k, v, table, slot_of, positions, 0.1)
    want = choose_splits(1, max_ctx, 8, DEFAULT_SM_COUNT, launch_config(4, 128, q.dtype)["BLOCK_N"])
    if want == 1:
        assert dict(rec.counts) == {"_ragged_attention_kernel": 1}
    else:
        assert seen[0].grid == (1, 8, want)
    assert (want == 1) == (max_ctx == 128)
    assert all(launch_.meta.get("PAGE_SIZE", page_size) == page_size for launch_ in seen)


def test_rejects_zero_splits():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.step.triton_attention import ragged_attention_triton

    with pytest.raises(ValueError, match="n_splits"):
        ragged_attention_triton(*_meta_inputs(), 0.1, n_splits=0)


def test_rejects_a_page_size_not_a_power_of_two():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.step.triton_attention import ragged_attention_triton

    q, k, v, _, slot_of, positions = _meta_inputs(max_ctx=4800, page_size=48)
    table = torch.empty(5, 100, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="power of two"):
        ragged_attention_triton(q, k, v, table, slot_of, positions, 0.1)


@pytest.mark.parametrize("n_splits", [1, 4])
@pytest.mark.parametrize("use_pdl", [None, False, True])
def test_pdl_is_a_constexpr_and_a_launch_option(n_splits, use_pdl):
    """None: pdl_supported(q.device), never on the meta device; True/False as asked (the AOT
    walk compiles both)."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.step.triton_attention import ragged_attention_triton

    seen = []
    with LaunchRecorder(on_launch=seen.append):
        ragged_attention_triton(*_meta_inputs(), 0.1, n_splits=n_splits, use_pdl=use_pdl)
    [launched] = seen
    assert launched.meta["USE_PDL"] is launched.meta["launch_pdl"] is bool(use_pdl)


def test_split_k_counts_on_the_callers_tickets():
    """The step's counters (allocated once) are the ones the launch counts on."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.step.triton_attention import ragged_attention_triton

    tickets = torch.zeros(3 * 8, dtype=torch.int32, device="meta")
    seen = []
    with LaunchRecorder(on_launch=seen.append):
        ragged_attention_triton(*_meta_inputs(), 0.1, n_splits=4, tickets=tickets)
    [launched] = seen
    assert launched.grid == (3, 8, 4) and launched.meta["BLOCK_S"] == 4
    assert sum(arg is tickets for arg in launched.args) == 1


@pytest.mark.parametrize(
    ("tickets", "match"),
    [
        (torch.zeros(24, dtype=torch.int64, device="meta"), "tickets must be int32"),
        (torch.zeros(23, dtype=torch.int32, device="meta"), r"23 counters, fewer than T \* n_kv_heads = 24"),
        (torch.zeros(24, 2, dtype=torch.int32, device="meta")[:, 0], "tickets must be contiguous"),
        (torch.zeros(24, dtype=torch.int32), "tickets must be on q's device meta"),
    ],
)
def test_rejects_bad_tickets(tickets, match):
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.step.triton_attention import ragged_attention_triton

    for n_splits in (1, 4):  # checked whether or not this launch splits: the buffer is the step's
        with pytest.raises(ValueError, match=match):
            ragged_attention_triton(*_meta_inputs(), 0.1, n_splits=n_splits, tickets=tickets)


@pytest.mark.parametrize(("arch", "use_pdl"), [(90, True), (80, False)])
def test_kernels_compile_ahead_of_time_without_spills(arch, use_pdl):
    """The interpreter runs the kernels' Python, not Triton's compiler (it let a loop-carried
    variable change shape): both kernels compiled for a real arch, griddepcontrol only with PDL."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.bench.lab.triton_compile import compile_specialization
    from ringleader.bench.lab.triton_specializations import Specializer
    from ringleader.device.step.triton_attention import ragged_attention_triton

    seen = []
    with LaunchRecorder(on_launch=seen.append):
        for n_splits in (1, 8):
            ragged_attention_triton(*_meta_inputs(T=1), 0.1, n_splits=n_splits, use_pdl=use_pdl)
    specializer = Specializer(arch)
    for launched in seen:
        spec = specializer.derive(launched)
        assert (
            spec.options["launch_pdl"] is use_pdl
            and spec.constexprs[(list(spec.signature).index("USE_PDL"),)] is use_pdl
        )
        result = compile_specialization(spec)
        assert result["ok"] and result["spills"] == 0, (spec.kernel, result)
