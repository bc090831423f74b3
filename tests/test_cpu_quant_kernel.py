"""device/weights/cpu_quant_matmul.py: the CPU int8-activation kernel for GGUF weights, against
float64 references built from the file's own dequantization, across every ISA this CPU runs,
and its OpenMP threads (torch's runtime, torch's thread count)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("gguf")  # the random GGUF bytes come from test_gguf_quants' helpers

from ringleader.device.backends.cpu_features import cpu_features
from ringleader.device.backends.cpu_native import TORCH_GOMP
from ringleader.device.weights import cpu_quant_matmul as cq
from ringleader.device.weights.cpu_quant_matmul import CpuQuantMatmul, quantize_activations
from ringleader.device.weights.quant_weights import DIGIT_FORMS, GGUFMatrix
from ringleader.ipc.native import NativeBuildError, find_compiler
from tests.test_gguf_quants import _random_raw

QTYPES = sorted(DIGIT_FORMS)
ISAS = ("native", "generic", "avx2", "avx2-vnni", "avx512")
RUNNABLE = tuple(isa for isa in ISAS if cq.isa_runs_here(isa))
M_ROWS = (1, 3, 8, 17, 64)
N_ROWS = (1, 15, 32, 100)

# Only float rounding separates the kernel from the exact reference (the integer dots are exact,
# the per-group float work is a few float32 operations and the sum over K/32 groups a few more):
# relative to the sum of |w| |x| of an output, that stays far below 1e-5 (float32 eps is 6e-8).
FLOAT_REL = 1e-5


def _k_values(qtype: str) -> tuple[int, ...]:
    return (256, 768) if qtype.endswith("_K") else (32, 96, 576)  # K-quant blocks are 256 wide


def _matrix(qtype: str, n: int, k: int, seed: int = 0) -> GGUFMatrix:
    raw = torch.from_numpy(_random_raw(qtype, (n, k), seed)).view(n, -1)
    return GGUFMatrix(raw, qtype, (n, k), f"w.{qtype}")


def _x(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, :32] *= 50  # groups of very different magnitudes
    if m > 2:
        x[1] = 0  # a zero row: scale 0
    return x


@pytest.fixture(scope="module", autouse=True)
def built():
    """Every runnable ISA built at once (the compiler runs in parallel)."""
    with ThreadPoolExecutor(len(RUNNABLE)) as pool:
        list(pool.map(cq.library, RUNNABLE))


def _exact_reference(x: torch.Tensor, w: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (x as the kernel quantizes it) @ W.T, and the sums of |x| |w| per output."""
    q, e = quantize_activations(x, isa)
    xd = (q.double().view(q.shape[0], -1, 32) * e.double().unsqueeze(-1)).view(q.shape)
    wd = w.double()
    return xd @ wd.t(), xd.abs() @ wd.abs().t()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("isa", ["native", "generic"])
def test_forms_hold_the_files_values_exactly(qtype, isa):
    """code * d + o from the packed bytes is gguf_quants' float32 dequantization bit for bit,
    with fp16 scales where chosen and with float32 ones."""
    m = _matrix(qtype, 37, _k_values(qtype)[-1])
    dense = m.dense(torch.float32)
    for half in (None, False):
        op = CpuQuantMatmul.from_gguf(m, isa, half_scales=half)
        assert torch.equal(op.dequantized(), dense)
    assert op.half_scales is False
    auto = CpuQuantMatmul.from_gguf(m, isa)
    # fp16 where exact (K-quant sub-scales are not) and converted in vectors (not generic)
    assert auto.half_scales == (not qtype.endswith("_K") and isa != "generic")
    if not qtype.endswith("_K"):
        assert torch.equal(CpuQuantMatmul.from_gguf(m, isa, half_scales=True).dequantized(), dense)


@pytest.mark.parametrize("qtype", QTYPES)
def test_matches_float64_references(qtype):
    """(a) the file's weights times the kernel's own int8 activations, to float rounding;
    (b) times the float32 activations, within the int8 rounding's bound."""
    for k in _k_values(qtype):
        for n in N_ROWS:
            w = _matrix(qtype, n, k, seed=n + k)
            dense = w.dense(torch.float32)
            op = CpuQuantMatmul.from_gguf(w)
            for m in M_ROWS:
                x = _x(m, k, seed=m)
                y = op(x)
                assert y.shape == (m, n) and y.dtype == torch.float32
                ref, scale = _exact_reference(x, dense, "native")
                err = (y.double() - ref).abs()
                assert (err <= FLOAT_REL * scale + 1e-30).all(), (k, n, m, float((err / scale).max()))
                # (b) x - q * e is at most e / 2 = max|x of its group| / 254 per element, so
                # |y - x @ W.T| <= sum_k |W| * that (+ the float rounding of (a))
                bound_x = (x.abs().view(m, -1, 32).amax(-1, keepdim=True) / 254).expand(m, k // 32, 32)
                bound = bound_x.reshape(m, k).double() @ dense.double().abs().t()
                want = x.double() @ dense.double().t()
                slack = FLOAT_REL * (x.double().abs() @ dense.double().abs().t()) + 1e-30
                assert ((y.double() - want).abs() <= bound * (1 + 1e-6) + slack).all(), (k, n, m)


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "generic"])
def test_every_isa_equals_the_generic_path(isa):
    if not cq.isa_runs_here(isa):
        pytest.skip(f"this CPU lacks {', '.join(cq.ISA_CPU_FLAGS[isa])} for isa={isa}")
    path = cq.kernel_path(isa)
    assert path == {"avx2": "avx2", "avx2-vnni": "avx2-vnni", "avx512": "avx512-vnni"}.get(isa, path)
    for qtype in QTYPES:
        k = _k_values(qtype)[-1]
        x = _x(17, k, seed=3)
        q_isa, e_isa = quantize_activations(x, isa)
        q_gen, e_gen = quantize_activations(x, "generic")
        assert torch.equal(q_isa, q_gen) and torch.equal(e_isa, e_gen)  # the same int8 codes
        for n in (15, 100):
            w = _matrix(qtype, n, k, seed=7)
            got = CpuQuantMatmul.from_gguf(w, isa)(x).double()
            want = CpuQuantMatmul.from_gguf(w, "generic")(x).double()
            _, scale = _exact_reference(x, w.dense(torch.float32), "generic")
            assert ((got - want).abs() <= 2 * FLOAT_REL * scale + 1e-30).all(), (qtype, n)


