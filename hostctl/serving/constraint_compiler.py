"""The constraint compiler: a StructuredSpec (ipc/structured.py) to the token automaton the device
enforces (ipc/automaton.py), once per constraint.

A constraint becomes a regular expression over the output's bytes (a JSON schema through
outlines-core's schema-to-regex, a choice as an alternation of literals, json_object as our own
bounded-depth JSON object regex), then outlines-core's Index walks every token of the model's
vocabulary (its exact bytes, device/text/token_bytes.py) through the regex's DFA: a table of
state -> {token: next state}.  We renumber its sparse states densely, drop what cannot lead to a
complete output, check that every state left allows something, and pack it for the device.

A cold compile takes from milliseconds (a choice) to a second or so (a large schema), so it runs
on the server's constraint worker thread (constraints.py); the result is cached by the spec's
key, and `cached` answers the frontend thread without compiling.  outlines-core is optional (the
`structured` extra): it is imported only when something is compiled.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ringleader.hostctl.serving.schema_rules import enforceable_schema, substitute
from ringleader.ipc.automaton import Automaton, pack_automaton
from ringleader.ipc.install_hint import install_hint
from ringleader.ipc.structured import WIRE_FIELD, StructuredError, StructuredSpec

# Nesting of json_object's containers, the top object counted: 2 admits {"a": {"b": 1}, "c": [1]}
# but not {"a": [{"b": 1}]}.  Each level multiplies the automaton's states by 4 and its compile
# time by 4 or more (SmolLM2's 49k tokens: 0.26 s at 2, 1.05 s at 3, 10 s at 4; a 150k vocabulary
# triples these); a deeper document needs a schema.
MAX_JSON_OBJECT_DEPTH = 2
# Between JSON tokens at most one space and never a newline: the model cannot loop on whitespace
# (outlines' default allows any run of spaces, tabs and newlines).
JSON_WHITESPACE = r"[ ]?"
# The largest count of a counted repetition (x{n}, x{n,m}): outlines-core's index grows with it
# (a{99999} took 92 s to build), and a schema's maxLength or maxItems becomes one.
MAX_COUNTED_REPEAT = 1000

# JSON's scalars (RFC 8259), C0 and C1 controls and DEL kept out of strings as outlines does
JSON_STRING = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
JSON_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
JSON_SCALAR = rf"({JSON_STRING}|{JSON_NUMBER}|true|false|null)"

# the byte each pattern is indexed between (_index), and its spelling in the pattern
SENTINEL = b"\x00"
SENTINEL_REGEX = r"\x00"

_COUNTED_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


def json_object_regex(depth: int = MAX_JSON_OBJECT_DEPTH) -> str:
    """Any JSON object whose containers nest at most `depth` deep (the top object counted)."""
    ws = JSON_WHITESPACE
    value = JSON_SCALAR
    for _ in range(depth - 1):
        value = rf"({JSON_SCALAR}|{_json_object(value)}|\[{ws}({value}({ws},{ws}{value})*)?{ws}\])"
    return _json_object(value)


def _json_object(value: str) -> str:
    ws = JSON_WHITESPACE
    member = rf"{JSON_STRING}{ws}:{ws}{value}"
    return rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"


def choice_regex(choices: Sequence[str]) -> str:
    """Exactly one of the strings: an alternation of literals."""
    return "(" + "|".join(map(_literal, choices)) + ")"


def _literal(text: str) -> str:
    # every ASCII character but a letter or digit as \x{..}: no metacharacter survives, whatever
    # the regex dialect escapes; other characters stand for themselves
    return "".join(ch if ch.isalnum() or ord(ch) > 0x7F else f"\\x{{{ord(ch):x}}}" for ch in text)


class ConstraintCompiler:
    """Compiles specs for one model: token_bytes() gives each token id's output bytes (called
    once, at the first compile; a plain sequence is taken too), eos_ids the ids an accepting state
    allows, vocab_size the logits' width, max_words the largest automaton the grammar arena holds.

    compile() on one worker thread; cached() from any thread."""

    def __init__(
        self,
        token_bytes: Callable[[], Sequence[bytes | None]] | Sequence[bytes | None],
        eos_ids: Sequence[int],
        vocab_size: int,
        *,
        max_words: int,
        cache_size: int = 64,
    ):
        self._token_bytes = token_bytes
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.vocab_size = int(vocab_size)
        self.max_words = int(max_words)
        self.cache_size = max(1, int(cache_size))
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Automaton] = OrderedDict()
        self._vocabulary: Any = None  # outlines-core's Vocabulary, built at the first compile
        self._sentinel_id = -1
        self._outlines_eos = -1
        self._compiles = 0
        self._cache_hits = 0
        self._last_compile_s: float | None = None

    @property
    def stats(self) -> dict:
        """For the stats op and the bench: compiles done, cache hits, the last compile's seconds."""
        with self._lock:
            return {
                "compiles": self._compiles,
                "cache_hits": self._cache_hits,
                "cached": len(self._cache),
                "last_compile_s": self._last_compile_s,
            }

    def cached(self, spec: StructuredSpec) -> Automaton | None:
        """The spec's automaton if it was compiled (and is still cached), else None."""
        key = spec.key
        with self._lock:
            automaton = self._cache.get(key)
            if automaton is not None:
                self._cache.move_to_end(key)
                self._cache_hits += 1
            return automaton

    def compile(self, spec: StructuredSpec) -> Automaton:
        """The spec's automaton, from the cache or compiled now; StructuredError naming the field
        when it cannot be (outlines-core missing, a bad schema or regex, no output possible, too
        large for the grammar arena)."""
        automaton = self.cached(spec)
        if automaton is not None:
            return automaton
        started = time.perf_counter()
        automaton = self._compile(spec)
        with self._lock:
            self._compiles += 1
            self._last_compile_s = time.perf_counter() - started
            self._cache[spec.key] = automaton
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return automaton

    # ------------------------------------------------------------------ the steps

    def _compile(self, spec: StructuredSpec) -> Automaton:
        field = f"{WIRE_FIELD}.{spec.kind}"
        outlines = _import_outlines()
        regex = self._regex(spec, field, outlines)
        _check_repeats(regex, field, spec.kind)
        try:
            transitions, initial, accepting = self._index(outlines, regex)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # pyo3's PanicException is a BaseException
            raise StructuredError(field, _index_failure(spec, regex, exc)) from None
        tokens, next_states, flags, initial = self._tables(transitions, initial, accepting, field)
        automaton = pack_automaton(self.vocab_size, initial, tokens, next_states, flags, self.eos_ids)
        if len(automaton.words) > self.max_words:
            raise StructuredError(
                field,
                f"its token automaton needs {automaton.nbytes / 2**20:.1f} MiB ({automaton.n_states} states), "
                f"more than the {self.max_words * 4 / 2**20:.1f} MiB the server keeps for constraints "
                "(the server's --structured-memory-mib sets it)",
            )
        return automaton

    def _regex(self, spec: StructuredSpec, field: str, outlines: Any) -> str:
        if spec.kind == "json":
            # numeric bounds made exact, and keywords outlines would drop refused (schema_rules.py)
            schema, exact = enforceable_schema(json.loads(str(spec.value)))
            try:
                regex = outlines.json_schema.build_regex_from_schema(
                    json.dumps(schema), whitespace_pattern=JSON_WHITESPACE
                )
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                raise StructuredError(
                    field, f"not a JSON schema this server can enforce: {_first_line(exc)}"
                ) from None
            return substitute(regex, exact)
        if spec.kind == "regex":
            return str(spec.value)
        if spec.kind == "choice":
            return choice_regex(tuple(spec.value or ()))
        if spec.kind == "json_object":
            return json_object_regex()
        raise StructuredError(WIRE_FIELD, f"unknown constraint kind {spec.kind!r}")

    def _index(self, outlines: Any, regex: str) -> tuple[dict, int, set[int]]:
        """outlines-core's token index of `regex`: (transitions, initial state, accepting states).

        The pattern is indexed between two sentinel bytes, with a sentinel token spelling one:
        the state that token leads to from the start is the pattern's own start, and the states
        it leads from to a final state are those where the pattern is complete.  Two faults of
        outlines-core's DFA go away so:
        - it has unanchored start states too, whose subset construction explodes when the
          pattern's first byte recurs inside it ("{" in a JSON object: 4.4 s for json_object at
          depth 3 against 17 ms behind the sentinel);
        - once one alternative matches, it drops the others that could go on ("red|redder" or
          "x*|xy" accepted only "red" and x*): nothing matches here before the last sentinel.
        Every state between reads the rest exactly as the pattern alone would, and the sentinel
        token itself is past the logits, dropped with its edges.  Where this fails (a pattern
        with ^), the pattern is indexed as it is, for its error."""
        vocabulary = self._outlines_vocabulary(outlines)
        try:
            index = outlines.Index(f"{SENTINEL_REGEX}(?:{regex}){SENTINEL_REGEX}", vocabulary)
            transitions = index.get_transitions()
            finals = {int(s) for s in index.get_final_states()}
            initial = transitions.get(int(index.get_initial_state()), {}).get(self._sentinel_id)
            if initial is not None:
                sentinel = self._sentinel_id
                accepting = {int(s) for s, row in transitions.items() if row.get(sentinel) in finals}
                return transitions, int(initial), accepting
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:
            pass  # the plain pattern's own error is the one to give
        index = outlines.Index(regex, vocabulary)
        return (
            index.get_transitions(),
            int(index.get_initial_state()),
            {int(s) for s in index.get_final_states()},
        )

    def _outlines_vocabulary(self, outlines: Any) -> Any:
        """outlines-core's Vocabulary of the model: bytes -> ids, special tokens, EOS ids and ids
        past the logits left out (the automaton adds EOS itself, at accepting states)."""
        if self._vocabulary is None:
            spelled = self._token_bytes() if callable(self._token_bytes) else self._token_bytes
            eos = set(self.eos_ids)
            by_bytes: dict[bytes, list[int]] = {}
            for token_id, spelling in enumerate(spelled[: self.vocab_size]):
                if spelling and token_id not in eos:
                    by_bytes.setdefault(bytes(spelling), []).append(token_id)
            # outlines wants an EOS id; one past the logits where the model has none
            outlines_eos = self._outlines_eos = self.eos_ids[0] if self.eos_ids else self.vocab_size
            # the sentinel token (_index) is past every real id and the logits: never sampled
            self._sentinel_id = max(len(spelled), self.vocab_size, outlines_eos + 1)
            by_bytes.setdefault(SENTINEL, []).append(self._sentinel_id)
            self._vocabulary = outlines.Vocabulary(outlines_eos, by_bytes)
        return self._vocabulary

    def _tables(
        self, transitions: dict, initial: int, complete: set[int], field: str
    ) -> tuple[list[np.ndarray], list[np.ndarray], list[bool], int]:
        """outlines' {state: {token: next}} as dense per-state arrays: EOS edges and tokens past
        the logits (the sentinel's) dropped, then every token that leads where no output can be
        completed removed, and the states left unreachable.  Returns (tokens, next_states,
        accepting, initial) over the states kept, renumbered 0..n-1."""
        order = np.array(sorted(set(transitions) | complete | {initial}), dtype=np.int64)
        n = len(order)
        empty = np.zeros(0, dtype=np.int64)
        tokens: list[np.ndarray] = []
        nexts: list[np.ndarray] = []  # dense ids
        for state in order.tolist():
            row = transitions.get(state)
            if not row:
                tokens.append(empty)
                nexts.append(empty)
                continue
            tok = np.fromiter(row.keys(), dtype=np.int64, count=len(row))
            nxt = np.fromiter(row.values(), dtype=np.int64, count=len(row))
            keep = (tok < self.vocab_size) & (tok != self._outlines_eos)
            if not keep.all():
                tok, nxt = tok[keep], nxt[keep]
            dense = np.minimum(np.searchsorted(order, nxt), n - 1)
            if (order[dense] != nxt).any():
                raise StructuredError(
                    field, "could not be compiled: outlines-core's index leads to a state it lacks"
                )
            tokens.append(tok)
            nexts.append(dense)
        accepting = np.isin(order, np.fromiter(complete, dtype=np.int64, count=len(complete)))
        start = int(np.searchsorted(order, initial))
        successors = _successors(nexts, n)
        finishing = _closure(_predecessors(successors, n), np.flatnonzero(accepting).tolist(), n)
        if not finishing[start]:
            raise StructuredError(field, "no output satisfies it with this model's vocabulary")
        for s in range(n):
            if not finishing[successors[s]].all():
                keep = finishing[nexts[s]]
                tokens[s], nexts[s] = tokens[s][keep], nexts[s][keep]
                successors[s] = successors[s][finishing[successors[s]]]
        kept = _closure(successors, [start], n)
        dead = np.flatnonzero(kept & ~accepting & (np.array([len(t) for t in tokens]) == 0))
        if len(dead):
            raise StructuredError(field, f"its automaton has {len(dead)} dead state(s): no token may follow")
        renumber = np.cumsum(kept) - 1
        states = np.flatnonzero(kept).tolist()
        return (
            [tokens[s] for s in states],
            [renumber[nexts[s]] for s in states],
            [bool(accepting[s]) for s in states],
            int(renumber[start]),
        )


