"""The model step's Triton kernels compiled ahead of time for sm_90 (bench/lab/triton_aot.py), no GPU.

Every product step shape (and the int4 matmul of GGUF weights, per model's projections, and the
null model's one-launch step) is
walked on the meta device, each launch's specialization derived with Triton's own binder, and
every distinct specialization compiled for sm_90, with the installed Triton and with the GPU
image's (3.6.0, bench/lab/gpu_image_toolchain.py): the test fails
on a compile error, a spill or a block that does not fit the SM. The derivation is checked
against Triton's launcher itself (JITFunction.run up to its compile hook, with a stand-in
driver), and the register / spill numbers against the -v log of Triton's own ptxas run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ringleader.bench.lab import (
    gpu_image_toolchain,
    triton_aot,
    triton_compile,
    triton_specializations,
    triton_step_shapes,
)
from ringleader.bench.lab.step_kernels import count_step
from ringleader.bench.lab.triton_compile import max_warps_for_registers, parse_res_usage
from ringleader.device.null import triton_null_step
from ringleader.device.sampling import triton_sample_row
from ringleader.device.sampling import triton_sampler as triton_sampling
from ringleader.device.step import fused_projections, triton_attention, triton_fused
from ringleader.device.step.triton_attention import HAVE_TRITON
from ringleader.device.step.triton_launch import Launch, LaunchRecorder, launch
from ringleader.device.weights import triton_quant_matmul
from tests.conftest import fetched

REPO = Path(__file__).resolve().parents[1]

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton import knobs

    @triton.jit(do_not_specialize=["n_unspecialized"])
    def _probe_kernel(x_ptr, y_ptr, n, n_unspecialized, stride, scale, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        ok = offs < n + n_unspecialized
        x = tl.load(x_ptr + offs * stride, mask=ok, other=0.0)
        tl.store(y_ptr + offs, x * scale, mask=ok)


KERNEL_MODULES = (
    triton_attention,
    triton_fused,
    fused_projections,
    triton_sampling,
    triton_sample_row,
    triton_quant_matmul,
    triton_null_step,
)


def launched_kernel_names() -> set[str]:
    """Every kernel a `launch(...)` call in the Triton modules can start, read from the source."""
    names = set()
    for module in KERNEL_MODULES:
        names |= set(re.findall(r"\blaunch\(\s*(\w+)\s*,", Path(module.__file__).read_text()))
    return names


def test_res_usage_parsing():
    text = """
Resource usage:
 Common:
  GLOBAL:0
 Function helper:
  REG:8 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:360 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _kernel:
  REG:96 STACK:80 SHARED:1024 LOCAL:8 CONSTANT[0]:672 TEXTURE:0 SURFACE:0 SAMPLER:0
 Common:
  GLOBAL:11
