"""The request table's rows as columns, so a step's tokens are routed with array operations.

Every request in the RequestTable has a row; its handle names the row (handle = generation <<
ROW_BITS | row, so `handles & ROW_MASK` finds the rows of a CQ batch at once, and a handle whose
row has moved on to a newer request no longer matches `handle[row]`).  A request becomes *hot*
once its first token has been routed if it asked for token ids alone (no text, no logprobs, one
choice): from then on the completion thread counts its tokens and stamps its last chunk here, in
`advance`, for a whole batch in a few array operations, and its InFlight's completion_tokens and
last_token_ns are brought up to date when it leaves the table (`release`, under the table's
lock, before anyone reads them to write a `done`).

Everything here is read and written under the RequestTable's lock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ROW_BITS = 20  # rows: requests in the table at once (about a million)
ROW_MASK = (1 << ROW_BITS) - 1
GENERATIONS = 1 << (32 - ROW_BITS)  # a row's handles repeat after this many of its requests


class StreamColumns:
    def __init__(self, rows: int = 1024):
        self.handle = np.zeros(rows, np.uint32)  # the live request's handle, 0 for a free row
        self.generation = np.zeros(rows, np.uint32)  # of the row's latest handle
        self.hot = np.zeros(rows, np.bool_)
        self.tokens = np.zeros(rows, np.int64)  # a hot request's completion tokens
        self.last_ns = np.zeros(rows, np.int64)  # a hot request's last chunk (perf_counter_ns)
        self.client = np.zeros(rows, np.int32)  # its connection's number (client_numbers)
        self.ids = np.empty(rows, object)  # its request id
        self._free: list[int] = []
        self._used = 0  # rows handed out at least once
        self._client_numbers: dict[bytes, int] = {}
        self._clients: list[bytes | None] = []  # number -> connection
        self._free_numbers: list[int] = []

    def take(self, client_number: int, request_id: Any) -> int:
        """A row for a new request: its handle (never 0)."""
        if self._free:
            row = self._free.pop()
        else:
            row = self._used
            if row > ROW_MASK:
                raise RuntimeError(f"more than {ROW_MASK + 1} requests in the table")
            if row == len(self.handle):
                self._grow(2 * row)
            self._used += 1
        gen = int(self.generation[row]) % (GENERATIONS - 1) + 1  # 1..GENERATIONS-1: handle != 0
        self.generation[row] = gen
        handle = (gen << ROW_BITS) | row
        self.handle[row], self.hot[row], self.client[row], self.ids[row] = (
            handle,
            False,
            client_number,
            request_id,
        )
        return handle

    def release(self, req) -> None:
        """The request leaves the table: a hot one's counts go back to its InFlight, the row to
        the free list."""
        row = req.handle & ROW_MASK
        if self.hot[row]:
            req.completion_tokens, req.last_token_ns = int(self.tokens[row]), int(self.last_ns[row])
        self.handle[row], self.hot[row], self.ids[row] = 0, False, None
        self._free.append(row)

    def make_hot(self, req) -> None:
        """Its first token was routed and it wants ids alone: the hot path counts it from now."""
        row = req.handle & ROW_MASK
        if self.handle[row] == req.handle:
            self.tokens[row], self.last_ns[row] = req.completion_tokens, req.last_token_ns
            self.hot[row] = True

    def advance(self, handles: np.ndarray, counts: np.ndarray, now_ns: int) -> tuple[np.ndarray, ...]:
        """One batch's chunks (unique handles, their token counts): the hot ones are counted and
        stamped.  Returns (hot: mask over the chunks, rows of the hot ones, the gap per token in
        ns since each hot one's last chunk, their connection numbers), and `live`: the chunks
        whose request is still in the table."""
        rows = (handles & ROW_MASK).astype(np.intp)
        rows = np.minimum(rows, len(self.handle) - 1)  # a handle from beyond the rows is no row's
        live = self.handle[rows] == handles
        hot = live & self.hot[rows]
        hot_rows = rows[hot]
        k = counts[hot]
        gaps = (now_ns - self.last_ns[hot_rows]) / k
        self.tokens[hot_rows] += k
        self.last_ns[hot_rows] = now_ns
        return hot, hot_rows, gaps, self.client[hot_rows], live

    def client_number(self, client: bytes) -> int:
        number = self._client_numbers.get(client)
        if number is None:
            if self._free_numbers:
                number = self._free_numbers.pop()
                self._clients[number] = client
            else:
                number = len(self._clients)
                self._clients.append(client)
            self._client_numbers[client] = number
        return number

    def connections(self, numbers: np.ndarray) -> bytes | list[bytes]:
        """The hot chunks' connections: one client when every chunk is its (one connection
        carrying many streams: the common case, no work per chunk), else each chunk's."""
        if not len(numbers):
            return []
        first = int(numbers[0])
        if bool((numbers == first).all()):
            return self._clients[first]  # type: ignore[return-value]
        clients = self._clients
        return [clients[n] for n in numbers.tolist()]

    def forget_client(self, client: bytes) -> None:
        """The connection has nothing left in the table: its number may go to another."""
        number = self._client_numbers.pop(client, None)
        if number is not None:
            self._clients[number] = None
            self._free_numbers.append(number)

    def _grow(self, rows: int) -> None:
        for name in ("handle", "generation", "hot", "tokens", "last_ns", "client", "ids"):
            old = getattr(self, name)
            new = np.zeros(rows, old.dtype) if old.dtype != object else np.empty(rows, object)
            new[: len(old)] = old
            setattr(self, name, new)
