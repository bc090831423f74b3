"""The `batch` frame (protocol 1.7, docs/protocol.md): every stream of one connection that
advanced in one step, and the `done` of each that ended, in one frame.

`BatchFrame` builds one on the server (the completion thread, one per connection per CQ batch):
columns, not a map per chunk, so a step's chunks cost a few list appends each and one pack.
`expand_batch` is its inverse on a client: the `token` and `done` maps the frame means, in order,
so a client handles a batch exactly as it handles per-request frames.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

OP_BATCH = "batch"
# the per-chunk lists a batch may carry besides ids and n_tokens: present only when some chunk
# has the field, nil in the entries of chunks without it
# (1.10) a request's prompt message's fields (protocol.prompt_msg), columns like the others
PROMPT_COLUMNS = ("prompt_token_ids", "prompt_logprobs", "prompt_tokens", "prompt_text")
CHUNK_COLUMNS = ("text", "index", "logprobs", "finish_reason", *PROMPT_COLUMNS)


class BatchFrame:
    """The chunks and dones of one connection's batch, in the order they are added."""

    __slots__ = ("columns", "dones", "ids", "n_tokens", "token_ids")

    def __init__(self) -> None:
        self.ids: list[Any] = []
        self.n_tokens: list[int] = []
        self.token_ids: list[int] = []
        self.columns: dict[str, list[Any]] = {}  # a column starts when a chunk first has the field
        self.dones: list[dict] = []

    def __bool__(self) -> bool:
        return bool(self.ids or self.dones)

    def add_ids(self, request_id: Any, token_ids: list[int]) -> None:
        """A chunk of token ids alone: the hot path (a request that asked for no text, no logprobs)."""
        self.ids.append(request_id)
        self.n_tokens.append(len(token_ids))
        self.token_ids += token_ids
        for column in self.columns.values():
            column.append(None)  # every column keeps one entry per chunk

    def add_chunk(self, request_id: Any, token_ids: list[int], **fields: Any) -> None:
        """A chunk with any of CHUNK_COLUMNS (None: the chunk has none of that field)."""
        at = len(self.ids)
        self.ids.append(request_id)
        self.n_tokens.append(len(token_ids))
        self.token_ids += token_ids
        for name, value in fields.items():
            if value is not None and name not in self.columns:
                if name not in CHUNK_COLUMNS:
                    raise ValueError(f"a batch chunk has no field {name!r}")
                self.columns[name] = [None] * at
        for name, column in self.columns.items():
            column.append(fields.get(name))

    def add_text(self, request_id: Any, token_ids: list[int], text: str) -> None:
        """A chunk of token ids and their text (a request that asked for text, nothing else)."""
        texts = self.columns.get("text")
        if texts is None:
            texts = self.columns["text"] = [None] * len(self.ids)
        self.add_ids(request_id, token_ids)  # appends None to every column, text's included
        texts[-1] = text

    def extend(self, request_ids: list[Any], counts: list[int], token_ids: list[int]) -> None:
        """Many chunks of token ids alone, as columns (the server's hot path)."""
        self.ids += request_ids
        self.n_tokens += counts
        self.token_ids += token_ids
        for column in self.columns.values():
            column += [None] * len(request_ids)

    def chunks(self) -> Iterator[dict]:
        """Its chunks as the `token` maps they mean (for a connection that gets plain frames)."""
        return _chunks(self.ids, self.n_tokens, self.token_ids, list(self.columns.items()), [])

    def add_done(self, done: dict) -> None:
        self.dones.append(done)

    def message(self) -> dict:
        """The batch as its wire map."""
        msg: dict[str, Any] = {
            "op": OP_BATCH,
            "ids": self.ids,
            "n_tokens": self.n_tokens,
            "token_ids": self.token_ids,
        }
        msg.update(self.columns)
        if self.dones:
            msg["done"] = self.dones
        return msg


class BadBatch(ValueError):
    """A batch frame whose lists do not fit together."""


def expand_batch(msg: dict) -> Iterator[dict]:
    """The `token` maps of a batch's chunks, in order, then its `done` maps: what the batch means.
    BadBatch before anything is yielded when its lists do not fit together."""
    ids, counts, tokens = msg.get("ids"), msg.get("n_tokens"), msg.get("token_ids")
    dones = msg.get("done", [])
    if not (isinstance(ids, list) and isinstance(counts, list) and isinstance(tokens, list)):
        raise BadBatch("a batch needs the lists ids, n_tokens and token_ids")
    if len(counts) != len(ids):
        raise BadBatch("a batch's n_tokens must have one entry per id")
    if not isinstance(dones, list) or any(not isinstance(d, dict) or d.get("op") != "done" for d in dones):
        raise BadBatch("a batch's done must be a list of done maps")
    if any(not isinstance(k, int) or isinstance(k, bool) or k < 0 for k in counts) or sum(counts) != len(
        tokens
    ):
        raise BadBatch("a batch's n_tokens must be counts that add up to its token_ids")
    columns = [(name, msg[name]) for name in CHUNK_COLUMNS if msg.get(name) is not None]
    if any(not isinstance(col, list) or len(col) != len(ids) for _, col in columns):
        raise BadBatch("a batch's chunk columns must have one entry per id")
    return _chunks(ids, counts, tokens, columns, dones)


def _chunks(ids: list, counts: list, tokens: list, columns: list, dones: list) -> Iterator[dict]:
    at = 0
    for i, (request_id, k) in enumerate(zip(ids, counts)):
        chunk = {"op": "token", "id": request_id, "token_ids": tokens[at : at + k]}
        at += k
        for name, column in columns:
            if column[i] is not None:
                chunk[name] = column[i]
        yield chunk
    yield from dones