def test_kernel_paths_and_isas():
    assert cq.kernel_path("generic") == "generic"
    assert cq.kernel_path("native") in ("avx512-vnni", "avx2-vnni", "avx2", "generic")
    op = CpuQuantMatmul.from_gguf(_matrix("Q4_1", 8, 64), "generic")
    assert op.path == "generic" and op.nbytes == op.packed.numel() > 0
    with pytest.raises(ValueError, match="unknown isa 'sse9'"):
        cq.kernel_path("sse9")
    flags = cpu_features().flags
    if "avx512_vnni" in flags and "avx512bw" in flags:
        assert cq.kernel_path("native") == "avx512-vnni"
    elif "avx2" in flags:
        assert cq.kernel_path("native").startswith("avx2")


def test_bad_inputs_name_what_is_wrong():
    op = CpuQuantMatmul.from_gguf(_matrix("Q4_0", 16, 96))
    with pytest.raises(ValueError, match=r"shape \(2, 64\).*K = 96"):
        op(torch.randn(2, 64))
    with pytest.raises(ValueError, match="last dimension"):
        op(torch.tensor(1.0))
    with pytest.raises(ValueError, match="is on meta"):
        op(torch.empty(2, 96, device="meta"))
    with pytest.raises(ValueError, match="K = 48 is not a multiple of 32"):
        quantize_activations(torch.randn(2, 48))
    odd = GGUFMatrix(torch.zeros(4, 51, dtype=torch.uint8), "Q8_0", (4, 48), "w.odd")
    with pytest.raises(ValueError, match="K = 48 is not a multiple of 32"):
        CpuQuantMatmul.from_gguf(odd)
    q6k = _matrix("Q6_K", 4, 256)
    assert not cq.supported(q6k)
    with pytest.raises(ValueError, match="Q6_K"):
        CpuQuantMatmul.from_gguf(q6k)
    with pytest.raises(ValueError, match="not all fp16"):
        CpuQuantMatmul.from_gguf(_matrix("Q4_K", 64, 256), half_scales=True)


def test_shapes_strides_and_dtypes():
    w = _matrix("Q5_1", 33, 96)
    op = CpuQuantMatmul.from_gguf(w)
    x = torch.randn(2, 3, 96)
    y = op(x)
    assert y.shape == (2, 3, 33)
    assert torch.equal(y, op(x.reshape(6, 96)).view(2, 3, 33))
    wide = torch.randn(5, 192)
    assert torch.equal(op(wide[:, ::2]), op(wide[:, ::2].contiguous()))  # a strided view
    xb = x.bfloat16()
    yb = op(xb)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, op(xb.float()).bfloat16())
    assert op(torch.empty(0, 96)).shape == (0, 33)


def test_threads_of_the_caller_each_own_scratch():
    """Python threads calling at once (each its own OpenMP team) get their own results."""
    w = _matrix("Q4_1", 64, 576)
    op = CpuQuantMatmul.from_gguf(w)
    xs = [torch.randn(m, 576) for m in (1, 9, 30, 4)]
    want = [op(x) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(op, xs))
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_runs_on_torchs_openmp_runtime_and_thread_count():
    """One libgomp in the process (torch's), and torch.set_num_threads on the calling thread sets
    the threads of the kernel's parallel regions."""
    op = CpuQuantMatmul.from_gguf(_matrix("Q8_0", 256, 576))
    x = torch.randn(4, 576)
    before = torch.get_num_threads()
    try:
        counts = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            op(x)  # 256 x 576 x 4: above the size a call runs on one thread
            counts[n] = (cq.thread_probe(), cq.last_call_threads())
        assert counts == {1: (1, 1), 2: (2, 2)}
    finally:
        torch.set_num_threads(before)
    runtimes = cq.loaded_openmp_runtimes()
    assert len(runtimes) == 1, runtimes
    if "torch's" in cq.OPENMP_NOTE:
        assert runtimes[0] == str(TORCH_GOMP.resolve())


def test_a_rejected_isa_is_named_and_native_falls_back(tmp_path, monkeypatch):
    """A compiler that refuses an ISA's flags: a clear error naming the isa; one that refuses
    -march=native: the generic build instead."""
    real = find_compiler()
    fake = tmp_path / "picky-g++"
    fake.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in -march=native|-mavx512vnni) echo "unknown flag $a" >&2; exit 1;; esac; done\n'
        f'exec {real} "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("RINGLEADER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(NativeBuildError, match="isa='avx512'"):
        cq.library.__wrapped__("avx512")
    assert cq.library.__wrapped__("native").rl_cq_path() == b"generic"
