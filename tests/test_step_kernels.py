"""The decode step's kernel count (bench/lab/step_kernels.py), so a regression shows in CI.

The count walks the static step on the meta device: aten operators through a dispatch mode,
Triton launches through device/step/triton_launch.py. The issue's bar is at most 12 kernels
per decoder layer for the layered step (--step-kernels layered: 4 GEMMs and 6 Triton kernels);
the fused step's five (test_fused_step.py) are the product's path up to 32 rows.
"""

from __future__ import annotations

import json

import pytest
import torch

from ringleader.bench.lab import step_kernels
from ringleader.bench.lab.step_kernels import KernelCounter, count_step
from ringleader.device.step.triton_attention import HAVE_TRITON

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


def test_the_counter_counts_kernels_not_views():
    x = torch.empty(4, 8, device="meta")
    with torch.no_grad(), KernelCounter() as c:
        y = x.view(8, 4).t()[1:]  # views: no kernel
        torch.empty(3, device="meta")  # allocation alone: no kernel
        z = (y + 1).float().sum()  # add, sum (float of fp32 is a no-op)
        torch.nn.functional.linear(x, torch.empty(5, 8, device="meta"))  # one mm
    assert c.counts == {"aten.add": 1, "aten.sum": 1, "aten.mm": 1}, c.counts
    assert z.shape == ()


@needs_triton
def test_layered_step_kernels_per_layer_at_most_12():
    fused = count_step("tiny", bucket=1, n_slots=4, max_ctx=128, step_kernels="layered")
    assert fused["fused"] and fused["kernels_per_layer"] <= 12, fused["by_kind"]
    kinds = fused["by_kind"]
    assert kinds["aten.mm"] == 4  # qkv, o, gate_up, down
    for name in ("_add_rms_norm_kernel", "_rope_store_kv_kernel", "_silu_mul_kernel"):
        assert "triton." + name in kinds, kinds
    assert kinds["triton._add_rms_norm_kernel"] == 2
    # the step around the layers: embedding, final norm, lm_head, sampling (one Triton hash)
    assert fused["kernels_outside_layers"] <= 80, fused["outside_layers_by_kind"]
    assert fused["outside_layers_by_kind"]["triton._counter_uniform_kernel"] == 1
    plain = count_step("tiny", bucket=1, n_slots=4, max_ctx=128, attention="torch")
    assert plain["kernels_per_layer"] > 3 * fused["kernels_per_layer"]  # the counter sees torch ops


@needs_triton
def test_sampling_is_sized_by_the_bucket_not_the_slots():
    for bucket, n_slots, rows in ((1, 256, 1), (8, 256, 8), (16, 4, 4)):
        r = count_step("tiny", bucket=bucket, n_slots=n_slots, max_ctx=128)
        assert r["sampled_rows"] == rows, (bucket, n_slots, r["sampled_rows"])


@needs_triton
def test_cli_writes_the_json(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert step_kernels.main(["--model", "tiny", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"kernels_per_layer", "kernels_per_step", "by_kind", "torch_path", "layered_path"} <= data.keys()
    assert data["step_kernels"] == "fused" and data["kernels_per_layer"] == 5
    assert sum(data["by_kind"].values()) == data["kernels_per_layer"]
    assert "kernels/layer" in capsys.readouterr().out
