"""Backends: where the scheduler and the model step run.  hostctl opens one through open_backend()."""

from __future__ import annotations

from ipc.backend import Backend


def open_backend(
    model: str = "tiny",
    *,
    device: str = "auto",
    scheduler: str | None = None,
    launch: str = "auto",
    **options,
) -> Backend:
    """device: auto | cpu | cuda.  scheduler (CUDA only): device | host.  launch (device
    scheduler only): resident | pump | auto (resident, else pump; the only mode that falls back)."""
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    if device == "cpu":
        if scheduler not in (None, "host"):
            raise ValueError("the cpu backend schedules on a host thread; --scheduler device needs CUDA")
        from device.backends.cpu import CpuBackend

        if options.pop("trace_path", None):
            raise ValueError("--trace records the CUDA device timeline; the cpu backend has none")
        options.pop("gpu_memory_fraction", None)
        return CpuBackend(model, **options)
    if device == "cuda":
        from device.backends.cuda import CudaBackend

        return CudaBackend(
            model,
            scheduler=scheduler or "device",
            launch=launch,
            **{k: v for k, v in options.items() if v is not None},
        )
    raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False
