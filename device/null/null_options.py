"""The null model's options (`--model null`; device/null/null_model.py is the model), apart from
it so that EngineConfig checks them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from ringleader.device.text.tokenizer import ByteTokenizer

NULL_MODEL = "null"
NULL_PATTERNS = ("next", "repeat", "eos")
NULL_STEP_WAITS = ("spin", "sleep")
NULL_DEFAULT_VOCAB = 32000
NULL_VOCAB_RANGE = (ByteTokenizer.vocab_size, 1 << 24)  # the byte tokenizer's ids must fit
NULL_STEP_US_MAX = 10_000_000.0  # 10 s: anything longer is no step
NULL_MAX_CONTEXT = 8192  # the model's "limit": the CUDA backend's default context


@dataclass(frozen=True)
class NullOptions:
    """What `--model null` takes (serve --null-vocab, --null-step-us, --null-pattern,
    --null-step-wait)."""

    vocab_size: int = NULL_DEFAULT_VOCAB
    step_us: float = 0.0  # the step's fixed busy time (0: none)
    pattern: str = "next"
    # how the CPU spends the busy time: "spin" holds a core, as a CPU model's arithmetic does;
    # "sleep" gives it back, as a host waiting on a GPU's step does (CUDA always spins on the GPU)
    step_wait: str = "spin"

    def __post_init__(self) -> None:
        low, high = NULL_VOCAB_RANGE
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int):
            raise ValueError(f"--null-vocab must be an integer in [{low}, {high}], got {self.vocab_size!r}")
        if not low <= self.vocab_size <= high:
            raise ValueError(f"--null-vocab must be an integer in [{low}, {high}], got {self.vocab_size}")
        step = self.step_us
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 <= step <= NULL_STEP_US_MAX:
            raise ValueError(f"--null-step-us must be a number in [0, {NULL_STEP_US_MAX:g}], got {step!r}")
        if self.pattern not in NULL_PATTERNS:
            raise ValueError(
                f"--null-pattern must be one of {', '.join(NULL_PATTERNS)}, got {self.pattern!r}"
            )
        if self.step_wait not in NULL_STEP_WAITS:
            raise ValueError(
                f"--null-step-wait must be one of {', '.join(NULL_STEP_WAITS)}, got {self.step_wait!r}"
            )

    @property
    def step_ns(self) -> int:
        return round(self.step_us * 1000)
