"""The CPU step's work around its matmuls, one C++ call each (cpu_step_kernels.cpp): add +
RMSNorm, SiLU x up, RoPE with the k/v store, and the decode rows' attention read in place from
their pages. Measured on SmolLM2 (2-core EPYC): the 4 x 30 pointwise torch calls of a decode step
(3-8 ops each, microseconds of dispatch apiece) cost ~1.2 ms, and the in-place attention is
2.6-3.3x the gather + SDPA it replaces; with the quantized kernel a 1-row step went from 9.9 to
5.5 ms (bench/results/2026-11-29-cpu-shared/).

Taken only where it is the same computation: fp32 contiguous tensors; the pointwise calls at most
FEW_ROWS rows (a prefill chunk's many rows keep torch's ops, which spread over the team's
threads); the attention for every decode row (its loop runs on the team when long). Anything
else goes to device/model/ops.py and attend_gathered unchanged.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger("ringleader.cpu")

FEW_ROWS = 32  # above this many rows a step is compute-bound, and torch's ops use every thread
_SOURCE = Path(__file__).with_name("cpu_step_kernels.cpp")


@functools.cache
def _library() -> ctypes.PyDLL:
    """Built for this machine (device/backends/cpu_native.py), called holding the GIL: a
    pointwise call is a few microseconds, less than dropping and taking the GIL back."""
    from ringleader.device.backends.cpu_native import build_for_this_cpu

    lib = ctypes.PyDLL(str(build_for_this_cpu("cpu_step_kernels", _SOURCE)))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.rl_add_rms_norm.argtypes = [ptr, ptr, ptr, f32, i64, i64, ptr, ptr]
    lib.rl_silu_mul.argtypes = [ptr, i64, i64, ptr]
    lib.rl_rope_store.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr]
    lib.rl_decode_attention.argtypes = [
        ptr,
        ptr,
        i64,
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
        f32,
        ptr,
    ]
    for fn in (lib.rl_add_rms_norm, lib.rl_silu_mul, lib.rl_rope_store, lib.rl_decode_attention):
        fn.restype = None
    return lib


def _fp32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _few_fp32(*tensors: torch.Tensor) -> bool:
    return _fp32(*tensors) and tensors[0].shape[0] <= FEW_ROWS


class CpuStepKernels:
    """PointwiseKernels (device/model/decoder_layer.py) for the CPU: few-row fp32 calls in C++."""

    def __init__(self) -> None:
        self._lib = _library()
        # the attention can run for milliseconds at long contexts: called without the GIL
        self._lib_released = ctypes.CDLL(self._lib._name)
        self._lib_released.rl_decode_attention.argtypes = self._lib.rl_decode_attention.argtypes
        self._lib_released.rl_decode_attention.restype = None

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2 or not _few_fp32(x, weight, *([] if delta is None else [delta])):
            from ringleader.device.model import ops  # here: the model package imports this module

            return ops.add_rms_norm(x, delta, weight, eps)
        rows, dim = x.shape
        residual = x if delta is None else torch.empty_like(x)
        normed = torch.empty_like(x)
        self._lib.rl_add_rms_norm(
            x.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            eps,
            rows,
            dim,
            residual.data_ptr(),
            normed.data_ptr(),
        )
        return residual, normed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or not _few_fp32(gate_up):
            from ringleader.device.model import ops

            return ops.silu_mul(gate_up)
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, inter)
        self._lib.rl_silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr())
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_row: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        n_kv: int,
        head_dim: int,
    ) -> torch.Tensor | None:
        """Rotated q [T, H, D], k and v stored at cache_row of the flat caches; None where this
        is not the fp32 few-row case (the caller then runs ops.rope_split and index_copy_)."""
        if not (
            _few_fp32(qkv, cos, sin, k_cache, v_cache)
            and cache_row.dtype == torch.int64
            and cache_row.is_contiguous()
        ):
            return None
        rows, heads = qkv.shape[0], qkv.shape[1] // head_dim - 2 * n_kv
        q = qkv.new_empty(rows, heads, head_dim)
        self._lib.rl_rope_store(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            cache_row.data_ptr(),
            rows,
            heads,
            n_kv,
            head_dim,
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        )
        return q

    @staticmethod
    def attends_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *tables) -> bool:
        """Whether decode_attention takes these: fp32 contiguous q and caches, int64 contiguous
        row tables (the same for every layer of a step: checked once per step)."""
        return _fp32(q, k_cache, v_cache) and all(
            t.dtype == torch.int64 and t.is_contiguous() for t in tables
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        rows: torch.Tensor | None,
        slot_of: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Writes the attention of q's decode rows `rows` (all rows when None) into `out`
        [T, H, D], reading their slots' pages of k/v_cache [P, PS, KV, D] in place; the tensors
        as attends_in_place says (rows int64 contiguous too)."""
        _, heads, dim = q.shape
        page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        self._lib_released.rl_decode_attention(
            q.data_ptr(),
            None if rows is None else rows.data_ptr(),
            q.shape[0] if rows is None else rows.shape[0],
            slot_of.data_ptr(),
            positions.data_ptr(),
            block_table.data_ptr(),
            block_table.shape[1],
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            page_size,
            heads,
            kv_heads,
            dim,
            dim**-0.5,
            out.data_ptr(),
        )


@functools.cache
def cpu_step_kernels() -> CpuStepKernels | None:
    """The process's CpuStepKernels; None where it cannot be built (no compiler: torch's ops)."""
    try:
        return CpuStepKernels()
    except Exception as exc:  # no working compiler: torch's ops, which compute the same
        log.warning("the CPU pointwise kernels did not build (%s): torch's ops run instead", exc)
        return None
