"""Prefix-affinity request routing for the Ray Serve deployment `EngineReplica`.

Each EngineReplica runs one ringleader engine whose prefix cache is keyed by KV pages, so a request
whose prompt starts like one a replica served before prefills faster there. PrefixAffinityRouter
sends such a request to that replica first, unless its queue is clearly longer than the shortest,
and otherwise routes like Ray's power-of-two-choices router.

PrefixIndex is the pure-Python part (no Ray types, unit-tested without a cluster): it cuts a
request's routing text into fixed-size blocks, names each block by a chained hash of everything up
to it, and remembers, under an LRU bound, which replicas hold which blocks.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

BlockKey = bytes


def routing_text(request: Any) -> str:
    """The text a request's prefix is judged by: chat messages, else token ids, else the prompt."""
    messages = getattr(request, "messages", None)
    if messages:
        # role and content both count, so a resent conversation shares the prefix of the first send
        return "".join(f"{m.get('role', '')}\x00{m.get('content', '')}\x01" for m in messages)
    prompt_ids = getattr(request, "prompt_ids", None)
    if prompt_ids:
        # four characters a token, so 64-character blocks are 16 tokens, as one KV page
        try:
            return struct.pack(f"<{len(prompt_ids)}I", *prompt_ids).decode("latin-1")
        except struct.error:  # ids outside uint32: wrap them; a collision only costs a cache miss
            wrapped = [i & 0xFFFFFFFF for i in prompt_ids]
            return struct.pack(f"<{len(wrapped)}I", *wrapped).decode("latin-1")
    prompt = getattr(request, "prompt", None)
    return prompt if isinstance(prompt, str) else ""


