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


# ---- the KV cache plan ---------------------------------------------------------------------
H100 = dict(free_bytes=79 * GIB, total_bytes=80 * GIB, fraction=0.9, workspace_bytes=2 * GIB)
LLAMA_8B_BF16 = 2 * 32 * 8 * 128 * 2  # bytes per token: k and v, 32 layers, 8 kv heads x 128
LLAMA_1B_BF16 = 2 * 16 * 8 * 64 * 2


def test_a_fitting_cache_is_planned_as_asked():
    plan = plan_kv_cache(
        n_slots=32, max_ctx=2048, model_max_ctx=131072, bytes_per_token=LLAMA_1B_BF16, **H100
    )
    assert plan.max_ctx == 2048 and plan.kv_bytes == 33 * 2048 * LLAMA_1B_BF16
    assert plan.budget_bytes == int(0.9 * 80 * GIB) - 1 * GIB - 2 * GIB


def test_the_review_case_does_not_fit_and_says_what_would():
    # 256 slots x 4096 tokens of llama-8b in bf16: about 138 GB, more than any H100 holds
    with pytest.raises(MemoryError) as err:
        plan_kv_cache(n_slots=256, max_ctx=4096, model_max_ctx=131072, bytes_per_token=LLAMA_8B_BF16, **H100)
    text = str(err.value)
    assert "256 slots x 4096 tokens" in text and "128.50 GiB" in text
    budget = int(0.9 * 80 * GIB) - 3 * GIB
    assert f"at most {budget // (4096 * LLAMA_8B_BF16) - 1} slots fit" in text
    assert f"at most {budget // (257 * LLAMA_8B_BF16)} tokens per slot" in text
    assert "--gpu-memory-fraction 0.9" in text


def test_an_unset_context_takes_what_fits_capped_by_the_model():
    plan = plan_kv_cache(
        n_slots=32, max_ctx=None, model_max_ctx=131072, bytes_per_token=LLAMA_8B_BF16, **H100
    )
    assert plan.max_ctx % 256 == 0 and plan.kv_bytes <= plan.budget_bytes
    assert (plan.max_ctx + 256) * 33 * LLAMA_8B_BF16 > plan.budget_bytes  # the longest that fits
    small = plan_kv_cache(n_slots=4, max_ctx=None, model_max_ctx=4096, bytes_per_token=1024, **H100)
    assert small.max_ctx == 4096


def test_nothing_fits_and_bad_fractions():
    with pytest.raises(MemoryError, match="no KV cache fits"):
        plan_kv_cache(
            n_slots=32,
            max_ctx=None,
            model_max_ctx=4096,
            bytes_per_token=LLAMA_8B_BF16,
            free_bytes=5 * GIB,
            total_bytes=80 * GIB,
            fraction=0.9,
            workspace_bytes=GIB,
        )
    with pytest.raises(ValueError, match="gpu-memory-fraction"):
        plan_kv_cache(
            n_slots=1,
            max_ctx=16,
            model_max_ctx=16,
            bytes_per_token=1,
            free_bytes=1,
            total_bytes=1,
            fraction=1.5,
            workspace_bytes=0,
        )
