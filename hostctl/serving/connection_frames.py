"""The frames one CQ batch makes, per connection: one `batch` frame for a connection that asked for
them (`hello`, protocol 1.7), else the plain `token` and `done` frames of protocol 1.6, in order.

The completion thread fills one ConnectionFrames per CQ batch, then hands `frames()` to the
Outbox.  Per connection, its plain chunks (token ids, and text where asked; no logprobs, no
choice index) wait as the columns of a BatchFrame (`hot`), the rest of its messages as maps in
order (`entries`).  A request is hot or not for a whole CQ batch, and its `done` is among the maps, so the hot chunks going
first keeps every request's order.  Which kind of frame a connection gets is decided once, in
frames(), so a `hello` the frontend takes meanwhile cannot reorder them; a connection with one
message gets it plain (every client reads both kinds), so one stream per connection costs what
it cost before 1.7, and a connection's only hot chunk is packed at once (`packed`, sent first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from ringleader.hostctl.serving.finisher import Frame, Reply
from ringleader.ipc import protocol
from ringleader.ipc.batch_frames import PROMPT_COLUMNS, BatchFrame

# completion thread only (a Packer is not shared between threads)
pack_frame = _pack = msgpack.Packer(use_bin_type=True, default=protocol.pack_default).pack


# maps and lists in one batch frame, well below what a client takes (MAX_CONTAINERS_PER_FRAME)
MAX_BATCH_CONTAINERS = protocol.MAX_CONTAINERS_PER_FRAME // 2


class ConnectionFrames:
    """wants_batch(client): whether the connection asked for `batch` frames (Outbox.wants_batch)."""

    __slots__ = ("_wants_batch", "entries", "hot", "packed")

    def __init__(self, wants_batch: Callable[[bytes], bool]):
        self._wants_batch = wants_batch
        self.hot: dict[bytes, BatchFrame] = {}  # per connection, its plain chunks
        self.entries: dict[bytes, list[dict]] = {}
        self.packed: list[Frame] = []  # plain frames packed already, sent first

    def _hot(self, client: bytes) -> BatchFrame:
        batch = self.hot.get(client)
        if batch is None:
            batch = self.hot[client] = BatchFrame()
        return batch

    def add_ids(self, client: bytes, request_id: Any, token_ids: list[int], text: str | None = None) -> None:
        """A chunk of token ids, with its text where the request asked for text."""
        if text is None:
            self._hot(client).add_ids(request_id, token_ids)
        else:
            self._hot(client).add_text(request_id, token_ids, text)

    def add_hot(self, client: bytes, request_ids: list[Any], counts: list[int], token_ids: list[int]) -> None:
        """Many chunks of token ids alone, as columns (the router's hot path)."""
        self._hot(client).extend(request_ids, counts, token_ids)

    def add_reply(self, client: bytes, msg: dict) -> None:
        """A `token` or `done` message map (protocol.token_msg, the Finisher's replies)."""
        entries = self.entries.get(client)
        if entries is None:
            entries = self.entries[client] = []
        entries.append(msg)

    def add_replies(self, replies: list[Reply]) -> None:
        for client, msg in replies:
            self.add_reply(client, msg)

    def add_packed(self, client: bytes, frame: bytes) -> None:
        """A plain frame packed already (a connection's one hot chunk): sent before the
        connection's other messages of this batch, so its request's order holds."""
        self.packed.append((client, frame))

    def frames(self) -> list[Frame]:
        """Every frame: per connection one `batch`, or its messages plain, in order.  Called
        once (it empties `entries`)."""
        out = self.packed
        entries = self.entries
        for client, hot in self.hot.items():
            mine = entries.pop(client, [])
            if len(hot.ids) + len(mine) > 1 and self._wants_batch(client):
                self._batches(out, client, hot, mine)
            else:
                out += [(client, _pack(msg)) for msg in [*hot.chunks(), *mine]]
        for client, mine in entries.items():
            if len(mine) > 1 and self._wants_batch(client):
                self._batches(out, client, BatchFrame(), mine)
            else:
                out += [(client, _pack(msg)) for msg in mine]
        return out

    @staticmethod
    def _batches(out: list[Frame], client: bytes, batch: BatchFrame, mine: list) -> None:
        """The plain chunks (`batch`) and the other messages, in batches a client takes."""
        for part in container_bounded(mine):
            add_messages(batch, part)
            out.append((client, _pack(batch.message())))
            batch = BatchFrame()  # the plain chunks go in the first batch


def containers(msg: dict) -> int:
    """About how many maps and lists a message adds to a batch (a done: itself, usage, timing,
    error or choices; a chunk: its logprobs list, and per entry a map and its lists)."""
    if msg["op"] == protocol.OP_DONE:
        return 4 + len(msg.get("choices") or ())
    logprobs = msg.get("logprobs")
    prompt = 8 if "prompt_logprobs" in msg else 0  # its columns: a constant count
    return prompt + (1 if logprobs is None else 2 + 4 * len(logprobs))


def container_bounded(entries: list[dict]) -> list[list[dict]]:
    """The messages in runs of at most MAX_BATCH_CONTAINERS maps and lists each, in order: a
    client refuses a frame of more than protocol.MAX_CONTAINERS_PER_FRAME (logprobs of many
    tokens, one batch)."""
    parts: list[list[dict]] = [[]]
    used = 0
    for msg in entries:
        n = containers(msg)
        if used + n > MAX_BATCH_CONTAINERS and parts[-1]:
            parts.append([])
            used = 0
        parts[-1].append(msg)
        used += n
    return parts


def add_messages(batch: BatchFrame, messages: list[dict]) -> None:
    """Token and done message maps into a batch, in order: chunks in their columns, dones after."""
    for msg in messages:
        if msg["op"] == protocol.OP_DONE:
            batch.add_done(msg)
        else:
            batch.add_chunk(
                msg["id"],
                msg["token_ids"],
                text=msg.get("text"),
                index=msg.get("index"),
                logprobs=msg.get("logprobs"),
                finish_reason=msg.get("finish_reason"),
                **{name: msg.get(name) for name in PROMPT_COLUMNS},
            )
