"""Constraints: structured output on the host, which is all done before a request reaches the SQ.

A generate with `structured` (ipc/structured.py) needs its constraint compiled into a token
automaton (constraint_compiler.py) once per constraint: compiled automata are cached, so a
service that sends the same schema again pays nothing.  A cold compile can take a second or more
(a large JSON schema), so a thread of its own hands it to a process of its own
(compile_worker.py: outlines-core would hold the interpreter lock on any thread of ours, and a
compile past its time limit is ended there), and nothing else waits for it: the request is accepted (in the table, its deadlines armed, abortable) and held on the host
(Admission.hold_gated) until its automaton is ready, then queued like any other.  A constraint
that cannot compile ends the request with `bad_request` naming the field; nothing else is
affected.  Admission places the automaton in the grammar array as the request enters the SQ
(ipc/automaton.py:GrammarArena), and the finisher releases it when the device's DONE comes.

After that the host does nothing per token: the scheduler advances the request's automaton and
the sampler masks its row, on the device (device/sched/sched_grammar.h).

Used by the frontend thread, but for the worker thread, which only compiles (through the
process) and hands results back through `_compiled` (a deque: append and popleft are safe across
threads) and the wake pipe; `_cache` is under `_lock`, which both take.
"""

from __future__ import annotations

import importlib.util
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from ringleader.hostctl.serving.admission import Admission
from ringleader.hostctl.serving.compile_worker import CompileWorker
from ringleader.hostctl.serving.inflight import InFlight
from ringleader.ipc.automaton import Automaton, GrammarArena
from ringleader.ipc.backend import ModelInfo
from ringleader.ipc.install_hint import install_hint
from ringleader.ipc.structured import WIRE_FIELD, StructuredError, StructuredSpec

log = logging.getLogger("ringleader.server")

# constraints that failed to compile, remembered so a client retrying one is refused at once
FAILURES_KEPT = 256
# compiled automata kept (least recently used first out), beside the grammar array's own
CACHE_SIZE = 64


