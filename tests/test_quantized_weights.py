"""GGUF weights kept quantized (`--weights quantized`): the int4 digits against the file's own
dequantization, the kernels against the dense weight, a model from a GGUF file against its
dense load, and how EngineConfig resolves --weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")

from ringleader.device.engine_config import EngineConfig  # noqa: E402
from ringleader.device.model import LlamaModel  # noqa: E402
from ringleader.device.weights.gguf_quants import BLOCK_LAYOUTS  # noqa: E402
from ringleader.device.weights.quant_weights import DIGIT_FORMS, GGUFMatrix, RowBands, cat_rows  # noqa: E402
from ringleader.device.weights.triton_quant_matmul import dense_digits  # noqa: E402 - the digits' reference
from ringleader.device.weights.weight_kernels import (  # noqa: E402
    CpuInt4Matmul,
    KernelLinear,
    dense_matmul,
)
from tests.test_gguf_checkpoint import hf_model, write_gguf  # noqa: E402, F401 - the fixture, by name
from tests.test_gguf_quants import _random_raw  # noqa: E402

# types whose digits reproduce the file's values bit for bit; Q5_1/Q5_K add their offset to the
# low digit, one rounding away (checked to a float32 ulp below)
EXACT = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0")


def _matrix(qtype: str, n: int, k: int, seed: int = 0) -> GGUFMatrix:
    raw = torch.from_numpy(_random_raw(qtype, (n, k), seed)).view(n, -1)
    return GGUFMatrix(raw, qtype, (n, k), f"w.{qtype}")


@pytest.mark.parametrize("qtype", sorted(DIGIT_FORMS))
def test_digits_are_the_files_values(qtype):
    block = BLOCK_LAYOUTS[qtype][0]
    m = _matrix(qtype, 6, 2 * max(block, 64))
    dense, digits = m.dense(torch.float32), m.digits()
    assert all(int(d.codes.max()) <= 15 for d in digits)
    assert len(digits) == DIGIT_FORMS[qtype][1]
    got = dense_digits(digits, 32)
    if qtype in EXACT:
        assert torch.equal(got, dense)
    else:
        assert ((got - dense).abs() <= dense.abs() * 2**-23 + 1e-30).all()


def test_embedding_rows_decode_exactly():
    m = _matrix("Q8_0", 40, 64)
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    assert torch.equal(m.rows(ids), m.dense(torch.float32)[ids])


def test_cat_rows_merges_one_type_and_bands_mixed_ones():
    a, b, c = _matrix("Q4_1", 16, 64), _matrix("Q4_1", 32, 64, 1), _matrix("Q6_K", 16, 256)
    merged = cat_rows([a, b])
    assert isinstance(merged, GGUFMatrix) and merged.shape == (48, 64)
    assert torch.equal(
        merged.dense(torch.float32), torch.cat([a.dense(torch.float32), b.dense(torch.float32)])
    )
    dense = torch.randn(8, 64)
    bands = cat_rows([a, dense])
    assert isinstance(bands, RowBands) and bands.shape == (24, 64)
    assert isinstance(cat_rows([dense, dense]), torch.Tensor)
    assert not c.has_digits  # groups of 16: widened at load


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rel: float) -> bool:
    """|got - x @ w.T| within `rel` of the largest |x| @ |w|.T (bf16 activations and scales)."""
    want = x @ w.t()
    return bool((got - want).abs().max() <= rel * (x.abs() @ w.abs().t()).max())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_K"])
@pytest.mark.parametrize("m_rows", [1, 5])
def test_cpu_int4_kernel_computes_the_dense_product(qtype, m_rows):
    n = 40  # not a multiple of 16: the packing pads rows
    w = _matrix(qtype, n, 256)
    kernel = CpuInt4Matmul(w.digits(), n)
    x = torch.randn(m_rows, 256)
    got = kernel(x)
    assert got.shape == (m_rows, n) and got.dtype == torch.float32
    assert _close(got, x, w.dense(torch.float32), 2e-2)


@pytest.mark.parametrize("n", [48, 49])
@pytest.mark.parametrize("m_rows", [1, 3])
def test_dense_matmul_split_over_threads_is_f_linear(n, m_rows):
    w, x = torch.randn(n, 32), torch.randn(m_rows, 32)
    assert torch.allclose(dense_matmul(x, w, splits=2), F.linear(x, w), atol=1e-5, rtol=1e-5)
    got = dense_matmul(x, w.bfloat16(), splits=2)
    assert got.dtype == torch.float32 and _close(got, x, w, 2e-2)


def test_kernel_linear_over_mixed_bands():
    q4k, q6k, dense = _matrix("Q4_K", 32, 256), _matrix("Q6_K", 16, 256, 1), torch.randn(16, 256)
    lin = KernelLinear(cat_rows([q4k, q6k, dense]), torch.randn(64), torch.float32, "cpu", splits=2)
    assert lin.kinds == ["Q4_K", "Q6_K->dense", "float32"]
    w = torch.cat([q4k.dense(torch.float32), q6k.dense(torch.float32), dense])
    x = torch.randn(3, 256)
    assert _close(lin(x) - lin.bias, x, w, 2e-2)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("tied", [False, True])
def test_quantized_gguf_model_tracks_its_dense_load(hf_model, tmp_path, qtype, tied):  # noqa: F811
    path = write_gguf(tmp_path / "m.gguf", hf_model, qtype=qtype, drop={"output.weight"} if tied else ())
    dense = LlamaModel.from_gguf(path)
    quant = LlamaModel.from_gguf(path, weights="quantized")
    described = quant.weights_description()
    # 2 layers x (qkv, o, gate_up, down) + the lm_head (tied: the embedding table's digits)
    assert described["matrices"] == {qtype: 9}
    assert described["weight_mib"] < dense.weights_description()["weight_mib"]
    ids = [3, 17, 42, 8, 60, 1]
    want, got = dense.prompt_logits(ids), quant.prompt_logits(ids)
    # int8 activations in the quantized kernel (the weights are exact): within a tenth of the spread
    assert (got - want).abs().max() <= 0.1 * want.std()


def test_weights_resolve_per_model_and_device():
    gguf_file = "/models/m.Q4_1.gguf"
    assert EngineConfig(model=gguf_file).resolved("cpu").weights == "quantized"
    assert EngineConfig(model="tiny").resolved("cpu").weights == "fp32"
    assert EngineConfig(model="tiny").resolved("cuda").weights == "bf16"
    fp32_cuda = EngineConfig(model=gguf_file, weights="fp32").resolved("cuda")
    assert (fp32_cuda.weights, fp32_cuda.dtype) == ("fp32", "float32")
    assert EngineConfig(model="tiny", weights="bf16").resolved("cpu").model_weights() == "bfloat16"
    assert EngineConfig(model=gguf_file).resolved("cuda").model_weights() == "quantized"
    with pytest.raises(ValueError, match="--weights quantized keeps a GGUF file's quantization; tiny"):
        EngineConfig(model="tiny", weights="quantized")
    with pytest.raises(ValueError, match="weights must be one of auto, fp32, bf16, quantized"):
        EngineConfig(weights="int3")
    with pytest.raises(ValueError, match="--weights fp32 computes in float32 on cuda"):
        EngineConfig(weights="fp32", dtype="bfloat16").resolved("cuda")


def test_quantized_from_spec_refuses_a_preset():
    with pytest.raises(ValueError, match="tiny is no GGUF file"):
        LlamaModel.from_spec("tiny", weights="quantized")