def _successors(nexts: list[np.ndarray], n: int) -> list[np.ndarray]:
    """Each state's distinct next states."""
    mark = np.zeros(n, dtype=bool)
    out = []
    for nxt in nexts:
        mark[nxt] = True
        targets = np.flatnonzero(mark)
        mark[targets] = False
        out.append(targets)
    return out


def _predecessors(successors: list[np.ndarray], n: int) -> list[list[int]]:
    into: list[list[int]] = [[] for _ in range(n)]
    for s, targets in enumerate(successors):
        for t in targets.tolist():
            into[t].append(s)
    return into


def _closure(edges: Sequence[Sequence[int] | np.ndarray], roots: list[int], n: int) -> np.ndarray:
    """Which states the roots lead to through `edges` (the roots included), as a bool array."""
    seen = np.zeros(n, dtype=bool)
    seen[roots] = True
    todo = list(roots)
    while todo:
        for t in edges[todo.pop()]:
            if not seen[t]:
                seen[t] = True
                todo.append(t)
    return seen


def _import_outlines() -> Any:
    try:
        import outlines_core  # its json_schema module comes with it
    except ImportError:
        raise StructuredError(
            WIRE_FIELD,
            f"this server cannot compile constraints: outlines-core is not installed ({install_hint('structured')})",
        ) from None
    return outlines_core


