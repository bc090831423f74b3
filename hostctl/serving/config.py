"""ServerConfig: what shapes the host process's server (admission, limits, time-outs, the stop),
beside the engine's EngineConfig (device/engine_config.py).  Each default is written once, here:
the field defaults, and the one that differs per device in ServerConfig.resolved(), which says
why.  Each field `ringleader serve` sets declares its flag and help too (option(),
ringleader.ipc.config_options): the command line is generated from the fields
(hostctl/commands/serve_flags.py).  Server(backend, bind, config) takes one, or fields by name."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from ringleader.ipc import protocol
from ringleader.ipc.config_options import named, option

# the heartbeat stall that declares the engine dead where watchdog_s is None (resolved()): a CPU
# step of a big model can take seconds; a GPU step cannot
CPU_WATCHDOG_S = 60.0
GPU_WATCHDOG_S = 2.0


# The fields with option() are `ringleader serve`'s options, in the order --help lists them; the
# others have no flag: a program that embeds the server sets them.
# fmt: off
@dataclass(frozen=True)
class ServerConfig:
    max_queued: int = option(
        4096, flag="--max-queue", type=int,
        help="requests held on the host when the rings are full; beyond: overloaded")
    max_queued_tokens: int = 1 << 22  # prompt tokens held on the host; beyond: overloaded
    max_inflight_per_client: int = option(  # accepted and not ended, per client
        1024, flag="--max-inflight-per-client", type=int,
        help="requests one client may have in flight; beyond: overloaded (0: no cap)")
    max_queue_ms: float | None = option(  # None too: no limit
        60_000, flag="--max-queue-ms", type=float,
        help="a request still waiting for a batch slot this long after arrival ends with error "
        "code timeout; once its prefill has started it runs on (0: no limit)")
    default_max_tokens: int | None = option(
        None, flag="--default-max-tokens", type=int, metavar="N",
        help="a request without max_tokens (an OpenAI chat request without it, too) generates up "
        "to the rest of the model's context, at most N tokens (default: no cap)")
    # the largest max_tokens a request may ask for (None: the model's context)
    max_tokens_cap: int | None = None
    max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES  # the largest request frame: the wire's default
    watchdog_s: float | None = option(  # None: per device, resolved()
        None, flag="--watchdog-s", type=float,
        help="heartbeat stall that declares the engine dead "
        f"(default {GPU_WATCHDOG_S:g} on cuda, {CPU_WATCHDOG_S:g} on cpu)")
    drain_timeout_s: float = option(
        5.0, flag="--drain-timeout", type=float,
        help="on SIGINT/SIGTERM, seconds to let in-flight requests finish (the whole stop takes at "
        "most this + 5 s)")
    # fmt: on

    def __post_init__(self) -> None:
        """Refuses a value out of range, naming the field by its serve flag where it has one."""
        for name, low, none_means in (
            ("max_queued", 0, None),
            ("max_queued_tokens", 0, None),
            ("max_inflight_per_client", 0, None),  # 0: no cap
            ("default_max_tokens", 1, "no cap"),
            ("max_tokens_cap", 1, "the model's context"),
            ("max_frame_bytes", 1, None),
        ):
            value = getattr(self, name)
            if value is None and none_means:
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
                unless = f" (or unset: {none_means})" if none_means else ""
                raise ValueError(f"{named(ServerConfig, name)} must be an integer >= {low}{unless}, got {value!r}")
        for name, positive, none_means in (
            ("max_queue_ms", False, "no limit"),  # 0: no limit too
            ("watchdog_s", True, "per device"),
            ("drain_timeout_s", False, None),
        ):
            value = getattr(self, name)
            if value is None and none_means:
                continue
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < 0 or (positive and value == 0):
                unit = "ms" if name.endswith("_ms") else "seconds"
                shown = f"{value:g}" if ok or isinstance(value, float) else repr(value)
                raise ValueError(
                    f"{named(ServerConfig, name)} must be {'> 0' if positive else '>= 0'} {unit}, got {shown}"
                )

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
        return dataclasses.replace(self, watchdog_s=CPU_WATCHDOG_S if device == "cpu" else GPU_WATCHDOG_S)
