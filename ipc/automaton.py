"""A compiled output constraint as the device reads it: a token automaton in int32 words, declared
once (the C header's RL_AUTO_* names come from here), and the arena the host places them in.

One automaton, at word offset `base` of the scheduler's `grammar` array (ipc/layout.py):

    header   HEADER words: n_states, initial, mask_words (W = ceil(vocab / 32)), n_masks,
             n_classes (C), vocab (the class map's length), and where the other tables start
             (word offsets from base)
    states   n_states records of STATE words: mask (which allowed-token bitmask), flags
             (ACCEPTING, TERMINAL)
    masks    n_masks bitmasks of W words: token t is allowed when bit t & 31 of word t >> 5 is
             set.  States with equal allowed sets share one (a JSON schema's hundreds of states
             have a few dozen distinct sets)
    classes  vocab words: each token's class.  Tokens that lead from every state to the same
             state (or are refused by the same states) are one class: a schema's automaton over
             SmolLM2's 49,152 tokens has 130-230 of them
    next     n_states x C words: state s, class c -> the next state; END where the class is an
             EOS (accepting states), or is not allowed there

Why classes: one next state per (state, allowed token) was 25 MB for a nested schema and 8 MB for
an object with one maxLength-30 string (each position of the string allows ~40,000 tokens, each
leading to the position its length reaches); the classes make those 0.7 and 0.2 MB, and the
device's step from a state is two dependent reads, not a search.

An accepting state allows the model's EOS ids (their next state END); one that allows nothing
else is TERMINAL: the scheduler ends the request as `stop` as soon as it gets there, without
spending a step on the EOS.  The step's sampler reads one mask per constrained sample row
(sample_mask: that mask's absolute word offset, -1 for a row without a constraint); the
scheduler reads the class map and the next table to advance a slot's state with its token
(device/sched/sched_grammar.h).

Ownership: the host writes an automaton's words (GrammarArena.place, through the backend's
writer: a host copy on the CPU, a device copy on CUDA, complete before it returns) before it
publishes the first SQ entry naming it; the device only reads them, and only for slots whose
request named them; the host reuses words only once every request that named them has its DONE.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

HEADER = (
    "n_states",
    "initial",
    "mask_words",
    "n_masks",
    "n_classes",
    "vocab",
    "states_at",
    "masks_at",
    "classes_at",
    "next_at",
)
STATE = ("mask", "flags")
ACCEPTING = 1
TERMINAL = 2
END = -(1 << 31)  # INT32_MIN: a next state no automaton has (EOS edges, and refused tokens)
NO_MASK = -1  # sample_mask of a row without a constraint
H = {name: i for i, name in enumerate(HEADER)}
S = {name: i for i, name in enumerate(STATE)}


def c_defines() -> list[str]:
    """The format's names for the C header (RL_AUTO_H_<field>, RL_AUTO_S_<field>, ...)."""
    lines = [f"#define RL_AUTO_H_{n.upper()} {i}" for i, n in enumerate(HEADER)]
    lines += [f"#define RL_AUTO_S_{n.upper()} {i}" for i, n in enumerate(STATE)]
    lines += [
        f"#define RL_AUTO_HEADER_WORDS {len(HEADER)}",
        f"#define RL_AUTO_STATE_WORDS {len(STATE)}",
        f"#define RL_AUTO_ACCEPTING {ACCEPTING}",
        f"#define RL_AUTO_TERMINAL {TERMINAL}",
        f"#define RL_AUTO_END ({END + 1} - 1)",
        f"#define RL_AUTO_NO_MASK ({NO_MASK})",
        "#define RL_NO_GRAMMAR 0xFFFFFFFFu",
    ]
    return lines


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class Automaton:
    """A packed automaton: its words, and what the bench and the logs say of it."""

    words: np.ndarray  # int32
    n_states: int
    n_masks: int
    n_classes: int

    @property
    def nbytes(self) -> int:
        return int(self.words.nbytes)


def pack_automaton(
    vocab_size: int,
    initial: int,
    tokens: Sequence[np.ndarray],
    next_states: Sequence[np.ndarray],
    accepting: Sequence[bool],
    eos_ids: Sequence[int],
) -> Automaton:
    """Packs states 0..n-1: state s allows tokens[s] (int, any order, none an EOS id) leading to
    next_states[s] (same length); accepting[s] adds the EOS ids (to END).  Tokens at or past
    vocab_size (the logits' width) are dropped."""
    n = len(tokens)
    W = mask_words(vocab_size)
    eos = np.array(sorted({int(e) for e in eos_ids if 0 <= int(e) < vocab_size}), dtype=np.int64)

    def row_of(s: int) -> np.ndarray:
        """Each token's next state from s (END: refused, or an EOS)."""
        tok = np.asarray(tokens[s], dtype=np.int64)
        keep = tok < vocab_size
        row = np.full(vocab_size, END, dtype=np.int64)
        row[tok[keep]] = np.asarray(next_states[s], dtype=np.int64)[keep]
        return row

    states = np.zeros((n, len(STATE)), dtype=np.int32)
    masks: list[np.ndarray] = []
    mask_of: dict[bytes, int] = {}
    signature = np.zeros(vocab_size, dtype=np.uint64)  # a hash of each token's next states
    for s in range(n):
        row = row_of(s)
        allowed = row != END
        flags = 0
        if accepting[s]:
            flags = ACCEPTING | (TERMINAL if not allowed.any() else 0)
            allowed[eos] = True
        bits = np.zeros(W * 32, dtype=np.uint8)
        bits[:vocab_size] = allowed
        mask = np.packbits(bits, bitorder="little").view(np.int32)
        mask_id = mask_of.setdefault(mask.tobytes(), len(masks))
        if mask_id == len(masks):
            masks.append(mask)
        states[s] = (mask_id, flags)
        # refused and EOS differ only in the mask, which the class need not tell apart
        signature = signature * np.uint64(0x100000001B3) + (row - END).astype(np.uint64)
    _, inverse = np.unique(signature, return_inverse=True)
    class_of = inverse.astype(np.int32).reshape(-1)
    n_classes = int(class_of.max()) + 1 if vocab_size else 0
    first = np.zeros(n_classes, dtype=np.int64)
    first[class_of[::-1]] = np.arange(vocab_size)[::-1]  # a token of each class
    table = np.zeros((n, n_classes), dtype=np.int32)
    for s in range(n):
        row = row_of(s)
        table[s] = row[first]
        if not np.array_equal(table[s][class_of], row):  # a hash collision merged two classes
            raise RuntimeError("pack_automaton: two token classes collided; compile it again")
    header = np.zeros(len(HEADER), dtype=np.int32)
    states_at = len(HEADER)
    masks_at = states_at + states.size
    classes_at = masks_at + len(masks) * W
    next_at = classes_at + vocab_size
    header[:] = (n, initial, W, len(masks), n_classes, vocab_size, states_at, masks_at, classes_at, next_at)
    words = np.concatenate([header, states.reshape(-1), *masks, class_of, table.reshape(-1)]).astype(np.int32)
    return Automaton(words, n, len(masks), n_classes)


