"""The callers waiting for a tokenizer op's reply (protocol 1.10: tokenize, detokenize,
tokenizer_info), by the op's id: part of the sans-I/O core (core.ClientCore), which hands each
reply here and delivers what comes back.

A server older than 1.10 answers such an op with an id-less `error` op ("unknown op
'tokenize'"); the server answers one connection's frames in order, so that error is the oldest
waiter's of that op, which ends at once rather than at its timeout."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from ringleader.ipc.tokenize_ops import NOT_SUPPORTED, REPLY_OP, TokenizeError, result_of

W = TypeVar("W")  # the shell's waiter (threading event holder, future)

_UNKNOWN_OP = "unknown op "  # how protocol.decode_request refuses an op it does not know


class OpWaiters(Generic[W]):
    def __init__(self) -> None:
        self._by_id: dict[Any, tuple[str, W]] = {}  # id -> (request op, waiter), in sending order

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, rid: Any) -> bool:
        return rid in self._by_id

    def add(self, rid: Any, op: str, waiter: W) -> None:
        self._by_id[rid] = (op, waiter)

    def forget(self, rid: Any) -> None:
        """Its caller stopped waiting (a timeout): a late reply finds no one."""
        self._by_id.pop(rid, None)

    def on_reply(self, obj: dict) -> tuple[W, Any, BaseException | None] | None:
        """(waiter, answer, error) of a reply op, None when no one waits for it (one of them is set)."""
        entry = self._by_id.get(obj.get("id"))
        if entry is None or REPLY_OP[entry[0]] != obj.get("op"):
            return None
        del self._by_id[obj["id"]]
        try:
            return entry[1], result_of(obj), None
        except TokenizeError as exc:
            return entry[1], None, exc

    def on_unknown_op(self, obj: dict) -> tuple[W, BaseException] | None:
        """An id-less `error` op that refused one of these ops as unknown: its oldest waiter and
        the error that ends it; None for any other error."""
        message = str(obj.get("message", ""))
        if not message.startswith(_UNKNOWN_OP):
            return None
        named = message[len(_UNKNOWN_OP) :].strip("'\"")
        for rid, (op, waiter) in self._by_id.items():
            if op == named:
                del self._by_id[rid]
                why = f"the server does not know the op {op!r} (protocol 1.10): {message}"
                return waiter, TokenizeError(None, why, NOT_SUPPORTED)
        return None

    def fail_all(self, error: BaseException) -> list[tuple[W, BaseException]]:
        failed = [(waiter, error) for _op, waiter in self._by_id.values()]
        self._by_id.clear()
        return failed