"""
    usage = parse_res_usage(text, "_kernel")
    assert usage["REG"] == 96 and usage["STACK"] == 80 and usage["LOCAL"] == 8 and usage["CONSTANT[0]"] == 672
    assert parse_res_usage(text.replace(" Function helper:\n  REG:8", " Other:\n  X:8"), "x")["REG"] == 96
    with pytest.raises(ValueError):
        parse_res_usage(text, "missing")  # two functions, neither the one asked for
    assert max_warps_for_registers(255) == 8 and max_warps_for_registers(32) == 64


def test_the_recorder_hands_over_each_launch():
    seen: list[Launch] = []

    def kernel():  # a stand-in: a recorded launch never runs it
        raise AssertionError("launched while recording")

    with LaunchRecorder(on_launch=seen.append) as rec:
        launch(kernel, (3,), 1, 2, BLOCK=16)
        launch(kernel, (3,), 4, BLOCK=32)
    assert rec.counts == {"kernel": 2}
    assert seen == [Launch(kernel, (3,), (1, 2), {"BLOCK": 16}), Launch(kernel, (3,), (4,), {"BLOCK": 32})]


def test_smollm2_shapes_are_the_files(smollm2_gguf):
    from ringleader.device.weights.gguf_checkpoint import config_from_gguf, open_gguf

    real = config_from_gguf(open_gguf(smollm2_gguf))
    ours = triton_step_shapes.SMOLLM2_CONFIG
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
    for name in (*shape, "head_dim", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(ours, name) == getattr(real, name), name
    assert ours.rms_norm_eps == pytest.approx(real.rms_norm_eps)


def _launcher_view(kernel, launch_: Launch, target) -> dict:
    """What Triton's own JITFunction.run hands its compile for `launch_`, stopped at the
    jit_cache_hook before anything needs a GPU."""
    captured = []

    def hook(**kw):
        captured.append(kw["compile"])
        return True  # "handled": run() returns without compiling or launching

    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        with triton_compile.target_driver(target, device="aot-test"):
            assert kernel.run(*launch_.args, grid=launch_.grid, warmup=False, **launch_.meta) is None
    finally:
        knobs.runtime.jit_cache_hook = saved
        kernel.device_caches.pop("aot-test", None)  # the stand-in device's binder, not a real one
    (compile_,) = captured
    return compile_


@needs_triton
def test_specializations_are_the_launchers():
    launches: list[Launch] = []
    shapes = {s.name: s for s in triton_step_shapes.product_shapes()}
    # bf16 with split-K attention at 1 row, fp32 with "ieee" dots and one attention launch
    triton_step_shapes.walk_step(shapes["cuda-default/tiny/bfloat16"], 132, launches.append)
    triton_step_shapes.walk_step(shapes["bringup-backend"], 132, launches.append)
    # the int4 matmul: decode (split-K partials) and prefill blocks, 1 and 2 digits, both dtypes
    for quant in triton_step_shapes.quant_matmul_shapes():
        if quant.model == triton_step_shapes.SMOLLM2 or quant.n_digits == 2:
            small = dataclasses.replace(quant, projections=quant.projections[3:4], buckets=(1, 64))
            triton_step_shapes.walk_quant_matmuls(small, 132, launches.append)
    meta = dict(device="meta", dtype=torch.bfloat16)
    x = torch.empty(64, **meta)
    for x_arg, y_arg in ((x, torch.empty(64, **meta)), (x[1:], x[8:])):  # aligned; 2 B and 16 B in
        launches.append(Launch(_probe_kernel, (1,), (x_arg, y_arg, 16, 16, 1, 0.5), {"BLOCK": 16}))
    launches.append(Launch(_probe_kernel, (1,), (x, x, 1, 1, 3, 2.0), {"BLOCK": 32, "num_warps": 2}))

    target = triton_compile.GPUTarget("cuda", 90, 32)
    specializer = triton_specializations.Specializer(90)
    checked = set()
    for item in launches:
        ours = specializer.derive(item)
        if ours.identity() in checked:
            continue
        checked.add(ours.identity())
        theirs = _launcher_view(item.kernel, triton_specializations.launch_for_arch(item, 90), target)
        assert theirs["signature"] == ours.signature, ours.kernel
        assert theirs["constants"] == ours.constexprs, ours.kernel
        assert theirs["configs"] == [ours.attrs], ours.kernel
        options = json.loads(theirs["specialization_data"])["options"]
        assert options == json.loads(json.dumps(ours.options)), ours.kernel
    assert len(checked) >= 10

    probe = [specializer.derive(item).summary() for item in launches[-3:]]
    assert probe[0] == {
        "x_ptr": "*bf16 %16",
        "y_ptr": "*bf16 %16",
        "n": "i32 %16",
        "n_unspecialized": "i32",  # do_not_specialize: neither %16 nor == 1
        "stride": "=1",  # an int equal to 1 becomes a constant
        "scale": "fp32",
        "BLOCK": "=16",
    }
    assert probe[1]["x_ptr"] == "*bf16" and probe[1]["y_ptr"] == "*bf16 %16"  # a view's offset counts
    assert probe[2]["n"] == "=1" and probe[2]["n_unspecialized"] == "i32" and probe[2]["stride"] == "i32"
    assert specializer.derive(launches[-1]).options["num_warps"] == 2


@needs_triton
def test_every_product_kernel_compiles_for_sm90_without_spills(tmp_path, capsys):
    out = tmp_path / "aot.json"
    t0 = time.perf_counter()
    rc = triton_aot.main(["--arch", "sm_90", "--json", str(out)])
    wall = time.perf_counter() - t0
    data = json.loads(out.read_text())
    bad = [r for r in data["records"] if not r["ok"] or r["spills"]]
    assert rc == 0 and not bad, bad[:3]
    assert data["totals"]["failed"] == data["totals"]["spilled"] == 0
    assert data["totals"]["compiled"] == data["totals"]["specializations"] == len(data["records"]) > 0
    compiled = {r["kernel"] for r in data["records"]}
    # every kernel the step can launch, by the source and by the recorder on the step itself
    assert compiled == launched_kernel_names() == set(data["kernels_launched"])
    recorded = set()
    for kw in (dict(n_slots=4, max_ctx=128), dict(n_slots=1, max_ctx=4096)):  # one-launch and split-K
        recorded |= {
            k.removeprefix("triton.") for k in count_step("tiny", bucket=1, **kw)["by_kind"] if "triton." in k
        }
    assert recorded <= compiled and {"_ragged_attention_kernel", "_ragged_attention_split_kernel"} <= recorded
    used_by = {u.split("@")[0] for r in data["records"] for u in r["used_by"]}
    assert used_by == {s.name for s in triton_step_shapes.aot_shapes()}
    quant = [r for r in data["records"] if r["kernel"] == "_int4_matmul_kernel"]
    # decode blocks and split-K's float32 partials, 1 and 2 digits, bf16 and fp32 activations
    assert {(r["signature"]["x_ptr"].split()[0], r["signature"]["N_DIGITS"]) for r in quant} == {
        (x, d) for x in ("*bf16", "*fp32") for d in ("=1", "=2")
    }
    assert {r["signature"]["BLOCK_M"] for r in quant} == {"=16", "=32", "=64"}
    assert any(
        r["signature"]["x_ptr"].startswith("*bf16") and r["signature"]["y_ptr"].startswith("*fp32")
        for r in quant
    )
    null = [r for r in data["records"] if r["kernel"] == "_null_step_kernel"]
    # the null model's step: with and without its busy time, one to four programs' worth of blocks
    assert {r["signature"]["SPIN"] for r in null} == {"=False", "=True"}
    assert {r["signature"]["BLOCK"] for r in null} == {"=16", "=32", "=64"}
    assert all(r["regs"] > 0 and r["shared_bytes"] is not None for r in data["records"])
    assert "sm_90:" in capsys.readouterr().out
    print(f"sm_90 ahead-of-time compile: {len(data['records'])} specializations in {wall:.1f} s")


def test_every_product_kernel_compiles_for_sm90_with_the_gpu_images_triton(tmp_path):
    """The same compile with the Triton the GPU machines have (3.6.0; the installed one may be
    newer), in a child process with that Triton first on its path."""
    site = fetched(
        f"Triton {gpu_image_toolchain.TRITON}",
        gpu_image_toolchain.cached_triton,
        gpu_image_toolchain.fetch_triton,
    )
    out = tmp_path / "aot.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    cmd = [sys.executable, "-m", "ringleader.bench.lab.triton_aot", "--arch", "sm_90", "--json", str(out)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text()) if out.exists() else {}
    assert data.get("triton_version") == gpu_image_toolchain.TRITON, r.stdout[-2000:] + r.stderr[-4000:]
    bad = [x for x in data["records"] if not x["ok"] or x["spills"]]
    assert r.returncode == 0 and not bad, bad[:3]
    assert data["totals"]["compiled"] == data["totals"]["specializations"] > 0
    assert {x["kernel"] for x in data["records"]} == launched_kernel_names()


@needs_triton
def test_registers_and_spills_are_the_cubins(capfd):
    shape = next(s for s in triton_step_shapes.product_shapes() if s.name == "roofline/rows1")
    specs, _ = triton_specializations.collect_specializations([shape], {90: (132,)})
    attention = next(s for s in specs if s.kernel.startswith("_ragged_attention"))
    # 32 registers cannot hold an attention block: ptxas must spill, and the record must say so
    squeezed = dataclasses.replace(attention, options={**attention.options, "maxnreg": 32})
    result = triton_compile.compile_specialization(squeezed)
    assert result["regs"] == 32 and result["spills"] > 0 and not result["error"]

    # Triton's own ptxas run, its -v log shown (TRITON_DUMP_PTXAS_LOG), reports the same numbers
    fn = getattr(triton_attention, attention.kernel)
    target = triton_compile.GPUTarget("cuda", 90, 32)
    with (
        triton_compile.target_driver(target),
        knobs.nvidia.scope(),
        knobs.compilation.scope(),
    ):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True  # a cached CUBIN would skip ptxas
        src = triton_compile.ASTSource(fn, squeezed.signature, squeezed.constexprs, squeezed.attrs)
        capfd.readouterr()
        triton.compile(src, target=target, options=squeezed.options)
        log = capfd.readouterr().out
    assert f"Used {result['regs']} registers" in log, log[-2000:]
    assert f"{result['local_bytes']} bytes stack frame" in log