def _check_repeats(regex: str, field: str, kind: str) -> None:
    for match in _COUNTED_REPEAT.finditer(regex):
        count = max(int(c) for c in match.groups() if c)
        if count > MAX_COUNTED_REPEAT:
            source = ", from a pattern, maxLength, maxItems or the like" if kind == "json" else ""
            raise StructuredError(
                field,
                f"repeats something {count} times ({match.group(0)}{source}); at most {MAX_COUNTED_REPEAT}",
            )


def _index_failure(spec: StructuredSpec, regex: str, exc: BaseException) -> str:
    """Why outlines-core could not index the regex, in a client's words."""
    detail = _first_line(exc)
    if "incompatible with the regex" in detail:  # a state no token of the vocabulary leaves
        return "no output satisfies it with this model's vocabulary"
    if "anchored universal start state" in detail:
        return "the ^ anchor is not supported (the whole output matches the pattern anyway)"
    if "error building NFA" not in detail:  # outlines says what it lacks (\b, ...)
        return f"not a regular expression this server supports: {detail}"
    if spec.kind == "json":
        return f"holds a pattern that is not a regular expression this server supports ({detail})"
    try:  # outlines-core names no reason for a syntax error; Python's regex syntax is close
        re.compile(regex)
    except re.error as syntax:
        return f"not a valid regular expression: {syntax}"
    return (
        f"not a regular expression this server supports ({detail}); look-around and backreferences "
        "are not regular"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
