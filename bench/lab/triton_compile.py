"""One specialization compiled for its arch with triton.compile (a stand-in driver names the
target; nothing touches a GPU), and what the CUBIN uses: registers, spills and shared memory from
cuobjdump, checked against the arch's SM."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import io
import multiprocessing
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ringleader.bench.lab.triton_specializations import WARP_SIZE, Specialization
from ringleader.device.step import triton_attention

if triton_attention.HAVE_TRITON:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource
    from triton.runtime.driver import driver as triton_driver

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
