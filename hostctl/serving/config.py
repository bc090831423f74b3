"""ServerConfig: what shapes the host process's server (admission, limits, time-outs, the stop),
beside the engine's EngineConfig (device/engine_config.py).  Each default is written once, here:
the field defaults, and the one that differs per device in ServerConfig.resolved(), which says
why.  `ringleader serve` generates its server flags from these fields
(hostctl/commands/serve_flags.py); Server(backend, bind, config) takes one, or fields by name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ringleader.ipc import protocol


@dataclass(frozen=True)
class ServerConfig:
    max_queued: int = 4096  # requests held on the host while the rings are full; beyond: overloaded
    max_queued_tokens: int = 1 << 22  # prompt tokens held on the host; beyond: overloaded
    max_inflight_per_client: int = 1024  # accepted and not ended, per client; beyond: overloaded (0: no cap)
    # a request without its first token this long after arrival ends with code timeout (0 or None: no limit)
    max_queue_ms: float | None = 60_000
    # a generate without max_tokens runs to the end of the context, at most this many tokens (None: no cap)
    default_max_tokens: int | None = None
    # the largest max_tokens a request may ask for (None: the model's context)
    max_tokens_cap: int | None = None
    max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES  # the largest request frame: the wire's default
    # heartbeat stall that declares the engine dead (None: per device, resolved())
    watchdog_s: float | None = None
    # at a stop, how long requests in flight may finish (the stop takes <= this + 5 s)
    drain_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be at least 1 or None, got {self.default_max_tokens}")

    @classmethod
    def of(cls, config: ServerConfig | None = None, /, **fields) -> ServerConfig:
        """Keyword construction, as Server takes it: a config (or none), with fields given by name on top."""
        if config is None:
            return cls(**fields)
        return dataclasses.replace(config, **fields) if fields else config

    def resolved(self, device: str) -> ServerConfig:
        """This config for a backend on `device` (its description's: "cpu", or a GPU's name), with
        the default that differs per device filled in.  The one place it is written."""
        if self.watchdog_s is not None:
            return self
        # a CPU step of a big model can take seconds; a GPU step cannot
        return dataclasses.replace(self, watchdog_s=60.0 if device == "cpu" else 2.0)
