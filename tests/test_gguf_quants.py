"""device/weights/gguf_quants.py against the `gguf` package's numpy reference dequantizer."""

import numpy as np
import pytest
import torch

from ringleader.device.weights import gguf_quants
from ringleader.device.weights.gguf_quants import SUPPORTED, UnsupportedQuantization, dequantize

gguf = pytest.importorskip("gguf")

# byte offsets of the f16 scale fields in each block: random bytes there could be inf or nan
F16_FIELD_OFFSETS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
ROWS = 5


def _block_layout(qtype: str) -> tuple[int, int]:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]


def _shape(qtype: str) -> tuple[int, int]:
    block_size, _ = _block_layout(qtype)
    return (ROWS, 4 * max(block_size, 32))


def _finite_f16(rng: np.random.RandomState, count: int) -> np.ndarray:
    # magnitudes from 2**-20 (an f16 subnormal) to 2**3, both signs
    magnitudes = np.exp2(rng.uniform(-20, 3, size=count))
    return (rng.choice([-1.0, 1.0], size=count) * magnitudes).astype("<f2")


def _random_float_bytes(qtype: str, count: int, rng: np.random.RandomState) -> np.ndarray:
    values = (rng.standard_normal(count) * 4).astype("<f4")
    if qtype == "F16":
        return values.astype("<f2").view(np.uint8)
    if qtype == "BF16":
        return (values.view("<u4") >> 16).astype("<u2").view(np.uint8)
    return values.view(np.uint8)


def _random_quant_bytes(qtype: str, n_blocks: int, rng: np.random.RandomState) -> np.ndarray:
    _, type_size = _block_layout(qtype)
    blocks = rng.randint(0, 256, size=(n_blocks, type_size)).astype(np.uint8)
    offsets = F16_FIELD_OFFSETS[qtype]
    names = [f"scale{i}" for i in range(len(offsets))]
    record = np.dtype(
        {"names": names, "formats": ["<f2"] * len(offsets), "offsets": list(offsets), "itemsize": type_size}
    )
    fields = blocks.view(record).reshape(n_blocks)
    for field_name in names:
        fields[field_name] = _finite_f16(rng, n_blocks)
    return blocks.reshape(-1)


def _random_raw(qtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.RandomState(seed)
    n_elements = int(np.prod(shape))
    if qtype in FLOAT_TYPES:
        return _random_float_bytes(qtype, n_elements, rng)
    block_size, _ = _block_layout(qtype)
    return _random_quant_bytes(qtype, n_elements // block_size, rng)


def _reference(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    byte_rows = raw.reshape(int(np.prod(shape[:-1])), -1)
    expected = gguf.quants.dequantize(byte_rows, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32)).reshape(shape)


def _assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype == torch.float32
    assert actual.shape == expected.shape
    mismatches = (actual.view(torch.int32) != expected.view(torch.int32)).sum().item()
    assert mismatches == 0, f"{mismatches} elements differ; max abs diff {(actual - expected).abs().max()}"


def test_must_have_types_are_supported():
    must_have = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K"}
    assert must_have <= set(SUPPORTED)


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_block_layouts_match_gguf(qtype):
    assert gguf_quants.BLOCK_LAYOUTS[qtype] == _block_layout(qtype)


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_matches_reference_bitwise(qtype):
    shape = _shape(qtype)
    raw = _random_raw(qtype, shape)
    actual = dequantize(torch.from_numpy(raw), qtype, shape)
    _assert_bitwise_equal(actual, _reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_higher_rank_shapes(qtype):
    block_size, _ = _block_layout(qtype)
    shape = (2, 3, 2 * block_size)
    raw = _random_raw(qtype, shape, seed=1)
    actual = dequantize(torch.from_numpy(raw), qtype, shape)
    _assert_bitwise_equal(actual, _reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_K", "Q6_K"])
def test_bf16_output_is_the_fp32_result_cast(qtype):
    shape = _shape(qtype)
    raw = torch.from_numpy(_random_raw(qtype, shape))
    as_bf16 = dequantize(raw, qtype, shape, dtype=torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16, dequantize(raw, qtype, shape).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q5_K"])
def test_chunked_decode_equals_unchunked(qtype, monkeypatch):
    shape = _shape(qtype)
    raw = torch.from_numpy(_random_raw(qtype, shape, seed=2))
    whole = dequantize(raw, qtype, shape)
    block_size, _ = _block_layout(qtype)
    # 3 blocks per chunk does not divide the block count, so the last chunk is a short one
    monkeypatch.setattr(gguf_quants, "CHUNK_OUTPUT_BYTES", 3 * block_size * 4)
    assert torch.equal(dequantize(raw, qtype, shape, dtype=torch.float32), whole)


def test_wrong_byte_count_raises():
    shape = _shape("Q4_K")
    raw = torch.from_numpy(_random_raw("Q4_K", shape))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*2880 bytes, got 2879"):
        dequantize(raw[:-1], "Q4_K", shape, name="blk.0.ffn_up.weight")


def test_row_not_a_multiple_of_the_block_raises():
    raw = torch.zeros(34 * 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"token_embd\.weight.*block size 32"):
        dequantize(raw, "Q8_0", (2, 48), name="token_embd.weight")


def test_unsupported_type_names_the_type_and_tensor():
    raw = torch.zeros(66, dtype=torch.uint8)
    with pytest.raises(UnsupportedQuantization) as excinfo:
        dequantize(raw, "IQ2_XS", (1, 256), name="blk.0.attn_q.weight")
    message = str(excinfo.value)
    assert "IQ2_XS" in message and "blk.0.attn_q.weight" in message
    assert isinstance(excinfo.value, ValueError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", SUPPORTED)
def test_cuda_decode_matches_reference_bitwise(qtype):
    shape = _shape(qtype)
    raw = _random_raw(qtype, shape, seed=3)
    actual = dequantize(torch.from_numpy(raw), qtype, shape, device="cuda")
    assert actual.device.type == "cuda"
    _assert_bitwise_equal(actual.cpu(), _reference(raw, qtype, shape))