class PrefixIndex:
    """Which replicas served which prompt prefixes, as chained block hashes under an LRU bound."""

    def __init__(self, block_chars: int = 64, max_entries: int = 200_000, max_blocks: int = 256) -> None:
        if block_chars < 1 or max_entries < 1 or max_blocks < 1:
            raise ValueError("block_chars, max_entries and max_blocks must be positive")
        self.block_chars = block_chars
        self.max_entries = max_entries
        self.max_blocks = max_blocks
        # least recently used first; a key names the whole prefix up to and including its block
        self._holders: OrderedDict[BlockKey, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def blocks(self, text: str) -> list[BlockKey]:
        """The chained keys of text's full blocks, at most max_blocks of them."""
        size = self.block_chars
        full_blocks = min(len(text) // size, self.max_blocks)
        keys: list[BlockKey] = []
        previous = b""
        for start in range(0, full_blocks * size, size):
            chunk = text[start : start + size].encode("utf-8", "surrogatepass")
            previous = hashlib.blake2b(previous + chunk, digest_size=8).digest()
            keys.append(previous)
        return keys

    def match(self, text: str, candidates: Iterable[str]) -> tuple[int, list[str]]:
        """How many leading blocks of text the best candidates hold, and those candidates."""
        remaining = set(candidates)
        depth = 0
        for key in self.blocks(text):
            holders = self._holders.get(key)
            if not holders:
                break
            # narrowing keeps the answer a contiguous prefix even if some entry was evicted oddly
            deeper = remaining & holders
            if not deeper:
                break
            remaining, depth = deeper, depth + 1
        return (depth, sorted(remaining)) if depth else (0, [])

    def record(self, text: str, replica: str) -> None:
        """The replica now holds every full block of text."""
        # deepest block first, so a prefix is always fresher than its extensions and LRU trims leaves
        for key in reversed(self.blocks(text)):
            holders = self._holders.get(key)
            if holders is None:
                self._holders[key] = {replica}
            else:
                holders.add(replica)
                self._holders.move_to_end(key)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop the replica everywhere (it died or left); O(entries), but replicas rarely leave."""
        for key in [k for k, holders in self._holders.items() if replica in holders]:
            holders = self._holders[key]
            holders.discard(replica)
            if not holders:
                del self._holders[key]


def pick_affine(
    matched_ids: Sequence[str], queue_lens: Mapping[str, int], imbalanced_threshold: float
) -> list[str]:
    """The matched replicas whose queue is at most imbalanced_threshold above the shortest one.

    queue_lens holds every candidate (0 where unknown); a matched id missing from it counts as 0.
    """
    if not matched_ids:
        return []
    shortest = min([*queue_lens.values(), *(queue_lens.get(m, 0) for m in matched_ids)])
    return [m for m in matched_ids if queue_lens.get(m, 0) - shortest <= imbalanced_threshold]


def _refused_by(pending_request: PendingRequest) -> frozenset[str]:
    """The replicas that already said they cannot take this request (EngineReplica.generate's
    `refused_by`, which the ingress fills as it sends a request again)."""
    refused = (pending_request.kwargs or {}).get("refused_by") or ()
    return frozenset(refused) if isinstance(refused, (tuple, list, frozenset, set)) else frozenset()


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Tries the replica that served a request's prefix first, then two random ones (power of two).

    The PrefixIndex lives in this router's own process, one per deployment handle, so routing makes
    no remote calls (Ray's PrefixCacheAffinityRouter keeps its tree in a detached actor reached with
    blocking ray.get); with several ingress replicas each handle learns prefixes on its own.

    Unlike PowerOfTwoChoicesRequestRouter there is no FIFOMixin: it hands the replica chosen for one
    request to the oldest pending request, which would spend one prompt's affinity on another.

    Ray calls on_request_routed only under its rejection protocol (the default outside Ray Client);
    without it the index stays empty and routing is plain power of two.
    """

    # Ray passes request_router_kwargs by name, so naming them narrows **kwargs on purpose
    def initialize_state(  # type: ignore[override]
        self,
        affinity: bool = True,
        block_chars: int = 64,
        imbalanced_threshold: float = 4,
        min_match_blocks: int = 1,
        max_entries: int = 200_000,
    ) -> None:
        self._affinity = affinity  # False: power of two choices, still steering retries away
        self._prefix_index = PrefixIndex(block_chars=block_chars, max_entries=max_entries)
        self._imbalanced_threshold = imbalanced_threshold
        self._min_match_blocks = max(1, min_match_blocks)

    @staticmethod
    def _replica_key(replica_id: ReplicaID) -> str:
        # unique_id: one router serves one deployment, so it is unique here and needs no formatting
        return replica_id.unique_id

    @staticmethod
    def _request_text(pending_request: PendingRequest | None) -> str:
        # recomputed rather than cached per request: a cache would leak entries for cancelled
        # requests, and hashing at most 256 blocks costs tens of microseconds
        if pending_request is None or not pending_request.args:
            return ""
        try:
            return routing_text(pending_request.args[0])
        except (AttributeError, TypeError):  # not a GenerationRequest: route without affinity
            return ""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        # the power-of-two choice only needs the locality and multiplex mixins this class shares
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self,  # type: ignore[arg-type]
            candidate_replicas=candidate_replicas,
            pending_request=pending_request,
        )
        if pending_request is None or not fallback:
            return fallback
        fallback = self._away_from_refusers(fallback, candidate_replicas, pending_request)
        # multiplexed requests belong to the model-id routing the fallback already applied
        if not self._affinity or pending_request.metadata.multiplexed_model_id:
            return fallback
        text = self._request_text(pending_request)
        if not text:
            return fallback
        refused = _refused_by(pending_request)
        by_key = {
            self._replica_key(r.replica_id): r
            for r in candidate_replicas
            if self._replica_key(r.replica_id) not in refused
        }
        depth, matched = self._prefix_index.match(text, by_key)
        if depth < self._min_match_blocks:
            return fallback
        queue_lens = {key: self._replica_queue_len_cache.get(r.replica_id) or 0 for key, r in by_key.items()}
        # a replica known to be full would only reject, so it is not worth a try
        open_matched = [m for m in matched if queue_lens[m] < by_key[m].max_ongoing_requests]
        affine = pick_affine(open_matched, queue_lens, self._imbalanced_threshold)
        if not affine:
            return fallback
        return [[by_key[m] for m in affine], *fallback]

    def _away_from_refusers(
        self,
        fallback: list[list[RunningReplica]],
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest,
    ) -> list[list[RunningReplica]]:
        """A request sent again avoids the replicas that could not take it (their engine went
        away and Ray has not replaced them yet), unless no other replica is there."""
        refused = _refused_by(pending_request)
        if not refused:
            return fallback
        ranks = [[r for r in rank if self._replica_key(r.replica_id) not in refused] for rank in fallback]
        ranks = [rank for rank in ranks if rank]
        if ranks:
            return ranks
        others = [r for r in candidate_replicas if self._replica_key(r.replica_id) not in refused]
        return [random.sample(others, min(2, len(others)))] if others else fallback

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        text = self._request_text(pending_request)
        if text:
            self._prefix_index.record(text, self._replica_key(replica_id))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._prefix_index.forget(self._replica_key(replica_id))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        previous_ids = set(self._replica_id_set)
        super().update_replicas(replicas)
        for replica_id in previous_ids - self._replica_id_set:
            self._prefix_index.forget(self._replica_key(replica_id))
