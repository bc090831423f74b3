"""Ragged causal attention over a paged KV cache, as graph-capturable Triton launches.

Paged cache: one layer's k/v_cache is a pool of pages [P, PS, KV, D] (P pages of PS token
positions, PS a power of two) and the int32 block table [n_slots, M] maps slot s's position p
to k_cache[block_table[s, p // PS], p % PS]. A row reaches at most max_ctx = M * PS positions;
block-table entries past a row's context are never read (they may be unallocated garbage).

Each of the T rows (a decode token or one row of a prefill chunk) attends over its own slot's
cache positions [0, positions[row]] (its own k/v are already written there). A program handles
one (row, kv head) and the q_per_kv query heads sharing that kv head together (GQA), walking
the slot's context in BLOCK_N column blocks only up to the row's own context end with an
online softmax in fp32, so the cost follows each row's real context and not max_ctx. Each
block looks its columns' pages up in the slot's block-table row; BLOCK_N does not depend on
PS, so a block may span several pages (PS < BLOCK_N) or a page several blocks.

Split-K (flash-decoding): a few rows give only T * n_kv_heads programs, far fewer than the
GPU's SMs, so a long decode would run on a handful of them. With n_splits > 1 the grid is
(T, n_kv_heads, n_splits) and each row's context is cut into n_splits chunks. The chunk length
is computed on the device from the row's own length (ceil(n_ctx / n_splits) rounded up to a
multiple of BLOCK_N), so a short row's trailing splits are empty. Every split program writes
its unnormalised partial (acc [G, D], running max m, sum l; fp32) to scratch and takes a
ticket on its (row, kv head)'s int32 counter (acq_rel atomic); the program drawing the last
ticket resets the counter to 0 and merges the n_splits partials in split order (whatever the
arrival order) with a log-sum-exp rescale, one query head at a time. So split-K is one launch
too; the counters (`tickets`, T * n_kv_heads, zero) are left zero by every launch, so the step
allocates them once and every replay reuses them. Both kernels share the online softmax
(`_attend_span`); `choose_splits` picks n_splits from the bucket's static sizes.

Programmatic dependent launch (USE_PDL, sm_90+, triton_launch.pdl_supported): a program waits
(`gdc_wait`) before its first read (rows, block table, q, cache: all written by earlier
kernels), then lets the next kernel launch at once; that kernel waits for this one's end before
reading o, and only its weight prefetch overlaps.

Everything a launch depends on is static: the grids come from T (the bucket size) and static
sizes, loop bounds and pages are read on the device, and pad rows (slot_of < 0) run zero
iterations, read no cache nor block table and write zeros. So the launches can be captured
once per bucket in a CUDA graph. Nothing syncs with the host; the first call for a dtype /
head shape / page size / n_splits / USE_PDL compiles (do it before capturing). Every launch
goes through `triton_launch.launch`, so a step walked on the meta device can count them.

`ragged_attention_reference` is the same function in plain torch (each row's pages gathered
and masked over max_ctx): the CPU path and the reference in tests.

Under TRITON_INTERPRET=1 (set before this module is imported) the kernels run on CPU tensors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from ringleader.device.step.triton_launch import launch, pdl_meta, pdl_supported

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference still works
    triton = None
    tl = None

HAVE_TRITON = triton is not None

# an H100 SXM: what choose_splits plans for when q is not on a GPU (meta-device counts, tests)
DEFAULT_SM_COUNT = 132
MAX_SPLITS = 32
LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e))


def ragged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    slot_of: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D]; k/v_cache [P, PS, KV, D] pages; block_table [S, M]; slot_of/positions [T]
    -> o [T, H, D] (q.dtype).

    Static shapes only (each row's M pages gathered, a [T, M * PS] mask), so it is capturable
    too, but it gathers T full-length contexts: meant for the CPU and for tests, not for speed.
    """
    T, H, D = q.shape
    PS, KV = k_cache.shape[1], k_cache.shape[2]
    M = block_table.shape[1]
    G = H // KV
    live = slot_of >= 0
    slot = torch.where(live, slot_of, torch.zeros_like(slot_of)).long()
    pos = positions.long()
    # entries past a row's last page may be garbage: never index with them, gather page 0 there
    used = (torch.arange(M, device=q.device)[None, :] <= pos[:, None] // PS) & live[:, None]
    pages = torch.where(used, block_table.index_select(0, slot).long(), 0)  # [T, M]
    k = k_cache[pages].reshape(T, M * PS, KV, D).float()
    v = v_cache[pages].reshape(T, M * PS, KV, D).float()
    cols = torch.arange(M * PS, device=q.device)
    allowed = (cols[None, :] <= pos[:, None]) & live[:, None]  # [T, M * PS]
    # pad rows get one finite column so softmax stays finite; their output is zeroed below
    allowed = allowed | (~live[:, None] & (cols[None, :] == 0))
    # masked cells may hold anything (a page's stale tail, NaN): p = 0 must not meet them
    v = v.masked_fill(~allowed[:, :, None, None], 0.0)
    scores = torch.einsum("tkgd,tckd->tkgc", q.float().view(T, KV, G, D), k) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    out = torch.einsum("tkgc,tckd->tkgd", torch.softmax(scores, dim=-1), v).reshape(T, H, D)
    return torch.where(live[:, None, None], out, torch.zeros_like(out)).to(q.dtype)


if HAVE_TRITON:

    @triton.jit
    def _attend_span(
        q,
        k_base,
        v_base,
        bt_row,
        stride_bt_m,
        stride_kp,
        stride_kn,
        stride_kd,
        stride_vp,
        stride_vn,
        stride_vd,
        lo,
        hi,
        scale_log2e,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Online softmax of q [BLOCK_G, BLOCK_D] over context columns [lo, hi), column c read
        from page bt_row[c // PAGE_SIZE] at offset c % PAGE_SIZE: the unnormalised acc, the
        running max m (log2 units; -inf for an empty span) and the sum l."""
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        d_ok = offs_d < HEAD_DIM
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            cols = start + offs_n
            c_ok = cols < hi
            # only the row's own pages: entries past its context may be garbage
            page = tl.load(bt_row + (cols // PAGE_SIZE) * stride_bt_m, mask=c_ok, other=0).to(tl.int64)
            in_page = (cols % PAGE_SIZE).to(tl.int64)
            k_cols = page * stride_kp + in_page * stride_kn
            v_cols = page * stride_vp + in_page * stride_vn
            kt = tl.load(  # [BLOCK_D, BLOCK_N]: k transposed by addressing
                k_base + k_cols[None, :] + offs_d[:, None] * stride_kd,
                mask=d_ok[:, None] & c_ok[None, :],
                other=0.0,
            )
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale_log2e
            s = tl.where(c_ok[None, :], s, float("-inf"))
            # every block holds >= 1 valid column (start < hi), so m_new is finite
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_base + v_cols[:, None] + offs_d[None, :] * stride_vd,
                mask=c_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _row_context(
        slot_ptr, pos_ptr, bt_ptr, stride_slot, stride_pos, stride_bt_s, max_ctx, USE_PDL: tl.constexpr
    ):
        """The program's row: its context length (0 for a pad row, so it reads no cache nor block
        table at all), whether it is live, and its block-table row."""
        if USE_PDL:
            # rows, block table, q and cache were all written by earlier kernels: wait for them
            tl.extra.cuda.gdc_wait()
            # the next kernel waits for our end before it reads o: it may start prefetching now
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + row * stride_slot)
        pos = tl.load(pos_ptr + row * stride_pos)
        live = slot >= 0
        n_ctx = tl.where(live, tl.minimum(pos + 1, max_ctx), 0)
        return n_ctx, live, bt_ptr + tl.where(live, slot, 0).to(tl.int64) * stride_bt_s

    @triton.jit
    def _ragged_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        bt_ptr,
        slot_ptr,
        pos_ptr,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kp,
        stride_kn,
        stride_kh,
        stride_kd,
        stride_vp,
        stride_vn,
        stride_vh,
        stride_vd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_bt_s,
        stride_bt_m,
        stride_slot,
        stride_pos,
        max_ctx,
        scale_log2e,
        Q_PER_KV: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """One program per (row, kv head) over the whole context: writes the normalised output."""
        n_ctx, live, bt_row = _row_context(
            slot_ptr, pos_ptr, bt_ptr, stride_slot, stride_pos, stride_bt_s, max_ctx, USE_PDL
        )
        row = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kvh * Q_PER_KV + offs_g
        gd_ok = (offs_g < Q_PER_KV)[:, None] & (offs_d < HEAD_DIM)[None, :]
        q = tl.load(
            q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=gd_ok,
            other=0.0,
        )
        acc, m_i, l_i = _attend_span(
            q,
            k_ptr + kvh * stride_kh,
            v_ptr + kvh * stride_vh,
            bt_row,
            stride_bt_m,
            stride_kp,
            stride_kn,
            stride_kd,
            stride_vp,
            stride_vn,
            stride_vd,
            0,
            n_ctx,
            scale_log2e,
            BLOCK_G,
            BLOCK_D,
            BLOCK_N,
            HEAD_DIM,
            PAGE_SIZE,
            DOT_PRECISION,
        )
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # pad rows: 0 / 1
        tl.store(
            o_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(o_ptr.dtype.element_ty),
            mask=gd_ok,
        )

    @triton.jit
    def _ragged_attention_split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        acc_ptr,
        m_ptr,
        l_ptr,
        ticket_ptr,
        bt_ptr,
        slot_ptr,
        pos_ptr,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kp,
        stride_kn,
        stride_kh,
        stride_kd,
        stride_vp,
        stride_vn,
        stride_vh,
        stride_vd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_at,
        stride_ah,
        stride_as,
        stride_ad,
        stride_mt,
        stride_mh,
        stride_ms,
        stride_bt_s,
        stride_bt_m,
        stride_slot,
        stride_pos,
        max_ctx,
        n_splits,
        scale_log2e,
        Q_PER_KV: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_S: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """One program per (row, kv head, split) over that split's chunk of the row's context:
        writes the partial acc / m / l (an empty split: acc = 0, m = -inf, l = 0); the last of
        the row's splits to finish merges all n_splits partials into o."""
        n_ctx, live, bt_row = _row_context(
            slot_ptr, pos_ptr, bt_ptr, stride_slot, stride_pos, stride_bt_s, max_ctx, USE_PDL
        )
        row = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        # the chunk follows the row's own length, block-aligned so splits never share a block
        chunk = tl.cdiv(tl.cdiv(n_ctx, n_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n_ctx)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kvh * Q_PER_KV + offs_g
        g_ok = offs_g < Q_PER_KV
        d_ok = offs_d < HEAD_DIM
        gd_ok = g_ok[:, None] & d_ok[None, :]
        q = tl.load(
            q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=gd_ok,
            other=0.0,
        )
        acc, m_i, l_i = _attend_span(
            q,
            k_ptr + kvh * stride_kh,
            v_ptr + kvh * stride_vh,
            bt_row,
            stride_bt_m,
            stride_kp,
            stride_kn,
            stride_kd,
            stride_vp,
            stride_vn,
            stride_vd,
            lo,
            hi,
            scale_log2e,
            BLOCK_G,
            BLOCK_D,
            BLOCK_N,
            HEAD_DIM,
            PAGE_SIZE,
            DOT_PRECISION,
        )
        stats = row * stride_mt + heads * stride_mh + split * stride_ms
        tl.store(m_ptr + stats, m_i, mask=g_ok)
        tl.store(l_ptr + stats, l_i, mask=g_ok)
        acc_at = row * stride_at + heads[:, None] * stride_ah + offs_d[None, :] * stride_ad
        tl.store(acc_ptr + acc_at + split * stride_as, acc, mask=gd_ok)

        # every thread's partial stores come before the ticket's release
        tl.debug_barrier()
        counter = ticket_ptr + row * tl.num_programs(1) + kvh
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == n_splits - 1:  # the row's other splits have all written their partials
            tl.store(counter, 0)  # zero again for the next launch (a graph replay)
            offs_s = tl.arange(0, BLOCK_S)
            # pad rows mask off every load: they read no scratch and come out as 0 / 1 = 0
            s_ok = offs_s < tl.where(live, n_splits, 0)
            for g in range(Q_PER_KV):  # one query head at a time: [BLOCK_S, BLOCK_D] in registers
                head = kvh * Q_PER_KV + g
                head_stats = row * stride_mt + head * stride_mh + offs_s * stride_ms
                # .cg: from L2, where the other programs' partials are, never a stale L1 line
                split_max = tl.load(m_ptr + head_stats, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
                split_sum = tl.load(l_ptr + head_stats, mask=s_ok, other=0.0, cache_modifier=".cg")
                partials = tl.load(
                    acc_ptr
                    + row * stride_at
                    + head * stride_ah
                    + offs_s[:, None] * stride_as
                    + offs_d[None, :] * stride_ad,
                    mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )
                m_max = tl.max(split_max, axis=0)
                # a pad row has no finite m: measure from 0 there, so no -inf - -inf = nan
                m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
                weight = tl.exp2(split_max - m_max)  # empty splits (m = -inf) weigh 0
                l_sum = tl.sum(weight * split_sum, axis=0)
                out = tl.sum(weight[:, None] * partials, axis=0) / tl.where(l_sum > 0, l_sum, 1.0)
                tl.store(
                    o_ptr + row * stride_ot + head * stride_oh + offs_d * stride_od,
                    out.to(o_ptr.dtype.element_ty),
                    mask=d_ok,
                )


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_config(q_per_kv: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Compile-time block sizes: tl.dot wants every dimension >= 16 (query heads are padded)."""
    block_d = max(16, _next_pow2(head_dim))
    return dict(
        BLOCK_G=max(16, _next_pow2(q_per_kv)),
        BLOCK_D=block_d,
        BLOCK_N=64 if block_d <= 128 else 32,
        # fp32 is the test dtype: keep it exact instead of tf32 (ignored for bf16/fp16)
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=4,
    )


def choose_splits(n_rows: int, max_ctx: int, n_kv_heads: int, n_sms: int, block_n: int = 64) -> int:
    """n_splits for a bucket, from static sizes only (the same answer at every replay).

    Rule: 1 when n_rows * n_kv_heads programs already fill the SMs or max_ctx <= 2 * block_n;
    else enough splits for about two waves, ceil(2 * n_sms / (n_rows * n_kv_heads)), capped at
    MAX_SPLITS and at the ceil(max_ctx / block_n) blocks a full-length row has.
    """
    programs = n_rows * n_kv_heads
    if programs >= n_sms or max_ctx <= 2 * block_n:
        return 1
    two_waves = -(-2 * n_sms // max(programs, 1))
    return max(1, min(two_waves, MAX_SPLITS, -(-max_ctx // block_n)))


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_planned_sm_count: int | None = None  # set by planning_for_sms: the GPU a meta-device walk plans for


@contextlib.contextmanager
def planning_for_sms(n_sms: int) -> Iterator[None]:
    """While inside, a step off the GPU (the meta device) plans split-K for a GPU of `n_sms` SMs
    instead of DEFAULT_SM_COUNT (bench/lab/triton_aot walks the step for each arch's GPUs)."""
    global _planned_sm_count
    saved, _planned_sm_count = _planned_sm_count, n_sms
    try:
        yield
    finally:
        _planned_sm_count = saved


def sm_count(device: torch.device) -> int:
    """The SMs choose_splits plans for: the GPU's own, else the planned or DEFAULT_SM_COUNT."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return _planned_sm_count or DEFAULT_SM_COUNT


def _check_tickets(tickets: torch.Tensor, n_counters: int, device: torch.device) -> None:
    """ValueError naming what is wrong with a caller's ticket counters (their zeros are trusted:
    checking them would sync with the device)."""
    if tickets.dtype != torch.int32:
        raise ValueError(f"tickets must be int32, got {tickets.dtype}")
    if tickets.numel() < n_counters:
        raise ValueError(
            f"tickets holds {tickets.numel()} counters, fewer than T * n_kv_heads = {n_counters}"
        )
    if not tickets.is_contiguous():
        raise ValueError(f"tickets must be contiguous, got strides {tickets.stride()}")
    if tickets.device != device:
        raise ValueError(f"tickets must be on q's device {device}, got {tickets.device}")


def ragged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    slot_of: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    n_splits: int | None = None,
    tickets: torch.Tensor | None = None,
    use_pdl: bool | None = None,
) -> torch.Tensor:
    """Same contract as ragged_attention_reference; block_table, slot_of and positions int32
    (or int64); the page size k_cache.shape[1] a power of two. One launch at every n_splits.

    n_splits: 1 = whole contexts, no scratch; > 1 = split-K (fp32 scratch, merged in-kernel);
    None = choose_splits(T, M * PS, n_kv_heads, the device's SMs).
    tickets: split-K's counters, int32, >= T * n_kv_heads elements, all zero; every launch
    leaves them zero, so a step allocates them once (None: zeros allocated here, eager use).
    use_pdl: programmatic dependent launch; None = pdl_supported(q.device). Never when
    interpreted.
    """
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; use attention='torch'")
    T, H, D = q.shape
    _, PS, KV, Dk = k_cache.shape
    if H % KV or Dk != D or v_cache.shape != k_cache.shape or block_table.dim() != 2:
        raise ValueError(
            f"shapes: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}, "
            f"block table {tuple(block_table.shape)}"
        )
    if PS & (PS - 1):
        raise ValueError(f"the page size must be a power of two, got {PS}")
    if tickets is not None:
        _check_tickets(tickets, T * KV, q.device)
    max_ctx = block_table.shape[1] * PS
    o = torch.empty_like(q) if out is None else out
    cfg = launch_config(H // KV, D, q.dtype)
    if n_splits is None:
        n_splits = choose_splits(T, max_ctx, KV, sm_count(q.device), block_n=cfg["BLOCK_N"])
    if n_splits < 1:
        raise ValueError(f"n_splits must be >= 1, got {n_splits}")
    use_pdl = pdl_supported(q.device) if use_pdl is None else use_pdl
    # the interpreter has no griddepcontrol
    meta = dict(
        Q_PER_KV=H // KV, HEAD_DIM=D, PAGE_SIZE=PS, **cfg, **pdl_meta(use_pdl and not triton_interpreted())
    )
    tensors = (q, k_cache, v_cache, o)
    strides = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *o.stride())
    row_tensors = (block_table, slot_of, positions)
    row_args = (*block_table.stride(), slot_of.stride(0), positions.stride(0), max_ctx)
    scale_log2e = float(scale) * LOG2E
    if n_splits == 1:
        launch(
            _ragged_attention_kernel,
            (T, KV),
            *tensors,
            *row_tensors,
            *strides,
            *row_args,
            scale_log2e,
            **meta,
        )
        return o

    # per (row, query head, split): unnormalised acc, running max (log2 units) and sum
    part_acc = torch.empty((T, H, n_splits, D), dtype=torch.float32, device=q.device)
    part_m = torch.empty((T, H, n_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    if tickets is None:
        tickets = torch.zeros(T * KV, dtype=torch.int32, device=q.device)
    launch(
        _ragged_attention_split_kernel,
        (T, KV, n_splits),
        *tensors,
        part_acc,
        part_m,
        part_l,
        tickets,
        *row_tensors,
        *strides,
        *part_acc.stride(),
        *part_m.stride(),
        *row_args,
        n_splits,
        scale_log2e,
        BLOCK_S=_next_pow2(n_splits),
        **meta,
    )
    return o


def triton_interpreted() -> bool:
    """True when the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return HAVE_TRITON and type(_ragged_attention_kernel).__name__ == "InterpretedFunction"
