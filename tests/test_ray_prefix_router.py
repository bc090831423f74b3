"""The prefix-affinity router for Ray Serve: its block index, routing text and replica choice.

PrefixIndex and pick_affine are pure Python; the router itself is built in-process on fake replicas
(no Ray cluster), which is enough to drive choose_replicas and the hooks Ray calls.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from ringleader.hostctl.gateway.openai_api import parse_request
from ringleader.hostctl.ray_serve.prefix_router import (
    PrefixAffinityRouter,
    PrefixIndex,
    pick_affine,
    routing_text,
)

# ---------------------------------------------------------------- blocks


def test_only_full_blocks_count_and_max_blocks_caps_them():
    index = PrefixIndex(block_chars=4, max_blocks=3)
    assert index.blocks("abc") == []
    assert len(index.blocks("abcd")) == 1
    assert len(index.blocks("abcdefghij")) == 2
    assert len(index.blocks("x" * 100)) == 3


def test_keys_are_chained_and_stable():
    index = PrefixIndex(block_chars=4)
    first, second = index.blocks("aaaabbbb"), index.blocks("aaaacccc")
    assert first[0] == second[0] and first[1] != second[1]
    # the same block text after a different prefix is a different key
    assert index.blocks("xxxxbbbb")[1] != first[1]
    # blake2b, not hash(): the same text gives the same keys in any index or process
    assert PrefixIndex(block_chars=4).blocks("aaaabbbb") == first


def test_the_messages_form_distinguishes_roles():
    index = PrefixIndex(block_chars=4)
    as_user = routing_text(SimpleNamespace(messages=[{"role": "user", "content": "hello there"}]))
    as_system = routing_text(SimpleNamespace(messages=[{"role": "system", "content": "hello there"}]))
    assert as_user != as_system
    assert index.blocks(as_user)[0] != index.blocks(as_system)[0]
    # and where a message ends counts: one message "ab" is not two messages "a", "b"
    one = routing_text(SimpleNamespace(messages=[{"role": "user", "content": "ab"}]))
    two = routing_text(
        SimpleNamespace(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    )
    assert one != two


# ---------------------------------------------------------------- match / record / forget / LRU


def test_the_longest_prefix_wins_between_two_replicas():
    index = PrefixIndex(block_chars=4)
    index.record("aaaabbbbcccc", "r1")
    index.record("aaaaxxxx", "r2")
    assert index.match("aaaabbbbccccdd", ["r1", "r2"]) == (3, ["r1"])
    assert index.match("aaaaxxxxyyyy", ["r1", "r2"]) == (2, ["r2"])
    assert index.match("aaaazzzz", ["r1", "r2"]) == (1, ["r1", "r2"])
    # only candidates count: r1 is not routable now, so r2's one shared block is the best
    assert index.match("aaaabbbbcccc", ["r2"]) == (1, ["r2"])
    assert index.match("aaaabbbbcccc", []) == (0, [])


def test_a_different_prefix_or_a_short_text_matches_nothing():
    index = PrefixIndex(block_chars=4)
    index.record("aaaabbbb", "r1")
    assert index.match("baaabbbb", ["r1"]) == (0, [])
    assert index.match("aaa", ["r1"]) == (0, [])
    assert index.match("", ["r1"]) == (0, [])


def test_forget_removes_a_replica_and_its_empty_entries():
    index = PrefixIndex(block_chars=4)
    index.record("aaaabbbb", "r1")
    index.record("aaaa", "r2")
    assert len(index) == 2
    index.forget("r1")
    assert index.match("aaaabbbb", ["r1", "r2"]) == (1, ["r2"])
    assert len(index) == 1  # "aaaabbbb"'s second block had only r1
    index.forget("r2")
    assert len(index) == 0 and index.match("aaaabbbb", ["r1", "r2"]) == (0, [])


def test_lru_evicts_the_least_recently_used_key():
    index = PrefixIndex(block_chars=4, max_entries=3)
    for text in ("aaaa", "bbbb", "cccc"):
        index.record(text, "r1")
    index.record("aaaa", "r2")  # refreshes "aaaa": "bbbb" is now the oldest
    index.record("dddd", "r1")
    assert len(index) == 3
    assert index.match("bbbb", ["r1", "r2"]) == (0, [])
    assert index.match("aaaa", ["r1", "r2"]) == (1, ["r1", "r2"])
    assert index.match("cccc", ["r1"]) == (1, ["r1"])
    assert index.match("dddd", ["r1"]) == (1, ["r1"])


def test_lru_trims_the_deepest_blocks_of_a_prefix_first():
    index = PrefixIndex(block_chars=4, max_entries=2)
    index.record("aaaabbbbcccc", "r1")
    # had the root been evicted, nothing after it could match
    assert index.match("aaaabbbbcccc", ["r1"]) == (2, ["r1"])


# ---------------------------------------------------------------- routing_text


def test_routing_text_of_real_generation_requests():
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    assert routing_text(chat) == "user\x00hi\x01"
    assert routing_text(parse_request({"prompt": "abc"}, chat=False)) == "abc"
    ids = routing_text(parse_request({"prompt": [1, 2, 3]}, chat=False))
    assert len(ids) == 12 and ids != routing_text(parse_request({"prompt": [1, 2, 4]}, chat=False))
    assert routing_text(SimpleNamespace()) == "" and routing_text(object()) == ""


def test_a_resent_conversation_extends_the_first_send():
    first = parse_request({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    resent = parse_request(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "more"},
            ]
        },
        chat=True,
    )
    assert routing_text(resent).startswith(routing_text(first))


def test_token_ids_make_fixed_width_blocks_of_16_tokens():
    index = PrefixIndex()  # 64 characters a block
    assert index.blocks(routing_text(parse_request({"prompt": list(range(15))}, chat=False))) == []
    assert len(index.blocks(routing_text(parse_request({"prompt": list(range(32))}, chat=False)))) == 2
    # ids outside uint32 still give a routing text instead of an error
    assert len(routing_text(SimpleNamespace(prompt_ids=[-1, 2**40]))) == 8


# ---------------------------------------------------------------- pick_affine


def test_pick_affine_keeps_matched_replicas_within_the_threshold():
    lens = {"a": 5, "b": 1, "c": 0}  # the shortest queue is c's, unmatched
    assert pick_affine(["a", "b"], lens, imbalanced_threshold=5) == ["a", "b"]
    assert pick_affine(["a", "b"], lens, imbalanced_threshold=4) == ["b"]
    assert pick_affine(["a"], lens, imbalanced_threshold=4) == []
    assert pick_affine([], lens, imbalanced_threshold=100) == []
    assert pick_affine(["new"], {"a": 3}, imbalanced_threshold=0) == ["new"]  # unknown counts as 0


# ---------------------------------------------------------------- the router, on fake replicas

DEPLOYMENT = DeploymentID(name="EngineReplica")
LONG_PROMPT = "You are a careful assistant. " * 10  # 290 characters: four 64-character blocks


class FakeReplica:
    """What the router reads of a RunningReplica, answering queue-length probes with 0."""

    def __init__(self, unique_id: str, max_ongoing_requests: int = 8) -> None:
        self.replica_id = ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT)
        self.node_id = ""
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.max_ongoing_requests = max_ongoing_requests

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0

    def push_proxy_handle(self, handle) -> None:
        pass


def pending(arg, request_id: str = "req", refused_by: tuple[str, ...] = ()) -> PendingRequest:
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id)
    kwargs = {"refused_by": refused_by} if refused_by else {}
    return PendingRequest(args=[arg] if arg is not None else [], kwargs=kwargs, metadata=metadata)


async def make_router(n_replicas: int = 4, **state) -> tuple[PrefixAffinityRouter, list[FakeReplica]]:
    router = PrefixAffinityRouter(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(**state)
    replicas = [FakeReplica(f"r{i}") for i in range(n_replicas)]
    router.update_replicas(replicas)
    await asyncio.sleep(0.05)  # let the probes that update_replicas starts settle the cache
    return router, replicas


async def ranks(router: PrefixAffinityRouter, request: PendingRequest) -> list[list[str]]:
    chosen = await router.choose_replicas(list(router.curr_replicas.values()), request)
    return [[r.replica_id.unique_id for r in rank] for rank in chosen]


def test_the_router_ranks_the_replica_that_served_the_prefix_first():
    async def scenario():
        router, replicas = await make_router()
        request = pending(parse_request({"prompt": LONG_PROMPT}, chat=False))
        before = await ranks(router, request)
        assert len(before) == 1 and len(before[0]) == 2  # nothing learned yet: plain power of two
        router.on_request_routed(request, replicas[2].replica_id, None)
        resend = pending(parse_request({"prompt": LONG_PROMPT + " And more."}, chat=False), "req2")
        after = await ranks(router, resend)
        assert after[0] == ["r2"] and len(after) == 2 and len(after[1]) == 2
        # another prompt gains nothing from r2
        other = pending(parse_request({"prompt": "Something else entirely. " * 10}, chat=False), "req3")
        assert len(await ranks(router, other)) == 1

    asyncio.run(scenario())


def test_the_router_skips_an_overloaded_or_full_affine_replica():
    async def scenario():
        router, replicas = await make_router(imbalanced_threshold=4)
        request = pending(parse_request({"prompt": LONG_PROMPT}, chat=False))
        router.on_request_routed(request, replicas[1].replica_id, None)
        cache = router.replica_queue_len_cache
        cache.update(replicas[1].replica_id, 4)
        assert (await ranks(router, request))[0] == ["r1"]  # 4 above the idle ones: still fine
        cache.update(replicas[1].replica_id, 5)
        assert len(await ranks(router, request)) == 1  # 5 above: power of two
        for r in replicas:
            cache.update(r.replica_id, 7)
        cache.update(replicas[1].replica_id, 8)  # at max_ongoing_requests, it would only reject
        assert len(await ranks(router, request)) == 1

    asyncio.run(scenario())


def test_min_match_blocks_and_requests_without_text_fall_back():
    async def scenario():
        router, replicas = await make_router(min_match_blocks=5)
        request = pending(parse_request({"prompt": LONG_PROMPT}, chat=False))
        router.on_request_routed(request, replicas[0].replica_id, None)
        assert len(await ranks(router, request)) == 1  # four blocks match, five are asked for
        for arg in (None, "not a GenerationRequest", SimpleNamespace(messages=[1, 2])):
            router.on_request_routed(pending(arg), replicas[0].replica_id, None)
            assert len(await ranks(router, pending(arg))) == 1

    asyncio.run(scenario())


def test_replicas_that_leave_or_die_are_forgotten():
    async def scenario():
        router, replicas = await make_router()
        request = pending(parse_request({"prompt": LONG_PROMPT}, chat=False))
        router.on_request_routed(request, replicas[0].replica_id, None)
        router.on_request_routed(request, replicas[3].replica_id, None)
        router.update_replicas(replicas[1:])  # r0 leaves
        assert (await ranks(router, request))[0] == ["r3"]
        router.on_replica_actor_died(replicas[3].replica_id)
        assert router._prefix_index.match(LONG_PROMPT, ["r0", "r1", "r2", "r3"]) == (0, [])
        assert len(await ranks(router, request)) == 1

    asyncio.run(scenario())


def test_a_request_sent_again_avoids_the_replicas_that_refused_it():
    """The ingress resends a request a replica could not take (its engine went away) with
    refused_by: with or without affinity the router never offers those replicas again, unless
    no other replica is left."""

    async def scenario(affinity: bool):
        router, replicas = await make_router(affinity=affinity)
        request = pending(parse_request({"prompt": LONG_PROMPT}, chat=False))
        router.on_request_routed(request, replicas[2].replica_id, None)  # r2 holds the prefix
        for _ in range(40):
            resent = pending(parse_request({"prompt": LONG_PROMPT}, chat=False), refused_by=("r2", "r0"))
            offered = {r for rank in await ranks(router, resent) for r in rank}
            assert offered and offered <= {"r1", "r3"}, offered
        router.update_replicas(replicas[2:3])  # only the refuser is left: it is tried again
        alone = pending(parse_request({"prompt": LONG_PROMPT}, chat=False), refused_by=("r2",))
        assert {r for rank in await ranks(router, alone) for r in rank} == {"r2"}

    asyncio.run(scenario(affinity=True))
    asyncio.run(scenario(affinity=False))


def test_without_affinity_the_router_is_power_of_two():
    async def scenario():
        router, replicas = await make_router(affinity=False)
        request = pending(parse_request({"prompt": LONG_PROMPT}, chat=False))
        router.on_request_routed(request, replicas[2].replica_id, None)
        chosen = await ranks(router, request)
        assert len(chosen) == 1 and len(chosen[0]) == 2  # the prefix learned changes nothing

    asyncio.run(scenario())
