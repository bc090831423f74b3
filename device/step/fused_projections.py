"""The four projection kernels of the fused decode step and their launch wrappers.

The shared pieces (the K loop over dense or int4 tiles, the RMSNorm prologue, rounding, tile
sizes, `FusedWeight`) and the design are in device/step/triton_gemv.py; this file has what each
projection does around them. Every wrapper checks shapes, allocates its output with
torch.empty (no fill kernel), and launches once through triton_launch.launch.
"""

from __future__ import annotations

import torch

from ringleader.device.step.triton_gemv import HAVE_TRITON, FusedWeight, tile_meta
from ringleader.device.step.triton_launch import launch, pdl_meta

PROJECTION_BLOCK_N = 32  # add_projection's and gate_up_silu's column tile
HEAD_BLOCK_N = 64  # lm_head_argmax's: its per-tile bests are [cdiv(V, 64), rows]

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ringleader.device.step.triton_gemv import _normed_pair, _project, _projected, _row_rstd, _start

    @triton.jit(do_not_specialize=["T"])  # BLOCK_T holds what matters of T
    def _qkv_rope_store_kernel(
        a_ptr, stride_at, T, K, normw_ptr, eps,
        w_ptr, scale_ptr, zero_ptr, stride_wd, stride_wn, stride_sd, stride_sn, bias_ptr,
        cos_ptr, sin_ptr, stride_ct, stride_st, bt_ptr, stride_bt, slot_ptr, pos_ptr, max_pos, scratch_page,
        q_ptr, stride_qt, k_ptr, v_ptr, stride_kp, stride_kn, stride_kh, stride_vp, stride_vn, stride_vh,
        N_HEADS: tl.constexpr, N_KV: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
        HAS_BIAS: tl.constexpr, W_INT4: tl.constexpr, N_DIGITS: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """A program: BLOCK_N columns of one head's first half and the paired ones of its second
        (RoPE rotates column j with j + HALF), for every row; then RoPE (q and k heads) and the
        store (q out, k and v into the paged cache)."""
        pid = tl.program_id(0)
        chunks: tl.constexpr = HALF // BLOCK_N
        head = pid // chunks
        in_half = (pid % chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_a = head * 2 * HALF + in_half
        cols_b = cols_a + HALF
        n_ok = in_half < HALF
        rows = tl.arange(0, BLOCK_T)
        t_ok = rows < T
        _start(w_ptr, stride_wd, stride_wn, cols_a, cols_b, n_ok, n_ok, 0, True, W_INT4, BLOCK_K, USE_PDL)
        acc_a, acc_b = _normed_pair(
            a_ptr, rows, t_ok, stride_at, K, eps, normw_ptr,
            w_ptr, scale_ptr, zero_ptr, stride_wd, stride_wn, stride_sd, stride_sn, cols_a, cols_b, n_ok,
            W_INT4, N_DIGITS, GROUP, BLOCK_T, BLOCK_N, BLOCK_K, USE_DOT, DOT_PRECISION,
        )  # fmt: skip
        act = a_ptr.dtype.element_ty
        x1 = _projected(acc_a, w_ptr, act, W_INT4).to(tl.float32)  # qkv as the layered step rounds it
        x2 = _projected(acc_b, w_ptr, act, W_INT4).to(tl.float32)
        if HAS_BIAS:  # added to the rounded product, as KernelLinear adds it
            x1 = (x1 + tl.load(bias_ptr + cols_a).to(tl.float32)[None, :]).to(act).to(tl.float32)
            x2 = (x2 + tl.load(bias_ptr + cols_b).to(tl.float32)[None, :]).to(act).to(tl.float32)
        slot = tl.load(slot_ptr + rows, mask=t_ok, other=-1).to(tl.int64)
        pos = tl.minimum(tl.maximum(tl.load(pos_ptr + rows, mask=t_ok, other=0).to(tl.int64), 0), max_pos)
        ok = t_ok[:, None] & n_ok[None, :]
        if head < N_HEADS + N_KV:  # q or k: rotated in fp32, rounded once
            c1 = tl.load(cos_ptr + pos[:, None] * stride_ct + in_half[None, :], mask=ok, other=0.0).to(
                tl.float32
            )
            c2 = tl.load(cos_ptr + pos[:, None] * stride_ct + HALF + in_half[None, :], mask=ok, other=0.0)
            s1 = tl.load(sin_ptr + pos[:, None] * stride_st + in_half[None, :], mask=ok, other=0.0).to(
                tl.float32
            )
            s2 = tl.load(sin_ptr + pos[:, None] * stride_st + HALF + in_half[None, :], mask=ok, other=0.0)
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2.to(tl.float32) + x1 * s2.to(tl.float32)
        else:  # v: stored as projected
            o1 = x1
            o2 = x2
        if head < N_HEADS:
            q_at = q_ptr + rows[:, None] * stride_qt + head * 2 * HALF + in_half[None, :]
            tl.store(q_at, o1.to(q_ptr.dtype.element_ty), mask=ok)
            tl.store(q_at + HALF, o2.to(q_ptr.dtype.element_ty), mask=ok)
        else:
            # pad rows (slot < 0) write the scratch page at offset 0 and read no block table
            live = slot >= 0
            entry = bt_ptr + tl.where(live, slot, 0) * stride_bt + pos // PAGE_SIZE
            page = tl.where(live, tl.load(entry, mask=live & t_ok, other=0).to(tl.int64), scratch_page)
            in_page = tl.where(live, pos % PAGE_SIZE, 0)
            if head < N_HEADS + N_KV:
                k_at = k_ptr + page * stride_kp + in_page * stride_kn + (head - N_HEADS) * stride_kh
                tl.store(k_at[:, None] + in_half[None, :], o1.to(k_ptr.dtype.element_ty), mask=ok)
                tl.store(k_at[:, None] + HALF + in_half[None, :], o2.to(k_ptr.dtype.element_ty), mask=ok)
            else:
                v_at = v_ptr + page * stride_vp + in_page * stride_vn + (head - N_HEADS - N_KV) * stride_vh
                tl.store(v_at[:, None] + in_half[None, :], o1.to(v_ptr.dtype.element_ty), mask=ok)
                tl.store(v_at[:, None] + HALF + in_half[None, :], o2.to(v_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["T"])  # BLOCK_T holds what matters of T
    def _gate_up_silu_kernel(
        a_ptr, stride_at, T, K, normw_ptr, eps,
        w_ptr, scale_ptr, zero_ptr, stride_wd, stride_wn, stride_sd, stride_sn,
        out_ptr, stride_ot, INTER,
        W_INT4: tl.constexpr, N_DIGITS: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """A program: BLOCK_N columns of the gate half and the same ones of the up half."""
        cols_a = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_b = cols_a + INTER
        n_ok = cols_a < INTER
        rows = tl.arange(0, BLOCK_T)
        t_ok = rows < T
        _start(w_ptr, stride_wd, stride_wn, cols_a, cols_b, n_ok, n_ok, 0, True, W_INT4, BLOCK_K, USE_PDL)
        acc_a, acc_b = _normed_pair(
            a_ptr, rows, t_ok, stride_at, K, eps, normw_ptr,
            w_ptr, scale_ptr, zero_ptr, stride_wd, stride_wn, stride_sd, stride_sn, cols_a, cols_b, n_ok,
            W_INT4, N_DIGITS, GROUP, BLOCK_T, BLOCK_N, BLOCK_K, USE_DOT, DOT_PRECISION,
        )  # fmt: skip
        act = out_ptr.dtype.element_ty
        gate = _projected(acc_a, w_ptr, act, W_INT4).to(tl.float32)
        up = _projected(acc_b, w_ptr, act, W_INT4).to(tl.float32)
        # silu rounded before the product, as ops.silu_mul (two ops, two roundings)
        silu = (gate / (1.0 + tl.exp(-gate))).to(act).to(tl.float32)
        ok = t_ok[:, None] & n_ok[None, :]
        tl.store(out_ptr + rows[:, None] * stride_ot + cols_a[None, :], (silu * up).to(act), mask=ok)

    @triton.jit(do_not_specialize=["T"])  # BLOCK_T holds what matters of T
    def _add_projection_kernel(
        a_ptr, stride_at, T, K, N, k_per_split,
        w_ptr, scale_ptr, zero_ptr, stride_wd, stride_wn, stride_sd, stride_sn, bias_ptr,
        res_ptr, stride_rt, part_ptr, stride_ps, stride_pt, tickets_ptr,
        HAS_BIAS: tl.constexpr, N_SPLITS: tl.constexpr, W_INT4: tl.constexpr, N_DIGITS: tl.constexpr,
        GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """A program: BLOCK_N output columns over one split's K range; the split that arrives
        last at its column tile adds the sum of all splits to the residual."""
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < N
        rows = tl.arange(0, BLOCK_T)
        t_ok = rows < T
        k_first = split * k_per_split
        k_last = tl.minimum(k_first + k_per_split, K)
        _start(w_ptr, stride_wd, stride_wn, cols, cols, n_ok, n_ok, k_first, False, W_INT4, BLOCK_K, USE_PDL)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        acc, _ = _project(
            acc, acc, a_ptr, rows, t_ok, stride_at, a_ptr, acc, k_first, k_last, K,
            w_ptr, scale_ptr, zero_ptr, stride_wd, stride_wn, stride_sd, stride_sn, cols, cols, n_ok, n_ok,
            False, False, W_INT4, N_DIGITS, GROUP, BLOCK_N, BLOCK_K, USE_DOT, DOT_PRECISION,
        )  # fmt: skip
        ok = t_ok[:, None] & n_ok[None, :]
        total = acc
        last = True
        if N_SPLITS > 1:
            at = rows[:, None] * stride_pt + cols[None, :]
            tl.store(part_ptr + split * stride_ps + at, acc, mask=ok)
            tl.debug_barrier()  # every thread's partial before the release below
            ticket = tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            last = ticket == N_SPLITS - 1
            if last:
                tl.store(tickets_ptr + pid_n, 0)  # zero again for the next replay
                total = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(N_SPLITS):  # split order, whatever the arrival order
                    total += tl.load(part_ptr + s * stride_ps + at, mask=ok, other=0.0, cache_modifier=".cg")
        if last:
            act = res_ptr.dtype.element_ty
            y = _projected(total, w_ptr, act, W_INT4).to(tl.float32)
            if HAS_BIAS:  # added to the rounded product, as KernelLinear adds it
                y = (y + tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(act)
                y = y.to(tl.float32)
            res_at = res_ptr + rows[:, None] * stride_rt + cols[None, :]
            x = tl.load(res_at, mask=ok, other=0.0).to(tl.float32)
            tl.store(res_at, (x + y).to(act), mask=ok)

    @triton.jit(do_not_specialize=["M"])  # BLOCK_T holds what matters of M
    def _lm_head_argmax_kernel(
        a_ptr, stride_at, row_ptr, max_row, M, K, V, normw_ptr, eps,
        w_ptr, scale_ptr, zero_ptr, stride_wd, stride_wn, stride_sd, stride_sn,
        logits_ptr, stride_lt, best_ptr, best_idx_ptr, stride_bp, ticket_ptr, greedy_ptr,
        W_INT4: tl.constexpr, N_DIGITS: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, REDUCE_TILES: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """A program: BLOCK_N vocabulary columns of the M sampled rows (residual rows
        row_ptr[t], clamped to [0, max_row]); the last program reduces every tile's best."""
        pid = tl.program_id(0)
        n_tiles = tl.num_programs(0)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < V
        out_rows = tl.arange(0, BLOCK_T)
        t_ok = out_rows < M
        _start(w_ptr, stride_wd, stride_wn, cols, cols, n_ok, n_ok, 0, False, W_INT4, BLOCK_K, USE_PDL)
        picked = tl.load(row_ptr + out_rows, mask=t_ok, other=0).to(tl.int64)
        rows = tl.minimum(tl.maximum(picked, 0), max_row)  # a stale entry may point anywhere
        rstd = _row_rstd(a_ptr, rows, t_ok, stride_at, K, eps, BLOCK_T, BLOCK_K)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        acc, _ = _project(
            acc, acc, a_ptr, rows, t_ok, stride_at, normw_ptr, rstd, 0, K, K,
            w_ptr, scale_ptr, zero_ptr, stride_wd, stride_wn, stride_sd, stride_sn, cols, cols, n_ok, n_ok,
            True, False, W_INT4, N_DIGITS, GROUP, BLOCK_N, BLOCK_K, USE_DOT, DOT_PRECISION,
        )  # fmt: skip
        # the model's logits: in its dtype, then fp32
        logits = _projected(acc, w_ptr, a_ptr.dtype.element_ty, W_INT4).to(tl.float32)
        ok = t_ok[:, None] & n_ok[None, :]
        tl.store(logits_ptr + out_rows[:, None] * stride_lt + cols[None, :], logits, mask=ok)
        # this tile's best per row, the first index on ties (torch.argmax's rule)
        vals = tl.where(n_ok[None, :], logits, float("-inf"))
        best = tl.max(vals, axis=1)
        best_idx = tl.min(tl.where(vals == best[:, None], cols[None, :], V), axis=1)
        tl.store(best_ptr + pid * stride_bp + out_rows, best, mask=t_ok)
        tl.store(best_idx_ptr + pid * stride_bp + out_rows, best_idx, mask=t_ok)
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == n_tiles - 1:
            tl.store(ticket_ptr, 0)  # zero again for the next replay
            top = tl.full([BLOCK_T], float("-inf"), tl.float32)
            top_idx = tl.full([BLOCK_T], V, tl.int32)
            for r0 in range(0, n_tiles, REDUCE_TILES):
                tiles = r0 + tl.arange(0, REDUCE_TILES)
                at = tiles[:, None] * stride_bp + out_rows[None, :]
                m = (tiles < n_tiles)[:, None] & t_ok[None, :]
                v = tl.load(best_ptr + at, mask=m, other=float("-inf"), cache_modifier=".cg")
                i = tl.load(best_idx_ptr + at, mask=m, other=V, cache_modifier=".cg")
                chunk = tl.max(v, axis=0)
                chunk_idx = tl.min(tl.where(v == chunk[None, :], i, V), axis=0)
                # tiles go up the vocabulary: a later chunk wins only by a larger value
                better = chunk > top
                top_idx = tl.where(better, chunk_idx, top_idx)
                top = tl.where(better, chunk, top)
            tl.store(greedy_ptr + out_rows, tl.minimum(top_idx, V - 1), mask=t_ok)


def _need_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed: the fused step needs it (use --step-kernels layered)")


def _rows(a: torch.Tensor, k: int, what: str) -> None:
    if a.dim() != 2 or a.shape[1] != k or a.stride(1) != 1:
        raise ValueError(
            f"{what} {tuple(a.shape)} (strides {a.stride()}): want [rows, {k}] with contiguous rows"
        )


def qkv_rope_store(
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: FusedWeight,
    bias: torch.Tensor | None,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    block_table: torch.Tensor,
    slot_of: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scratch_page: int,
    n_heads: int,
    n_kv_heads: int,
    use_pdl: bool = False,
) -> torch.Tensor:
    """rotated q [T, H, D] of rms_norm(residual) @ W_qkv.T (+ bias); rotated k and v into the
    paged cache, with the contract of triton_fused.rope_store_kv (positions clamped to the cos
    table's rows and the block table's reach; pad rows to the scratch page, offset 0)."""
    _need_triton()
    T, hidden = residual.shape
    _rows(residual, hidden, "residual")
    D = k_cache.shape[-1]
    half = D // 2
    if weight.n != (n_heads + 2 * n_kv_heads) * D or weight.k != hidden or D % 2:
        raise ValueError(
            f"qkv weight [{weight.n}, {weight.k}] vs heads {n_heads}+2*{n_kv_heads} of {D}, {hidden}"
        )
    PS = k_cache.shape[1]
    if (
        k_cache.stride(-1) != 1
        or v_cache.stride(-1) != 1
        or cos_table.stride(1) != 1
        or sin_table.stride(1) != 1
    ):
        raise ValueError("the caches' and the cos/sin tables' last dimension must be contiguous")
    if slot_of.shape[0] < T or positions.shape[0] < T or slot_of.stride(0) != 1 or positions.stride(0) != 1:
        raise ValueError(f"slot_of / positions: want >= {T} contiguous entries")
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError(
            f"block table {tuple(block_table.shape)}: want [n_slots, pages] with contiguous rows"
        )
    # one row: 8 pairs of columns a program, so llama-1b's 48 heads make 192 programs (16: 96,
    # fewer than an H100's SMs); more rows: 16, tl.dot's least
    block_n = 8 if T == 1 and half % 8 == 0 else 16 if half % 16 == 0 else 8 if half % 8 == 0 else 0
    if not block_n:
        raise ValueError(f"head_dim {D}: the fused qkv kernel wants head_dim / 2 a multiple of 8")
    max_pos = min(cos_table.shape[0], block_table.shape[1] * PS) - 1
    q = torch.empty(T, n_heads, D, dtype=residual.dtype, device=residual.device)
    launch(
        _qkv_rope_store_kernel,
        ((n_heads + 2 * n_kv_heads) * (half // block_n),),
        residual, residual.stride(0), T, hidden, norm_weight, float(eps),
        *weight.args(), residual if bias is None else bias,
        cos_table, sin_table, cos_table.stride(0), sin_table.stride(0), block_table, block_table.stride(0),
        slot_of, positions, max_pos, scratch_page,
        q, q.stride(0), k_cache, v_cache, *k_cache.stride()[:3], *v_cache.stride()[:3],
        N_HEADS=n_heads, N_KV=n_kv_heads, HALF=half, PAGE_SIZE=PS, HAS_BIAS=bias is not None,
        **weight.meta(), **tile_meta(T, block_n, weight, residual.dtype), **pdl_meta(use_pdl),
    )  # fmt: skip
    return q


def gate_up_silu(
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: FusedWeight, use_pdl: bool = False
) -> torch.Tensor:
    """silu(gate) * up [T, I] of rms_norm(residual) @ W_gate_up.T (gate rows, then up rows)."""
    _need_triton()
    T, hidden = residual.shape
    _rows(residual, hidden, "residual")
    if weight.n % 2 or weight.k != hidden:
        raise ValueError(f"gate_up weight [{weight.n}, {weight.k}]: want [2 * I, {hidden}]")
    inter = weight.n // 2
    block_n = PROJECTION_BLOCK_N
    out = torch.empty(T, inter, dtype=residual.dtype, device=residual.device)
    launch(
        _gate_up_silu_kernel,
        (triton.cdiv(inter, block_n),),
        residual, residual.stride(0), T, hidden, norm_weight, float(eps), *weight.args(),
        out, out.stride(0), inter,
        **weight.meta(), **tile_meta(T, block_n, weight, residual.dtype), **pdl_meta(use_pdl),
    )  # fmt: skip
    return out


def add_projection(
    a: torch.Tensor,
    weight: FusedWeight,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    partials: torch.Tensor,
    tickets: torch.Tensor,
    n_splits: int,
    use_pdl: bool = False,
) -> None:
    """residual += a @ W.T (+ bias), in place, rounded as the layered step rounds (the
    projection's output, then the add). partials: fp32 [>= n_splits, >= T, >= N] scratch;
    tickets: int32 [>= column tiles], zero, left zero."""
    _need_triton()
    T = a.shape[0]
    _rows(a, weight.k, "input")
    _rows(residual, weight.n, "residual")
    if residual.shape[0] != T:
        raise ValueError(f"residual has {residual.shape[0]} rows, the input {T}")
    block_n = PROJECTION_BLOCK_N
    meta = tile_meta(T, block_n, weight, a.dtype)
    n_tiles = triton.cdiv(weight.n, block_n)
    k_block = meta["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(weight.k, k_block), n_splits) * k_block
    n_splits = triton.cdiv(weight.k, k_per_split)  # no empty split
    if n_splits > 1:
        if (
            partials.dtype != torch.float32
            or tuple(partials.shape[:1]) < (n_splits,)
            or partials.shape[1] < T
        ):
            raise ValueError(
                f"partials {tuple(partials.shape)} {partials.dtype}: want fp32 [>= {n_splits}, >= {T}, N]"
            )
        if partials.shape[2] < weight.n or partials.stride(2) != 1:
            raise ValueError(f"partials {tuple(partials.shape)}: want >= {weight.n} contiguous columns")
        if tickets.dtype != torch.int32 or tickets.numel() < n_tiles:
            raise ValueError(f"tickets {tickets.dtype} of {tickets.numel()}: want int32, >= {n_tiles}")
    launch(
        _add_projection_kernel,
        (n_tiles, n_splits),
        a, a.stride(0), T, weight.k, weight.n, k_per_split, *weight.args(), a if bias is None else bias,
        residual, residual.stride(0), partials, partials.stride(0), partials.stride(1), tickets,
        HAS_BIAS=bias is not None, N_SPLITS=n_splits, **weight.meta(), **meta, **pdl_meta(use_pdl),
    )  # fmt: skip


def lm_head_argmax(
    residual: torch.Tensor,
    sample_row: torch.Tensor,
    n_rows: int,
    norm_weight: torch.Tensor,
    eps: float,
    weight: FusedWeight,
    best: torch.Tensor,
    best_idx: torch.Tensor,
    ticket: torch.Tensor,
    use_pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logits [M, V], int32 greedy_token [M]) of rms_norm(residual[rows]) @ W_head.T for
    the M = len(sample_row) sampled rows, row t = clamp(sample_row[t], 0, n_rows - 1);
    greedy_token[t]: the first index of row t's largest logit. best / best_idx: fp32 / int32
    [>= tiles, >= M] scratch; ticket: int32 [1], zero, left zero."""
    _need_triton()
    hidden = residual.shape[1]
    _rows(residual, hidden, "residual")
    M, V = sample_row.shape[0], weight.n
    if not 0 < M <= 32 or sample_row.stride(0) != 1:
        raise ValueError(f"sample_row: want 1 to 32 contiguous entries, got {tuple(sample_row.shape)}")
    if weight.k != hidden:
        raise ValueError(f"lm_head weight [{V}, {weight.k}] vs hidden {hidden}")
    block_n = HEAD_BLOCK_N
    n_tiles = triton.cdiv(V, block_n)
    if best.shape[0] < n_tiles or best.shape[1] < M or best_idx.shape != best.shape or best.stride(1) != 1:
        raise ValueError(
            f"best {tuple(best.shape)}, best_idx {tuple(best_idx.shape)}: want [>= {n_tiles}, >= {M}]"
        )
    if best.dtype != torch.float32 or best_idx.dtype != torch.int32 or ticket.dtype != torch.int32:
        raise ValueError("best must be fp32, best_idx and ticket int32")
    logits = torch.empty(M, V, dtype=torch.float32, device=residual.device)
    greedy = torch.empty(M, dtype=torch.int32, device=residual.device)
    launch(
        _lm_head_argmax_kernel,
        (n_tiles,),
        residual, residual.stride(0), sample_row, n_rows - 1, M, hidden, V, norm_weight, float(eps),
        *weight.args(), logits, logits.stride(0), best, best_idx, best.stride(0), ticket, greedy,
        **weight.meta(), **tile_meta(M, block_n, weight, residual.dtype), REDUCE_TILES=64,
        **pdl_meta(use_pdl),
    )  # fmt: skip
    return logits, greedy
