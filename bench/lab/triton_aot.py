"""Every Triton kernel of the model step, compiled ahead of time for real GPU targets, no GPU.

The CUDA path compiles its Triton kernels on first use, on the GPU, inside the bring-up. A kernel
that fails to compile for a target, spills registers or wants more shared memory than the SM
has is found there, late. Here the product step (StaticStep.run with Triton attention and the
fused pointwise kernels, as the CUDA backend builds it) is walked on the meta device for every
shape the product and the bring-up run, and so is the int4 matmul of GGUF weights kept
quantized for each model's projections (triton_step_shapes.quant_matmul_shapes); each Triton
launch is intercepted (device/step/triton_launch.py), and the specialization the importable
Triton's launcher would compile for it is derived with Triton's own code (written against 3.6,
the GPU image's; 3.9 gives the same derivation):

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
path: `PYTHONPATH=$(python -c 'from ringleader.bench import gpu_image_toolchain as t; print(t.triton_site())')`.

    python -m ringleader.bench.lab.triton_aot --arch sm_90 --arch sm_87 --arch sm_80 --json PATH

prints kernel x arch (specializations, registers, spills, shared memory, warps) and exits 1
when any specialization fails to compile, spills, or does not fit the arch's SM.

Which n_splits split-K attention picks depends on the GPU's SM count (choose_splits), so each
arch is walked with the SM counts of its GPUs (ARCH_SM_COUNTS, or --sm-count).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ringleader.bench.lab.triton_compile import compile_all
from ringleader.bench.lab.triton_specializations import Specialization, collect_specializations
from ringleader.bench.lab.triton_step_shapes import AotShape, NullStepShape, StepShape, aot_shapes
from ringleader.bench.report import save_json
from ringleader.device.step import triton_attention

HAVE_TRITON = triton_attention.HAVE_TRITON
if HAVE_TRITON:
    import triton

SCHEMA = "ringleader-triton-aot/1"

# SMs of the GPUs of each arch (NVIDIA's data sheets); split-K attention sizes its grid by them:
# sm_90 H100 SXM / H200 132, H100 PCIe 114; sm_87 Jetson AGX Orin 64GB 16; sm_80 A100 108
ARCH_SM_COUNTS: dict[int, tuple[int, ...]] = {90: (132, 114), 87: (16,), 80: (108,)}
FALLBACK_SM_COUNTS = (triton_attention.DEFAULT_SM_COUNT,)


def parse_arch(text: str) -> int:
    """sm_90, sm_90a, sm90 or 90 -> 90."""
    m = re.fullmatch(r"(?:sm_?)?(\d+)a?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a CUDA arch: {text!r} (want e.g. sm_90)")
    return int(m.group(1))


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
    shapes: list[AotShape],
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
        for s in aot_shapes()
        if (not args.model or s.model in args.model)
        and (not args.config or any(c in s.name for c in args.config))
    ]
    if not shapes:
        print("no step shape matches --model / --config", file=sys.stderr)
        return 2
    if args.list:
        for s in shapes:
            if isinstance(s, StepShape):
                sizes = f"slots {s.n_slots} max_ctx {s.max_ctx} budget {s.token_budget}"
            elif isinstance(s, NullStepShape):
                sizes = f"slots {s.n_slots} budget {s.token_budget} step_us {s.step_us:g}"
            else:
                sizes = " ".join(f"{name} {n}x{k}" for name, n, k in s.projections)
            print(f"{s.name:32s} {s.model} {s.dtype} {sizes} buckets {list(s.buckets)}  ({s.origin})")
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
