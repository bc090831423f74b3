"""Backends: where the scheduler and the model step run.  hostctl opens one through open_backend()."""

from __future__ import annotations

from device.engine_config import EngineConfig
from ipc.backend import Backend


def open_backend(config: EngineConfig | str | None = None, /, **fields) -> Backend:
    """config: an EngineConfig, or a model spec (default: EngineConfig's), with fields by name on
    top: open_backend("tiny", device="cpu", n_slots=8).  device auto picks cuda when torch sees a
    GPU; see EngineConfig.resolved() for what each device fills in."""
    cfg = EngineConfig.of(config, **fields).resolved()
    if cfg.device == "cpu":
        from device.backends.cpu import CpuBackend

        return CpuBackend(cfg)
    from device.backends.cuda import CudaBackend

    return CudaBackend(cfg)
