"""The CPU backend's StepRunner (engine_loop.py): the eager model step, run on the engine thread
after the overlapped phase, on the step layout's zero-copy views of the scheduler's arrays."""

from __future__ import annotations

import contextlib
from collections.abc import Callable


class EagerStepRunner:
    overlaps_host = False  # one thread: the step runs after the overlapped phase, not beside it

    def __init__(self, step, step_layout, before_step: Callable[[], None] | None = None):
        """before_step: called on the engine thread before each step (the CPU backend sizes its
        thread team there, cpu_threads.py)."""
        self._step, self._layout = step, step_layout
        self._before_step = before_step

    def bound(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def launch(self) -> None:
        """Nothing to queue: finish() runs the step once the overlapped phase has published."""

    def finish(self) -> None:
        """The step the critical phase laid out, exactly: its bucket is its n_tokens."""
        if self._before_step is not None:
            self._before_step()
        self._step.run(int(self._layout.n_tokens.item()), self._layout)

    def cancel(self) -> None:
        """Not run: nothing reads a step's output after shutdown."""

    def timeline(self) -> None:
        """No device, no timeline: the step follows the scheduler on one thread."""

    stalled_reads = 0

    def release(self) -> None:
        """Nothing held beyond what the garbage collector frees."""
