"""Memory that grows with the requests served, checked in bounded time.

An in-process server on `tiny` gets rounds of mixed requests: most run to their length, some
are aborted (at once or part-way), some come from a bare socket that reads one reply and hangs
up without an abort, and some carry a `timeout_ms` too short to meet.  After a warm-up round, two things must stay flat from round to round once the server is
idle again:

- the Python heap: `sys.getallocatedblocks()` after a full collection (every live Python object
  takes at least one block, so a per-request dict entry that is never removed adds a block or
  more per request, while transient garbage adds nothing);
- the size of every dict, list, set and deque held by the server's parts (found by walking their
  attributes, so it needs no private names), which points at the culprit when the heap grows.

RSS is printed but not asserted: it moves with the allocator, not only with live objects (see
bench/lab/soak.py for the long-run view). `test_detects_a_per_request_leak` injects a leak and
checks that the heap measure catches it, so the bound below is known to be tight enough.
"""

from __future__ import annotations

import asyncio
import gc
import random
import sys
import time
from collections import Counter, deque

import msgpack
import zmq
import zmq.asyncio

from ringleader.hostctl.serving import inflight
from ringleader.ipc.client import AsyncClient
from tests.conftest import running_server

REQUESTS_PER_ROUND = 160
CONCURRENCY = 12
# Allowed heap growth per request served, in blocks, from the end of the first measured round to
# the end of the last. A dict entry left behind per request costs at least 2 (an int key above 256
# and a tuple value); what a healthy server shows here is 0.05 to 0.35 (allocator free lists and
# caches still filling).
MAX_BLOCKS_PER_REQUEST = 1.0


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def container_sizes(root, name: str = "server", depth: int = 3, seen=None) -> dict[str, int]:
    """len() of the builtin containers held as attributes by the server and its parts."""
    seen = set() if seen is None else seen
    out: dict[str, int] = {}
    if id(root) in seen or depth < 0:
        return out
    seen.add(id(root))
    for attr, value in list(getattr(root, "__dict__", {}).items()):
        path = f"{name}.{attr}"
        if isinstance(value, (dict, list, set, frozenset, deque)):
            out[path] = len(value)
        elif type(value).__module__.split(".")[0] in ("hostctl", "ipc", "device"):
            out.update(container_sizes(value, path, depth - 1, seen))
    return out


async def serve_round(address: str, n: int, seed: int) -> Counter:
    """n requests from CONCURRENCY clients; returns how they ended."""
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    todo = iter(range(n))
    ctx = zmq.asyncio.Context()

    async def hang_up(fields: dict) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        await sock.send(msgpack.packb({"op": "generate", "id": 1, **fields}))
        await asyncio.wait_for(sock.recv(), 60)  # one reply, then gone without a word
        sock.close(0)
        outcomes["hung_up"] += 1

    async def worker() -> None:
        async with AsyncClient(address, timeout=60) as client:
            for _ in todo:
                u = rng.random()
                fields = dict(
                    prompt_ids=[rng.randrange(3, 256) for _ in range(rng.randint(1, 96))],
                    max_tokens=rng.randint(1, 24),
                    ignore_eos=True,
                    seed=rng.randrange(1 << 32),
                )
                if u < 0.05:
                    await hang_up(fields)
                    continue
                if u < 0.10:
                    fields["timeout_ms"] = rng.choice([1, 5, 20])
                stream = await client.generate(**fields)
                if 0.10 <= u < 0.20:
                    stop_after = rng.randint(0, 3)
                    if stop_after:
                        async for _ in stream:
                            stop_after -= 1
                            if not stop_after:
                                break
                    await stream.abort()
                done = await stream.wait()
                outcomes[done.error_code or done.finish_reason] += 1

    try:
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    finally:
        ctx.term()
    return outcomes


def wait_idle(server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while len(server.table) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(server.table) == 0, f"{len(server.table)} requests still in the table after the round"
    time.sleep(0.2)  # the last frames leave the outbox, the engine goes idle


def measure(rounds: int, n: int = REQUESTS_PER_ROUND) -> list[dict]:
    """Round 0 is the warm-up; one sample per round after the server went idle again."""
    samples = []
    own = 0  # blocks held by the samples themselves, left out of later measurements
    with running_server() as bg:
        for r in range(rounds):
            outcomes = asyncio.run(serve_round(bg.address, n, seed=r))
            wait_idle(bg.server)
            for _ in range(3):
                gc.collect()
            blocks = sys.getallocatedblocks()
            samples.append(
                {
                    "round": r,
                    "blocks": blocks - own,
                    "rss_mb": rss_mb(),
                    "containers": container_sizes(bg.server),
                    "outcomes": dict(outcomes),
                    "types": Counter(type(o).__name__ for o in gc.get_objects()),
                }
            )
            gc.collect()
            own += sys.getallocatedblocks() - blocks
            print(
                f"round {r}: blocks {samples[-1]['blocks']} rss {samples[-1]['rss_mb']:.1f} MB "
                f"{dict(outcomes)}"
            )
            assert not any(k in outcomes for k in ("disconnected", "client_closed", "bad_reply")), (
                f"a request ended without the server's done: {dict(outcomes)}"
            )
    return samples


def growth(samples: list[dict], n: int = REQUESTS_PER_ROUND) -> tuple[float, dict, dict]:
    """Heap blocks per request, containers that grew, and object types that grew, from the end
    of the first measured round (samples[1]) to the end of the last."""
    first, last = samples[1], samples[-1]
    served = n * (len(samples) - 2)
    per_request = (last["blocks"] - first["blocks"]) / served
    grew = {
        k: (first["containers"].get(k, 0), v)
        for k, v in last["containers"].items()
        if v > first["containers"].get(k, 0)
    }
    types = {
        k: last["types"][k] - first["types"].get(k, 0)
        for k in last["types"]
        if last["types"][k] - first["types"].get(k, 0) >= served // 10
    }
    return per_request, grew, types


def test_live_objects_do_not_grow_with_requests_served():
    samples = measure(rounds=5)
    per_request, grew, types = growth(samples)
    assert not grew, f"containers of the server grew with the requests served: {grew}"
    assert per_request < MAX_BLOCKS_PER_REQUEST, (
        f"the Python heap grew by {per_request:.2f} blocks per request after warm-up "
        f"(object types that grew: {types})"
    )


def test_detects_a_per_request_leak(monkeypatch):
    """The measure above catches the smallest leak of the kind the issue suspected: a
    handle -> (code, message) entry per request that nobody pops (like an `abort_as` entry set
    for a request that ends on the host), kept outside the server's attributes so that only the
    heap measure can see it."""
    leak: dict = {}
    finish = inflight.RequestTable.finish
    code, message = "shutdown", "server shut down"

    def leaky_finish(self, handle, ending=None):
        req = finish(self, handle, ending)
        if req is not None:
            leak[handle] = (code, message)  # handles of the measured round are all above 256
        return req

    monkeypatch.setattr(inflight.RequestTable, "finish", leaky_finish)
    per_request, _, _ = growth(measure(rounds=3, n=130), n=130)
    assert per_request >= MAX_BLOCKS_PER_REQUEST, f"missed an injected leak: {per_request:.2f} blocks/request"
