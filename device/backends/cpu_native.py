"""Builds the CPU backend's C++ kernels for the machine they run on: the quantized matmul
(device/weights/cpu_quant_kernel.cpp) and the step's small kernels (device/step/cpu_step_kernels.cpp).

- ISA: chosen at compile time. "native" (-march=native, the default) builds for the machine that
  runs it. "avx2" leaves AVX-512 out, so an AVX-512 machine can build and measure what an
  AVX2-only one runs; "avx2-vnni" and "avx512" name those paths; "generic" is the compiler's
  baseline (the plain loops, what an Arm machine vectorizes by itself). RINGLEADER_CPU_ISA sets
  the default for a whole process (a server measured as an AVX2 machine would run it).
- Cache: ipc/native.py keys a build by source text and flags. "-march=native" names a different
  binary on a different CPU, so the CPU's flags are written into the source text as a comment:
  a cache shared between machines never hands one the other's library.
- Threads: OpenMP, linked against the libgomp.so.1 torch ships (torch/lib), so a kernel's
  parallel regions run on torch's own pool and follow torch.set_num_threads on the calling
  thread (cpu_threads.py sizes it). A torch without one beside it gets the compiler's runtime:
  then two pools exist (`OPENMP_NOTE` says which).
- Rounding: -ffp-contract=off everywhere: no build fuses a * b + c where the source rounds twice,
  so every ISA's build quantizes activations to the same codes and the pointwise kernels round as
  torch's elementwise ops do.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from ringleader.device.backends.cpu_features import cpu_features
from ringleader.ipc.native import NativeBuildError, build_library, find_compiler

ISA_ENV = "RINGLEADER_CPU_ISA"
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "native": ("-march=native",),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx2-vnni": ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mavx2", "-mf16c"),
    "generic": (),
}
# the /proc/cpuinfo flags each isa's build needs ("native" and "generic" run anywhere)
ISA_CPU_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx2-vnni": ("avx2", "fma", "f16c", "avx_vnni"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "avx2", "f16c"),
}
BASE_FLAGS = (
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-ffp-contract=off",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
)

_TORCH_LIB = Path(torch.__file__).parent / "lib"
TORCH_GOMP = _TORCH_LIB / "libgomp.so.1"
if TORCH_GOMP.is_file():
    OPENMP_NOTE = f"linked against torch's {TORCH_GOMP}: one OpenMP pool, torch's"
    OPENMP_LINK: tuple[str, ...] = (
        f"-L{_TORCH_LIB}",
        "-Wl,--push-state,--no-as-needed",
        "-l:libgomp.so.1",
        "-Wl,--pop-state",
        f"-Wl,-rpath,{_TORCH_LIB}",
    )
else:
    OPENMP_NOTE = (
        "torch ships no libgomp.so.1 beside it: the kernels use the compiler's own OpenMP runtime "
        "(a second thread pool beside torch's; torch.set_num_threads may not reach it)"
    )
    OPENMP_LINK = ()


def default_isa() -> str:
    """RINGLEADER_CPU_ISA when set (checked), else "native"."""
    isa = os.environ.get(ISA_ENV, "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={isa!r}: one of {', '.join(ISA_FLAGS)}")
    return isa


def isa_runs_here(isa: str) -> bool:
    """Whether code built for `isa` can run on this CPU."""
    if isa in ("native", "generic"):
        return True
    return platform.machine() in ("x86_64", "AMD64") and set(ISA_CPU_FLAGS[isa]) <= cpu_features().flags


def _base_flags() -> tuple[str, ...]:
    # clang's -fopenmp means its own libomp (__kmpc_* calls): ask it for libgomp's entry points
    clang = "clang" in Path(find_compiler()).name
    return (*BASE_FLAGS, "-fopenmp=libgomp") if clang else BASE_FLAGS


def build_for_this_cpu(name: str, source: Path, isa: str | None = None) -> Path:
    """The shared library of `source` for `isa` (default: default_isa()) on this CPU, built once
    and cached. A compiler that cannot target this CPU natively builds its generic baseline."""
    isa = isa or default_isa()
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown isa {isa!r}: one of {', '.join(ISA_FLAGS)}")
    cpu = cpu_features()
    text = f"// built for {cpu.machine} {cpu.model}: {' '.join(sorted(cpu.flags))}\n" + source.read_text()
    try:
        return build_library(name, text, (*_base_flags(), *ISA_FLAGS[isa], *OPENMP_LINK))
    except NativeBuildError as exc:
        if isa != "native":
            raise NativeBuildError(
                f"the C++ compiler rejected {name} for isa={isa!r} (flags {' '.join(ISA_FLAGS[isa])}): {exc}"
            ) from None
        return build_library(name, text, (*_base_flags(), *OPENMP_LINK))
