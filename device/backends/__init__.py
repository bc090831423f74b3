"""Backends: where the scheduler and the model step run.  hostctl opens one through open_backend()."""
from __future__ import annotations

from ipc.backend import Backend


def open_backend(model: str = "tiny", *, device: str = "auto", scheduler: str | None = None,
                 launch: str = "resident", **options) -> Backend:
    """device: auto | cpu | cuda.  scheduler (CUDA only): device | host."""
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    if device == "cpu":
        if scheduler not in (None, "host"):
            raise ValueError("the cpu backend schedules on a host thread; --scheduler device needs CUDA")
        from device.backends.cpu import CpuBackend
        return CpuBackend(model, **options)
    if device == "cuda":
        raise NotImplementedError("the CUDA backend is not built yet (see issue: GPU backend)")
    raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False
