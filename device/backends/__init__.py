"""Backends: where the scheduler and the model step run.  hostctl opens one through open_backend()."""

from __future__ import annotations

from ringleader.device.engine_config import EngineConfig
from ringleader.ipc.backend import Backend


def open_backend(config: EngineConfig | str | None = None, /, **fields) -> Backend:
    """config: an EngineConfig, or a model spec (default: EngineConfig's), with fields by name on
    top: open_backend("tiny", device="cpu", n_slots=8).  device auto picks cuda when torch sees a
    GPU; see EngineConfig.resolved() for what each device fills in.  A chat_template
    (--chat-template) replaces the model's own here: a CpuBackend or CudaBackend made directly
    serves the model's."""
    from ringleader.device.backends.common import with_chat_template  # torch: only once a backend opens

    cfg = EngineConfig.of(config, **fields).resolved()
    backend: Backend
    if cfg.device == "cpu":
        from ringleader.device.backends.cpu import CpuBackend

        backend = CpuBackend(cfg)
    else:
        from ringleader.device.backends.cuda import CudaBackend

        backend = CudaBackend(cfg)
    # the backends build the model's own ModelInfo; --chat-template is put on it here, once for both
    backend.model = with_chat_template(backend.model, cfg.chat_template)
    return backend