class Walker:
    """The automaton's rules read back from its words, as the device applies them (the tests'
    and the bench's reference of sched_grammar.h and the sampler's mask)."""

    def __init__(self, words: np.ndarray):
        self.words = np.asarray(words, dtype=np.int32)
        h = {name: int(self.words[i]) for i, name in enumerate(HEADER)}
        self.n_states, self.initial, self.W = h["n_states"], h["initial"], h["mask_words"]
        self.n_classes, self.vocab = h["n_classes"], h["vocab"]
        self._at = h

    def state(self, s: int) -> dict[str, int]:
        at = self._at["states_at"] + s * len(STATE)
        return {name: int(self.words[at + i]) for i, name in enumerate(STATE)}

    def mask_offset(self, s: int) -> int:
        return self._at["masks_at"] + self.state(s)["mask"] * self.W

    def allowed(self, s: int, vocab_size: int) -> np.ndarray:
        at = self.mask_offset(s)
        bits = np.unpackbits(self.words[at : at + self.W].view(np.uint8), bitorder="little")
        return np.flatnonzero(bits[:vocab_size])

    def next_all(self, s: int) -> np.ndarray:
        """Every token's next state from s (END where refused, or an EOS)."""
        classes = self.words[self._at["classes_at"] : self._at["classes_at"] + self.vocab]
        at = self._at["next_at"] + s * self.n_classes
        return self.words[at : at + self.n_classes][classes]

    def next(self, s: int, token: int) -> int:
        if not 0 <= token < self.vocab:
            return END
        cls = int(self.words[self._at["classes_at"] + token])
        return int(self.words[self._at["next_at"] + s * self.n_classes + cls])


Writer = Callable[[int, np.ndarray], None]


class GrammarArena:
    """The host's allocator of the `grammar` array: automata placed by key, shared by every request
    that names the same one, kept after their last request ends (a service sends the same schema
    again and again) and evicted, least recently used first, when a new one needs the room.

    writer(offset, words) copies an automaton into the array (the backend's: a host copy on the
    CPU, a device copy on CUDA, complete when it returns).  Any thread: place() runs on the
    frontend thread, release() where a request ends."""

    def __init__(self, capacity_words: int, writer: Writer):
        self.capacity_words = capacity_words
        self._writer = writer
        self._lock = threading.Lock()
        # key -> [offset, n_words, refs]; order: least recently placed first
        self._regions: OrderedDict[Hashable, list[int]] = OrderedDict()
        self.writes = 0  # automata copied in (the bench's and the tests' count)

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_words * 4

    def fits(self, n_words: int) -> bool:
        """Whether an automaton this big could ever be placed (an empty arena holds it)."""
        return n_words <= self.capacity_words

    def place(self, key: Hashable, words: np.ndarray) -> int | None:
        """The word offset of `key`'s automaton, copied in if it is not resident, with one more
        reference; None while the room it needs is held by running requests."""
        with self._lock:
            region = self._regions.get(key)
            if region is not None:
                region[2] += 1
                self._regions.move_to_end(key)
                return region[0]
            n = len(words)
            offset = self._find_room(n)
            while offset is None:
                victim = next((k for k, r in self._regions.items() if r[2] == 0), None)
                if victim is None:
                    return None
                del self._regions[victim]
                offset = self._find_room(n)
            self._writer(offset, np.ascontiguousarray(words, dtype=np.int32))
            self.writes += 1
            self._regions[key] = [offset, n, 1]
            return offset

    def release(self, key: Hashable) -> None:
        """One reference of `key`'s automaton dropped (its request ended)."""
        with self._lock:
            region = self._regions.get(key)
            if region is not None and region[2] > 0:
                region[2] -= 1

    def resident(self) -> dict[Hashable, tuple[int, int, int]]:
        with self._lock:
            return {k: (r[0], r[1], r[2]) for k, r in self._regions.items()}

    def _find_room(self, n: int) -> int | None:
        """First fit among the gaps between resident regions."""
        at = 0
        for offset, size, _ in sorted(self._regions.values()):
            if offset - at >= n:
                return at
            at = max(at, offset + size)
        return at if self.capacity_words - at >= n else None
