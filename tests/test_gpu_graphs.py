"""On a GPU (skipped without one, or without cuda-bindings): the scheduler module loads, and each
bucket's captured step graph may sit in a conditional body, replays alone, and matches the eager
static step, fp32 near-exactly and bf16 within ringleader.bench.lab.bringup_checks.LOGIT_TOLERANCE."""

import importlib.util

import pytest
import torch

from ringleader.bench.lab.bringup_checks import LOGIT_TOLERANCE, check_graphs, check_module

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cuda.bindings") is None,
    reason="needs a CUDA GPU and cuda-bindings",
)


@gpu
def test_the_scheduler_module_loads_with_every_kernel():
    f = check_module()
    assert f["ok"] and f["loaded_from"] == "cubin", f
    assert all(k["spill_bytes"] == 0 for k in f["kernels"].values())


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_match_the_eager_step(dtype):
    f = check_graphs(dtype)
    assert f["embeddable"], f["nodes"]
    assert f["replay_alone_ok"], "a bucket replayed alone wrote a token or failed"
    assert f["logit_rel_err"] <= LOGIT_TOLERANCE[dtype], f
    assert f["kv_rel_err"] <= LOGIT_TOLERANCE[dtype], f
    assert f["greedy_rows_decided"] > 10 and f["greedy_rows_mismatched"] == 0, f
    assert len(f["buckets_run"]) >= 3 and f["all_finished"], f
