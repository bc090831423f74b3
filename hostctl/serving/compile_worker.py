"""A process of its own that compiles constraints (constraint_compiler.py), so a cold compile never
holds up the server's threads and one that takes too long can be stopped.

outlines-core builds its token index in Rust without letting go of Python's interpreter lock: on a
thread of the server, a 0.3 s schema compile stretched the token gaps of every other stream from
~35 ms to ~100 ms (bench/results/2026-11-29-cpu-structured-output).  In a process of its own it
costs the server nothing but the copy of the result, and a compile past `timeout_s` is ended by
killing the process (the next compile starts a fresh one).  Started on the first constraint a
server sees; it builds the model's vocabulary once.
"""

from __future__ import annotations

import pickle
import select
import subprocess
import sys
from collections.abc import Sequence
from typing import IO, Any

from ringleader.ipc.automaton import Automaton
from ringleader.ipc.structured import WIRE_FIELD, StructuredError, StructuredSpec

# a compile that takes longer is refused (and the worker killed): a schema or regex that big is
# better split, and the one worker must not be held by it
COMPILE_TIMEOUT_S = 30.0


def _serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    """The worker process: its compiler's arguments, then specs in, ("ok", words, n_states,
    n_masks, n_classes) or ("error", field, reason) out, pickled, until its stdin closes."""
    from ringleader.hostctl.serving.constraint_compiler import ConstraintCompiler

    token_bytes, eos_ids, vocab_size, max_words = pickle.load(requests)
    compiler = ConstraintCompiler(token_bytes, eos_ids, vocab_size, max_words=max_words, cache_size=1)
    while True:
        try:
            spec = pickle.load(requests)
        except EOFError:
            return
        try:
            a = compiler.compile(spec)
            reply: tuple = ("ok", a.words, a.n_states, a.n_masks, a.n_classes)
        except StructuredError as err:
            reply = ("error", err.field, err.reason)
        except Exception as exc:  # the compiler's own fault: the request is refused, never lost
            reply = ("error", WIRE_FIELD, f"could not be compiled: {type(exc).__name__}: {exc}"[:500])
        pickle.dump(reply, replies)
        replies.flush()


class CompileWorker:
    """compile(spec) -> Automaton in the worker process; StructuredError as the compiler says, or
    when it takes longer than timeout_s.  One caller at a time (Constraints' thread).  The worker
    is `python -m` this module, not a multiprocessing child: that would run the embedding
    program's own main module again in the child."""

    def __init__(
        self,
        token_bytes: Sequence[bytes | None],
        eos_ids: Sequence[int],
        vocab_size: int,
        *,
        max_words: int,
        timeout_s: float = COMPILE_TIMEOUT_S,
    ):
        self._args = (list(token_bytes), tuple(eos_ids), int(vocab_size), int(max_words))
        self.timeout_s = timeout_s
        self._process: subprocess.Popen | None = None

    def compile(self, spec: StructuredSpec) -> Automaton:
        field = f"{WIRE_FIELD}.{spec.kind}"
        try:
            process = self._running()
            pickle.dump(spec, process.stdin)
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], self.timeout_s)
            if not ready:
                self.close()
                raise StructuredError(
                    field,
                    f"took longer than {self.timeout_s:g} s to compile; a smaller schema or regex "
                    "(shorter maxLength and counted repeats, fewer alternatives) compiles faster",
                )
            reply = pickle.load(process.stdout)
        except (OSError, EOFError, pickle.UnpicklingError):  # the process died (out of memory, say)
            self.close()
            raise StructuredError(field, "the compiler process ended while compiling it") from None
        if reply[0] == "error":
            raise StructuredError(reply[1], reply[2])
        _, words, n_states, n_masks, n_classes = reply
        return Automaton(words, n_states, n_masks, n_classes)

    def close(self) -> None:
        """Ends the worker process (a compile in hand is dropped)."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait(timeout=5)
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()

    def _running(self) -> Any:
        if self._process is None or self._process.poll() is not None:
            self.close()
            process = subprocess.Popen(
                [sys.executable, "-m", "ringleader.hostctl.serving.compile_worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            assert process.stdin is not None
            pickle.dump(self._args, process.stdin)
            process.stdin.flush()
            self._process = process
        return self._process


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
