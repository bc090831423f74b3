"""What the CUDA backend refuses before it touches the GPU, and how it sizes the KV cache.
These run without a GPU: the refusals come first, and the memory plan is arithmetic."""

import os
import subprocess
import sys

import pytest

from ringleader.device.backends.cuda_preflight import (
    GIB,
    UnsafeEnvironment,
    environment_hazards,
    plan_kv_cache,
    refuse_unsafe_environment,
)

HAZARDS = {
    "CUDA_LAUNCH_BLOCKING": "1",
    "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,backend:cudaMallocAsync",
    "PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync",
}


@pytest.mark.parametrize("name", sorted(HAZARDS))
def test_each_hazard_is_named(name):
    found = environment_hazards({name: HAZARDS[name]})
    assert len(found) == 1 and found[0].startswith(f"{name}={HAZARDS[name]}")


def test_harmless_values_pass():
    env = {
        "CUDA_LAUNCH_BLOCKING": "0",
        "PYTORCH_NO_CUDA_MEMORY_CACHING": "",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "CUDA_MODULE_LOADING": "EAGER",
    }
    assert environment_hazards(env) == []
    refuse_unsafe_environment(env, allocator_backend="native")


def test_refusal_lists_every_hazard_and_the_allocator():
    with pytest.raises(UnsafeEnvironment) as err:
        refuse_unsafe_environment({"CUDA_LAUNCH_BLOCKING": "1"}, allocator_backend="cudaMallocAsync")
    assert "CUDA_LAUNCH_BLOCKING=1" in str(err.value) and "'cudaMallocAsync'" in str(err.value)


def test_the_backend_refuses_before_touching_cuda(monkeypatch):
    from ringleader.device.backends.cuda import CudaBackend

    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    with pytest.raises(UnsafeEnvironment, match="PYTORCH_NO_CUDA_MEMORY_CACHING=1"):
        CudaBackend("tiny", scheduler="device")


def test_the_host_scheduler_has_no_persistent_kernel_to_protect(monkeypatch):
    import torch

    from ringleader.device.backends.cuda import CudaBackend

    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    if torch.cuda.is_available():
        pytest.skip("on a GPU this would build a whole backend")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        CudaBackend("tiny", scheduler="host")


def test_serve_refuses_with_the_variable_named():
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringleader.hostctl.cli",
            "serve",
            "--device",
            "cuda",
            "--bind",
            "tcp://127.0.0.1:0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "cannot start" in r.stderr and "CUDA_LAUNCH_BLOCKING=1" in r.stderr
    assert "Traceback" not in r.stderr


# ---- the KV page pool plan -----------------------------------------------------------------
H100 = dict(free_bytes=79 * GIB, total_bytes=80 * GIB, fraction=0.9, workspace_bytes=2 * GIB)
LLAMA_8B_BF16 = 2 * 32 * 8 * 128 * 2  # bytes per token: k and v, 32 layers, 8 kv heads x 128
LLAMA_1B_BF16 = 2 * 16 * 8 * 64 * 2
PAGE = dict(page_size=16, kv_cache_memory=None)


def test_the_pool_takes_what_the_fraction_leaves_less_the_scratch_page():
    plan = plan_kv_cache(
        n_slots=256, max_ctx=None, model_max_ctx=131072, bytes_per_token=LLAMA_8B_BF16, **PAGE, **H100
    )
    budget = int(0.9 * 80 * GIB) - 1 * GIB - 2 * GIB
    assert plan.budget_bytes == budget
    assert plan.pool.n_pages == budget // (16 * LLAMA_8B_BF16) - 1
    assert plan.kv_bytes == (plan.pool.n_pages + 1) * 16 * LLAMA_8B_BF16 <= budget
    # the old per-slot cache held 256 slots x 4096 tokens of llama-8b only in 138 GB: the pool
    # serves 256 slots in what is there, one request of the model's whole context fitting
    assert plan.max_ctx == min(131072, plan.pool.n_pages * 16)


def test_pages_are_capped_at_what_the_slots_can_use():
    plan = plan_kv_cache(
        n_slots=4, max_ctx=2048, model_max_ctx=131072, bytes_per_token=LLAMA_1B_BF16, **PAGE, **H100
    )
    assert plan.pool.n_pages == 4 * 2048 // 16 and plan.pool.full_requests == 4


def test_kv_cache_memory_in_bytes_or_as_a_fraction_of_free_memory():
    plan = plan_kv_cache(
        n_slots=64, max_ctx=4096, model_max_ctx=131072, bytes_per_token=LLAMA_1B_BF16,
        page_size=16, kv_cache_memory=GIB, **H100,
    )  # fmt: skip
    assert plan.kv_bytes <= GIB and plan.pool.n_pages == GIB // (16 * LLAMA_1B_BF16) - 1
    half = plan_kv_cache(
        n_slots=1024, max_ctx=4096, model_max_ctx=131072, bytes_per_token=LLAMA_1B_BF16,
        page_size=16, kv_cache_memory=0.5, **H100,
    )  # fmt: skip
    assert half.pool.n_pages == int(0.5 * 77 * GIB) // (16 * LLAMA_1B_BF16) - 1
    with pytest.raises(MemoryError, match="--kv-cache-memory 100.00 GiB does not fit"):
        plan_kv_cache(
            n_slots=1, max_ctx=16, model_max_ctx=16, bytes_per_token=1,
            page_size=16, kv_cache_memory=100 * GIB, **H100,
        )  # fmt: skip


def test_a_context_no_request_fits_says_what_would():
    with pytest.raises(MemoryError) as err:
        plan_kv_cache(
            n_slots=32, max_ctx=131072, model_max_ctx=131072, bytes_per_token=LLAMA_8B_BF16,
            page_size=16, kv_cache_memory=GIB, **H100,
        )  # fmt: skip
    text = str(err.value)
    assert "one request of --max-ctx 131072 needs 8192" in text and "--kv-cache-memory" in text
    assert "lower --max-ctx" in text and "--gpu-memory-fraction 0.9" in text


def test_nothing_fits_and_bad_fractions():
    with pytest.raises(MemoryError, match="--max-ctx"):
        plan_kv_cache(
            n_slots=32, max_ctx=None, model_max_ctx=4096, bytes_per_token=LLAMA_8B_BF16, **PAGE,
            free_bytes=5 * GIB, total_bytes=80 * GIB, fraction=0.9, workspace_bytes=GIB,
        )  # fmt: skip
    with pytest.raises(ValueError, match="gpu-memory-fraction"):
        plan_kv_cache(
            n_slots=1, max_ctx=16, model_max_ctx=16, bytes_per_token=1, **PAGE,
            free_bytes=1, total_bytes=1, fraction=1.5, workspace_bytes=0,
        )  # fmt: skip
