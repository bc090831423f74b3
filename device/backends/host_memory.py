"""All scheduler arrays in one block of ordinary host memory: the CPU backend's shared memory.

Also builds the RlContext pointer table that sched_step() receives.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ringleader.ipc import layout
from ringleader.ipc.automaton import GrammarArena
from ringleader.ipc.rings import (
    HostRings,
    RingConfig,
    aligned_host_buffer,
    map_arrays,
    plan_memory,
    write_config,
)


def context_table(addresses: dict[str, int]) -> ctypes.Array:
    """RlContext: one pointer per ringleader.ipc.layout.ARRAYS entry, in order."""
    table = (ctypes.c_uint64 * len(layout.ARRAYS))()
    for i, (name, _, _) in enumerate(layout.ARRAYS):
        table[i] = addresses[name]
    return table


class HostMemory:
    def __init__(self, cfg: RingConfig, pinned=None):
        """pinned: a factory (nbytes -> object with .array, a uint8 numpy view) for page-locked
        memory, which the CUDA host-scheduled baseline copies to and from asynchronously."""
        self.config = cfg
        plan = plan_memory(cfg, {name for name, _, _ in layout.ARRAYS})
        self._pinned = pinned(plan.total) if pinned is not None else None
        self._buffer = self._pinned.array if self._pinned is not None else aligned_host_buffer(plan.total)
        self.arrays: dict[str, np.ndarray] = map_arrays(self._buffer, plan, cfg)
        write_config(self.arrays["cfg"], cfg)
        ctl = self.arrays["ctl"][0]
        ctl["magic"], ctl["version"] = layout.MAGIC, layout.LAYOUT_VERSION
        self._context = context_table({n: a.ctypes.data for n, a in self.arrays.items()})
        self.rings = HostRings(self.arrays, cfg)
        self.rings.grammar = GrammarArena(cfg.grammar_words, self.write_grammar)

    def write_grammar(self, offset: int, words: np.ndarray) -> None:
        """An automaton into the scheduler's grammar array (GrammarArena's writer)."""
        self.arrays["grammar"][offset : offset + len(words)] = words

    @property
    def context_address(self) -> int:
        return ctypes.addressof(self._context)
