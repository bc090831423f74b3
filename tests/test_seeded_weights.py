"""The presets' random weights are one model on every device: a counter hash in integer
arithmetic (device/weights/seeded_weights.py), not a device generator. On the H200 (2026-11-28)
`tiny` seeded 0 drew different weights on the GPU than on the CPU, so the CPU backend and
transformers-on-CUDA disagreed at the first token; these tests hold what makes that impossible."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ringleader.device.model import LlamaModel
from ringleader.device.weights import seeded_weights as sw


def hash_in_python(values: np.ndarray) -> np.ndarray:
    """The same hash in numpy uint64, written apart from the torch form."""
    x = values.astype(np.uint64)
    m32 = np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & m32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x31848BAB)) & m32
    return x ^ (x >> np.uint64(16))


def expected_weights(n: int, std: float, seed: int, offset: int) -> np.ndarray:
    counter = np.arange(offset, offset + n, dtype=np.uint64)
    key = hash_in_python(np.array([seed & 0xFFFFFFFF]))[0]
    bits = hash_in_python(
        hash_in_python((counter & np.uint64(0xFFFFFFFF)) ^ key) ^ (counter >> np.uint64(32))
    )
    centred = (bits >> np.uint64(8)).astype(np.int64) - (1 << 23)
    scale = np.float32(std * math.sqrt(3.0) / (1 << 23))
    return centred.astype(np.float32) * scale


def test_the_bits_are_the_integer_hash_and_nothing_else():
    p = torch.empty(3, 1000)
    offset = (1 << 32) - 700  # the high word of the counter is mixed in past 2^32
    assert sw.fill_uniform_(p, 0.02, 7, offset) == offset + 3000
    np.testing.assert_array_equal(p.view(-1).numpy(), expected_weights(3000, 0.02, 7, offset))


def test_the_chunking_of_a_gpu_gives_the_same_bits(monkeypatch):
    """A GPU hashes 2^24 elements at a time, the CPU 2^15: the chunk must not change a bit."""
    n = 100_003
    small, large = torch.empty(n), torch.empty(n)
    monkeypatch.setitem(sw._CHUNK, "cpu", 1 << 10)
    sw.fill_uniform_(small, 0.5, 3, 11)
    monkeypatch.setitem(sw._CHUNK, "cpu", sw._CHUNK_ELSEWHERE)
    sw.fill_uniform_(large, 0.5, 3, 11)
    assert torch.equal(small, large)


def test_the_distribution_is_the_asked_std_and_bf16_is_the_fp32_rounded():
    p32, p16 = torch.empty(500, 400), torch.empty(500, 400, dtype=torch.bfloat16)
    sw.fill_uniform_(p32, 0.05, 0, 0)
    sw.fill_uniform_(p16, 0.05, 0, 0)
    assert torch.equal(p16, p32.to(torch.bfloat16))
    assert abs(p32.std().item() - 0.05) < 0.05 * 0.01 and abs(p32.mean().item()) < 1e-3
    assert p32.abs().max().item() <= 0.05 * math.sqrt(3.0)
    other = torch.empty(500, 400)
    sw.fill_uniform_(other, 0.05, 1, 0)
    assert not torch.equal(other, p32)  # the seed matters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_preset_is_one_model_for_one_seed(dtype):
    a = LlamaModel.from_spec("tiny", dtype, "cpu", seed=0).state_dict()
    b = LlamaModel.from_spec("tiny", dtype, "cpu", seed=0).state_dict()
    c = LlamaModel.from_spec("tiny", dtype, "cpu", seed=1).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    # each matrix draws its own counters: no two layers share weights
    qkv = [v for k, v in a.items() if k.endswith("qkv.weight")]
    assert len(qkv) >= 2 and not torch.equal(qkv[0], qkv[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_same_preset_weights_on_the_gpu():
    cpu = LlamaModel.from_spec("tiny", torch.float32, "cpu", seed=0).state_dict()
    gpu = LlamaModel.from_spec("tiny", torch.float32, "cuda", seed=0).state_dict()
    assert all(torch.equal(cpu[k], gpu[k].cpu()) for k in cpu)
