"""The start-up log of a model's load, a phase at a time: an INFO line as a phase begins and one
with its time as it ends, so that the silent seconds of a load (a GGUF file's metadata, its
tensors, the int4 repacking for the kernels, a preset's random weights) say what they are."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

log = logging.getLogger("ringleader.load")


@contextlib.contextmanager
def load_phase(what: str) -> Iterator[None]:
    """Logs `what...` now and `what: N.N s` once the block ends (nothing more if it raises: the
    error says the rest)."""
    log.info("%s...", what)
    start = time.monotonic()
    yield
    log.info("%s: %.1f s", what, time.monotonic() - start)
