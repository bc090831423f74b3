"""Every accepted generate request until its one `done` is sent: the host's request table.

Written by the frontend thread (add) and the completion thread (finish); both go through the lock.
A request leaves the table exactly once (`finish`), which is what makes its `done` unique.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class InFlight:
    handle: int
    client: bytes
    id: Any
    prompt_ids: Any                 # numpy int32 tokens, kept until they are in the arena
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_ids: tuple[int, ...]
    ignore_eos: bool
    priority: int
    detokenizer: Any = None
    arena_offset: int | None = None  # set once the prompt is in the arena
    in_device: bool = False          # its GENERATE entry was written to the SQ
    abort_sent: bool = False
    completion_tokens: int = 0
    arrival_ns: int = field(default_factory=time.perf_counter_ns)
    submit_ns: int = 0
    first_token_ns: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


class RequestTable:
    def __init__(self):
        self._lock = threading.Lock()
        self._by_handle: dict[int, InFlight] = {}
        self._by_key: dict[tuple[bytes, Any], InFlight] = {}
        self._next_handle = 1

    def __len__(self) -> int:
        return len(self._by_handle)

    @staticmethod
    def key(client: bytes, request_id: Any) -> tuple:
        return (client, type(request_id).__name__, request_id)  # 1 and "1" are different ids

    def contains(self, client: bytes, request_id: Any) -> bool:
        with self._lock:
            return self.key(client, request_id) in self._by_key

    def add(self, client: bytes, request_id: Any, **fields) -> InFlight:
        with self._lock:
            handle = self._next_handle
            while handle in self._by_handle or handle == 0:  # u32 wrap: skip live handles
                handle = (handle + 1) & 0xFFFFFFFF
            self._next_handle = (handle + 1) & 0xFFFFFFFF
            req = InFlight(handle=handle, client=client, id=request_id, **fields)
            self._by_handle[handle] = req
            self._by_key[self.key(client, request_id)] = req
            return req

    def get(self, handle: int) -> InFlight | None:
        with self._lock:
            return self._by_handle.get(handle)

    def find(self, client: bytes, request_id: Any) -> InFlight | None:
        with self._lock:
            return self._by_key.get(self.key(client, request_id))

    def of_client(self, client: bytes) -> list[InFlight]:
        with self._lock:
            return [r for r in self._by_handle.values() if r.client == client]

    def all(self) -> list[InFlight]:
        with self._lock:
            return list(self._by_handle.values())

    def finish(self, handle: int) -> InFlight | None:
        """Removes the request; only the caller that gets it back may send its `done`."""
        with self._lock:
            req = self._by_handle.pop(handle, None)
            if req is not None:
                self._by_key.pop(self.key(req.client, req.id), None)
            return req
