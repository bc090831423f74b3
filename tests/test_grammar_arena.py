"""The grammar array's host side (ipc/automaton.py): an automaton packed as the device reads it, and
the arena that places automata, shares them between requests and evicts the unused ones."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ringleader.ipc.automaton import ACCEPTING, END, TERMINAL, GrammarArena, Walker, pack_automaton


def _writes(capacity: int):
    array = np.full(capacity, -7, dtype=np.int32)
    log = []

    def write(offset, words):
        array[offset : offset + len(words)] = words
        log.append((offset, len(words)))

    return array, log, write


def test_a_packed_automaton_reads_back_as_given():
    # 0 --a--> 1 --b--> 2 (accepting, may go on with c to 2); tokens past the vocabulary dropped
    vocab, eos = 70, (2, 69)
    packed = pack_automaton(
        vocab,
        initial=0,
        tokens=[np.array([10, 11, 99]), np.array([12]), np.array([13])],
        next_states=[np.array([1, 1, 1]), np.array([2]), np.array([2])],
        accepting=[False, False, True],
        eos_ids=eos,
    )
    w = Walker(packed.words)
    assert (w.n_states, w.initial, w.W) == (3, 0, 3)
    assert w.allowed(0, vocab).tolist() == [10, 11]
    assert w.allowed(2, vocab).tolist() == [2, 13, 69]  # the EOS ids join where it accepts
    assert [w.next(0, 10), w.next(0, 11), w.next(1, 12), w.next(2, 13), w.next(2, 2), w.next(2, 69)] == [
        1,
        1,
        2,
        2,
        END,
        END,
    ]
    assert w.state(2)["flags"] == ACCEPTING and w.state(0)["flags"] == 0
    # states allowing the same set share one mask
    twin = pack_automaton(
        vocab, 0, [np.array([5]), np.array([5])], [np.array([1]), np.array([0])], [False, False], eos
    )
    assert twin.n_masks == 1 and Walker(twin.words).next(1, 5) == 0


def test_an_accepting_state_with_no_way_on_is_terminal():
    packed = pack_automaton(
        50,
        0,
        [np.array([7]), np.array([], np.int64)],
        [np.array([1]), np.array([], np.int64)],
        [False, True],
        [2],
    )
    w = Walker(packed.words)
    assert w.state(1)["flags"] == ACCEPTING | TERMINAL
    assert w.allowed(1, 50).tolist() == [2]


def test_the_arena_shares_reuses_and_evicts_least_recently_used():
    array, log, write = _writes(100)
    arena = GrammarArena(100, write)
    a = np.arange(40, dtype=np.int32)
    b = np.arange(50, dtype=np.int32) + 1000
    assert arena.place("a", a) == 0 and arena.place("a", a) == 0  # the second request shares it
    assert log == [(0, 40)]
    assert arena.place("b", b) == 40 and np.array_equal(array[40:90], b)
    arena.release("a")
    arena.release("a")
    # "c" needs 30 words: only by evicting the unused "a" (b is held)
    c = np.arange(30, dtype=np.int32) + 5000
    assert arena.place("c", c) == 0 and set(arena.resident()) == {"b", "c"}
    # nothing unused left and no room: the caller waits
    assert arena.place("d", np.zeros(30, np.int32)) is None
    arena.release("b")
    assert arena.place("d", np.zeros(30, np.int32)) == 30
    assert arena.writes == 4 and not arena.fits(101) and arena.fits(100)


@pytest.mark.parametrize("seed", range(5))
def test_the_arena_never_overlaps_two_resident_automata(seed):
    rng = np.random.default_rng(seed)
    array, _, write = _writes(1000)
    arena = GrammarArena(1000, write)
    held: dict[int, int] = {}
    for _ in range(300):
        key = int(rng.integers(0, 20))
        if held.get(key) and rng.random() < 0.5:
            arena.release(key)
            held[key] -= 1
            continue
        words = np.full(
            int(rng.integers(1, 300)) if key not in arena.resident() else arena.resident()[key][1],
            key,
            np.int32,
        )
        if arena.place(key, words) is not None:
            held[key] = held.get(key, 0) + 1
        spans = sorted((off, off + size) for off, size, _ in arena.resident().values())
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)), spans
        for k, (off, size, refs) in arena.resident().items():
            assert refs == held.get(k, 0) and (array[off : off + size] == k).all()
