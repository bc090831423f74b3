"""Where every Triton kernel of the model step is launched, so the launches can be counted.

`launch(kernel, grid, *args, **meta)` runs `kernel[grid](*args, **meta)`. While a
`LaunchRecorder` is installed (bench/step_kernels.py, tests), the launch is recorded by the
kernel's name instead: a step can then be walked on the meta device, where no kernel can run,
and its aten operators and Triton launches counted together without a GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

_recorder: LaunchRecorder | None = None


class LaunchRecorder:
    """Counts Triton launches by kernel name while installed (a context manager; not nested)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

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


def launch(kernel: Any, grid: Sequence[int] | Callable[..., Sequence[int]], *args: Any, **meta: Any) -> None:
    """kernel[grid](*args, **meta), or only recorded while a LaunchRecorder is installed."""
    if _recorder is not None:
        _recorder.counts[kernel_name(kernel)] += 1
        return
    kernel[grid](*args, **meta)
