"""Where every Triton kernel of the model step is launched, so the launches can be counted.

`launch(kernel, grid, *args, **meta)` runs `kernel[grid](*args, **meta)`. While a
`LaunchRecorder` is installed (bench/lab/step_kernels.py, bench/lab/triton_aot.py, tests), the launch is
recorded by the kernel's name instead: a step can then be walked on the meta device, where no
kernel can run, and its aten operators and Triton launches counted together without a GPU.
A recorder given `on_launch` also hands each launch over whole (kernel object, grid, args,
meta), which is what bench/lab/triton_specializations.py needs to derive the specialization Triton
would compile for it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

_recorder: LaunchRecorder | None = None

Grid = Sequence[int] | Callable[..., Sequence[int]]


class Launch(NamedTuple):
    """One recorded launch, as `launch` received it."""

    kernel: Any  # the JITFunction (or InterpretedFunction under TRITON_INTERPRET=1)
    grid: Grid
    args: tuple[Any, ...]
    meta: dict[str, Any]  # constexpr keywords and launch options (num_warps, ...)


class LaunchRecorder:
    """Counts Triton launches by kernel name while installed (a context manager; not nested).

    on_launch: called with every Launch as well, in launch order (after it is counted).
    """

    def __init__(self, on_launch: Callable[[Launch], None] | None = None) -> None:
        self.counts: Counter[str] = Counter()
        self.on_launch = on_launch

    def __enter__(self) -> LaunchRecorder:
        global _recorder
        if _recorder is not None:
            raise RuntimeError("a LaunchRecorder is already installed")
        _recorder = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _recorder
        _recorder = None


def kernel_name(kernel: Any) -> str:
    fn = getattr(kernel, "fn", kernel)  # JITFunction / InterpretedFunction wrap the Python function
    return getattr(fn, "__name__", type(kernel).__name__)


def launch(kernel: Any, grid: Grid, *args: Any, **meta: Any) -> None:
    """kernel[grid](*args, **meta), or only recorded while a LaunchRecorder is installed."""
    if _recorder is not None:
        _recorder.counts[kernel_name(kernel)] += 1
        if _recorder.on_launch is not None:
            _recorder.on_launch(Launch(kernel, grid, args, meta))
        return
    kernel[grid](*args, **meta)


def pdl_supported(device: Any) -> bool:
    """Whether kernels launched for `device` use programmatic dependent launch (PDL): a CUDA
    device of compute capability 9.0 or newer, not under the Triton interpreter (which has no
    griddepcontrol), unless RINGLEADER_PDL=0 turns it off.

    A PDL kernel takes USE_PDL=True (a constexpr: `gdc_wait()` before its first read of what an
    earlier kernel wrote, `gdc_launch_dependents()` once the next kernel may start) and the
    launch option launch_pdl=True (`pdl_meta`); the next kernel's weight loads then overlap
    this one's tail. Every kernel of the fused step waits before it reads or writes activations,
    so the chain stays ordered even where a kernel in it was launched without PDL."""
    import os

    if os.environ.get("RINGLEADER_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    dev = getattr(device, "type", str(device))
    if dev != "cuda":
        return False
    import torch

    index = getattr(device, "index", None)
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_meta(enabled: bool) -> dict[str, Any]:
    """The constexpr and launch option of a PDL-aware kernel: {"USE_PDL": .., "launch_pdl": ..}."""
    return {"USE_PDL": enabled, "launch_pdl": enabled}
