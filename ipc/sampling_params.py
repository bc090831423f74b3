"""How one request's tokens are chosen and when it stops: the one type that carries these
settings from the client's generate call, through the protocol decoder and the host's request
table, to the SQ entry the device reads (ipc.rings.SubmissionQueue.push).

It holds values, not judgements: the client sends what it was given, the server's decoder
(ipc.protocol) is where a value is checked, so a hostile or mistaken value is refused in one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# top_k's upper bound: the device sampler draws top-k and top-p from this many candidates
# (device/model/sampling.py), so its cost does not grow with the vocabulary
MAX_TOP_K = 1024


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1: off
    top_k: int = 0  # 0: off; at most MAX_TOP_K
    seed: int | None = (
        None  # None: the server draws one (a seeded request samples the same under any batching)
    )
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS, unless ignore_eos
    ignore_eos: bool = False

    def with_seed(self, seed: int) -> SamplingParams:
        return dataclasses.replace(self, seed=seed)

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