class Constraints:
    """fail(req, message): ends a held request with bad_request (the server's abort path)."""

    def __init__(
        self,
        model: ModelInfo,
        grammar: GrammarArena | None,
        admission: Admission,
        wake: Callable[[], None],
        fail: Callable[[InFlight, str], None],
    ):
        self._admission = admission
        self._wake = wake
        self._fail = fail
        self.grammar = grammar
        self._model = model
        self._unavailable = self._why_unavailable(model, grammar)
        self._compiler: CompileWorker | None = None  # started with the first compile
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Automaton] = OrderedDict()
        self._counts = {"compiles": 0, "cache_hits": 0}
        self._last_compile_s: float | None = None
        self._failed: OrderedDict[tuple, StructuredError] = OrderedDict()  # key -> its refusal
        self._waiting: dict[tuple, list[InFlight]] = {}  # key -> requests held for its compile
        self._jobs: queue.SimpleQueue[StructuredSpec | None] = queue.SimpleQueue()
        self._compiled: deque[tuple[StructuredSpec, Automaton | None, StructuredError | None]] = deque()
        self._worker: threading.Thread | None = None

    @staticmethod
    def _why_unavailable(model: ModelInfo, grammar: GrammarArena | None) -> str | None:
        if model.token_bytes is None:
            return f"{model.name} has no tokenizer, so its output cannot be constrained"
        if grammar is None:
            return "this backend keeps no grammar array"
        if importlib.util.find_spec("outlines_core") is None:
            return f"the server cannot compile constraints: outlines-core is not installed ({install_hint('structured')})"
        return None

    def check(self, spec: StructuredSpec | None) -> None:
        """protocol-style refusal (StructuredError) of a constraint this server cannot take now:
        none can be enforced here, or this one failed to compile before."""
        if spec is None:
            return
        if self._unavailable is not None:
            raise StructuredError(WIRE_FIELD, self._unavailable)
        failure = self._failed.get(spec.key)
        if failure is not None:  # a new one each time: a raised exception keeps its traceback
            raise StructuredError(failure.field, failure.reason)

    def attach(self, requests: list[InFlight], spec: StructuredSpec) -> bool:
        """Gives the requests (one request's choices) the spec's automaton: True when it was
        compiled already; False when it is being compiled: the caller holds them on the host
        (Admission.hold_gated), and they are queued (or refused) once it is."""
        assert self._unavailable is None  # check() refused the request otherwise
        automaton = self.cached(spec)
        if automaton is not None:
            for req in requests:
                req.automaton = automaton
            return True
        waiting = self._waiting.setdefault(spec.key, [])
        if not waiting:
            self._start_worker()
            self._jobs.put(spec)
        waiting.extend(requests)
        return False

    def cached(self, spec: StructuredSpec) -> Automaton | None:
        """The spec's automaton if it was compiled and is still cached (a hit), else None."""
        with self._lock:
            automaton = self._cache.get(spec.key)
            if automaton is not None:
                self._cache.move_to_end(spec.key)
                self._counts["cache_hits"] += 1
            return automaton

    def release_compiled(self) -> None:
        """Frontend thread: queues the requests whose automaton is ready (a choice whose family
        shares its prompt stays held for the family's own gate), refuses those whose constraint
        failed."""
        while self._compiled:
            spec, automaton, failure = self._compiled.popleft()
            if failure is not None:
                self._failed[spec.key] = failure
                while len(self._failed) > FAILURES_KEPT:
                    self._failed.popitem(last=False)
            for req in self._waiting.pop(spec.key, []):
                if failure is not None:
                    self._fail(req, str(failure))
                    continue
                req.automaton = automaton
                if req.family is None or req.index == 0 or req.family.gate is None:
                    self._admission.release_gated(req)

    def stats(self) -> dict:
        """What the stats op and the bench report of structured output."""
        out: dict = {
            "available": self._unavailable is None,
            "waiting_compile": sum(map(len, self._waiting.values())),
        }
        with self._lock:
            out.update(self._counts, cached=len(self._cache), last_compile_s=self._last_compile_s)
        if self.grammar is not None:
            resident = self.grammar.resident()
            out.update(
                grammar_capacity_bytes=self.grammar.capacity_bytes,
                grammar_resident=len(resident),
                grammar_used_bytes=4 * sum(size for _, size, _ in resident.values()),
                grammar_writes=self.grammar.writes,
            )
        return out

    def close(self) -> None:
        """Stops the worker thread after the compile in hand (its result is dropped), and the
        compiler process."""
        if self._worker is not None:
            self._jobs.put(None)
        if self._compiler is not None:
            self._compiler.close()

    def _start_worker(self) -> None:
        if self._worker is None:
            # a daemon: a compile in hand never holds up the process's exit
            self._worker = threading.Thread(target=self._work, name="rl-constraints", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while (spec := self._jobs.get()) is not None:
            started = time.perf_counter()
            try:
                automaton, failure = self._compile(spec), None
                log.info(
                    "compiled a %s constraint in %.0f ms: %d states, %.1f KiB",
                    spec.describe(),
                    1000 * (time.perf_counter() - started),
                    automaton.n_states,
                    automaton.nbytes / 1024,
                )
            except StructuredError as err:
                automaton, failure = None, err
            except Exception as exc:  # the compiler's own fault: the request is refused, never lost
                log.exception("compiling a %s constraint failed", spec.describe())
                automaton, failure = None, StructuredError(WIRE_FIELD, f"could not be compiled: {exc}"[:500])
            self._compiled.append((spec, automaton, failure))
            self._wake()

    def _compile(self, spec: StructuredSpec) -> Automaton:
        """Worker thread: the spec compiled in the compiler process, and cached."""
        if self._compiler is None:
            model, grammar = self._model, self.grammar
            assert model.token_bytes is not None and grammar is not None
            self._compiler = CompileWorker(
                model.token_bytes(), model.eos_token_ids, model.vocab_size, max_words=grammar.capacity_words
            )
        started = time.perf_counter()
        automaton = self._compiler.compile(spec)
        with self._lock:
            self._counts["compiles"] += 1
            self._last_compile_s = time.perf_counter() - started
            self._cache[spec.key] = automaton
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return automaton
