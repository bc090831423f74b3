"""How one request's tokens are chosen and when it stops: the one type that carries these
settings from the client's generate call, through the protocol decoder and the host's request
table, to the SQ entry the device reads (ringleader.ipc.rings.SubmissionQueue.push).

It judges only what holds whatever the model: the float fields must fit the ring's float32 and
their ranges (FLOAT_RANGES, checked by check_float_field, which the protocol decoder and the
HTTP gateway call too), so a value no server could run is refused in the caller's process.  What
depends on the model or the server's limits (max_tokens, top_k, token ids) is judged by the
server's decoder (ringleader.ipc.protocol), which answers with a `done` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

# top_k's upper bound: the device sampler draws top-k and top-p from this many candidates
# (device/model/sampling.py), so its cost does not grow with the vocabulary
MAX_TOP_K = 1024

# The largest finite float32 (numpy.finfo(numpy.float32).max): the SQ entry and the slot hold
# temperature and top_p as float32 (ipc/layout.py), where anything larger becomes +inf.
FLOAT32_MAX = 3.4028234663852886e38


def clipped_repr(value: Any, limit: int = 60) -> str:
    """repr() clipped so hostile values cannot blow up an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class FloatRange:
    low: float
    high: float
    low_open: bool = False  # (low, high] instead of [low, high]

    def __contains__(self, number: float) -> bool:
        above_low = self.low < number if self.low_open else self.low <= number
        return above_low and number <= self.high

    def __str__(self) -> str:
        return ("(" if self.low_open else "[") + f"{self.low:.8g}, {self.high:.8g}]"


# The one statement of the float fields' ranges; the protocol, the gateway and SamplingParams all
# check through check_float_field.  temperature follows vLLM (>= 0, no upper bound of its own; 0
# is greedy) rather than OpenAI's documented 0..2, since vLLM and OpenAI's own servers accept more
# and a vllm-serve user's temperature 3 must not become a 400: its only bound is float32's.
FLOAT_RANGES: dict[str, FloatRange] = {
    "temperature": FloatRange(0.0, FLOAT32_MAX),
    "top_p": FloatRange(0.0, 1.0, low_open=True),
}


def check_float_field(name: str, value: Any) -> float:
    """`value` as a float if it is a valid value of the float sampling field `name` (a real number,
    not a bool, finite, in FLOAT_RANGES[name], so it fits float32); else ValueError whose message
    starts with "<name>: "."""
    allowed = FLOAT_RANGES[name]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: must be a number in {allowed}, got {clipped_repr(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        number = math.inf
    if number not in allowed:  # NaN and the infinities are in no range
        raise ValueError(f"{name}: must be a finite number in {allowed}, got {clipped_repr(value)}")
    return number


@dataclass(frozen=True, slots=True)
class SamplingParams:
    # None: the rest of the context (max_context - prompt length), at most the server's
    # --default-max-tokens; the server turns it into an int before the request reaches the ring
    max_tokens: int | None = None
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1: off
    top_k: int = 0  # 0: off; at most MAX_TOP_K
    seed: int | None = (
        None  # None: the server draws one (a seeded request samples the same under any batching)
    )
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS, unless ignore_eos
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in FLOAT_RANGES:
            check_float_field(name, getattr(self, name))

    def with_seed(self, seed: int) -> SamplingParams:
        return dataclasses.replace(self, seed=seed)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        return dataclasses.replace(self, max_tokens=max_tokens)

    def wire_fields(self) -> dict[str, Any]:
        """These settings as fields of the generate message (docs/protocol.md)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }


WIRE_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
