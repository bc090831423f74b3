"""The specialization of each Triton launch, as Triton's launcher derives it (3.6 and 3.9 alike):
JITFunction.run's binder and _pack_args for a target arch, with no driver; identical ones merged
across the step shapes that launch them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ringleader.bench.lab.triton_step_shapes import AotShape, walk
from ringleader.device.step import triton_attention
from ringleader.device.step.triton_launch import Launch, kernel_name

if triton_attention.HAVE_TRITON:
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

WARP_SIZE = 32  # every NVIDIA GPU
PDL_MIN_ARCH = 90  # programmatic dependent launch (griddepcontrol): Hopper on


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


def launch_for_arch(launch: Launch, arch: int) -> Launch:
    """The launch as a GPU of `arch` makes it: a PDL-aware kernel (USE_PDL) recorded off the GPU
    (where triton_launch.pdl_supported is False) uses PDL wherever the arch has it."""
    if "USE_PDL" not in launch.meta:
        return launch
    pdl = arch >= PDL_MIN_ARCH
    return launch._replace(meta={**launch.meta, "USE_PDL": pdl, "launch_pdl": pdl})


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
        launch = launch_for_arch(launch, self.arch)
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
    shapes: list[AotShape], sm_counts: dict[int, tuple[int, ...]]
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

            launched.update(walk(shape, sm, on_launch))
    return list(merged.values()), launched
