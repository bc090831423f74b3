"""The one interface through which hostctl reaches a device backend.

A backend owns the model, the scheduler and the shared memory; hostctl sees only the host-shared
rings (ringleader.ipc.rings.HostRings) and these methods.  hostctl never chooses what runs in a step.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ringleader.ipc.histogram import HistogramSnapshot

if TYPE_CHECKING:  # a type only: importing the rings builds their native atomics
    from ringleader.ipc.request_extensions import ChatEncoder, DetokenizerFactory
    from ringleader.ipc.rings import HostRings


class TextEncoder(Protocol):
    """What the host asks of a model's tokenizer: a prompt's text to token ids (the device's
    tokenizers, ringleader.device.text.tokenizer.Tokenizer, offer this and more)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class Detokenizer(Protocol):
    """One request's token ids to text as they stream: push returns only newly completed text
    (never half a character), flush what was held back when the request ends."""

    def push(self, token_ids: int | Iterable[int]) -> str: ...

    def flush(self) -> str: ...


@dataclass
class ModelInfo:
    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    tokenizer: TextEncoder | None = None  # None: the model serves token ids only
    # one per request that wants text, decoding as it asked (skip_special_tokens, ...)
    new_detokenizer: DetokenizerFactory | None = None
    # one token id's own text (logprobs name each token and alternative by it); None: no tokenizer
    token_text: Callable[[int], str] | None = None
    # chat turns -> prompt ids through the model's chat template (ValueError naming the fault);
    # None: the model has no template
    encode_chat: ChatEncoder | None = None
    # per token id, the bytes it adds to the text (None: a special token), built on first call:
    # what structured output's constraints compile against; None: the model has no tokenizer
    token_bytes: Callable[[], Sequence[bytes | None]] | None = None
    extra: dict = field(default_factory=dict)


class EngineDead(RuntimeError):
    """The device side stopped making progress; every in-flight request must end."""


class Backend(abc.ABC):
    rings: HostRings
    model: ModelInfo
    description: dict  # device, scheduler placement, launch mode, dtype ... for stats and bench

    @abc.abstractmethod
    def start(self) -> None:
        """Starts the scheduler loop; returns once it is running."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Doorbell: the host just published SQ entries (a no-op where the device polls)."""

    @abc.abstractmethod
    def wait_for_events(self, timeout: float) -> None:
        """Blocks until CQ events may be ready or `timeout` seconds pass."""

    @abc.abstractmethod
    def failure(self) -> str | None:
        """None while healthy; otherwise why the engine is dead."""

    @abc.abstractmethod
    def stats(self, timeline_after_seq: int = 0) -> dict:
        """Device-side figures: counters, heartbeat age, step time and bubbles where measured.
        timeline_after_seq: a backend with a device timeline (CUDA's trace ring) summarises only
        the steps whose seq (step + 1) is above it, so a reader that passes the `steps` counter
        it read earlier gets the figures of the steps since; one without a timeline ignores it."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Sets shutdown, waits for the scheduler to exit, frees device memory."""

    def thread_ids(self) -> dict[str, int]:
        """Native ids of the backend's live host threads by name (for per-thread CPU time)."""
        return {}

    def step_histograms(self) -> dict[str, HistogramSnapshot]:
        """Histograms of the scheduler's steps, for the metrics exporter (docs/metrics.md), by
        name: sched_critical_s, sched_overlapped_s, bubble_s, tokens_per_step; a backend leaves
        out what it does not measure.  Safe from any thread, before start() and after stop()."""
        return {}
