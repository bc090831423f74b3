"""End to end over real sockets on 127.0.0.1: streaming, exactly one done, aborts, vanishing
clients, overload, engine death and shutdown."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict

from ringleader.device.backends.cpu import CpuBackend
from ringleader.device.backends.eager_runner import EagerStepRunner
from ringleader.device.text.tokenizer import ByteTokenizer
from ringleader.ipc.client import Client
from tests.conftest import RawPeer, running_server


def collect(peer: RawPeer, n_requests: int, timeout: float = 120.0):
    """Reads until n_requests dones arrived, then a little longer to catch duplicates."""
    tokens, dones, order_ok = defaultdict(list), defaultdict(list), True
    deadline = time.monotonic() + timeout
    while sum(len(v) for v in dones.values()) < n_requests:
        msg = peer.recv(max(0.01, deadline - time.monotonic()))
        if msg["op"] == "token":
            order_ok &= not dones[msg["id"]]  # no token after done
            tokens[msg["id"]].extend(msg["token_ids"])
        elif msg["op"] == "done":
            dones[msg["id"]].append(msg)
    for msg in peer.quiet_for(0.3):
        if msg["op"] == "done":
            dones[msg["id"]].append(msg)
        order_ok = False if msg["op"] == "token" else order_ok
    return tokens, dones, order_ok


def test_64_concurrent_streams_each_get_one_done_and_their_tokens(tiny_server, peer):
    wanted = {f"r{i}": 1 + (i * 7) % 40 for i in range(64)}
    for rid, n in wanted.items():
        peer.send(
            {
                "op": "generate",
                "id": rid,
                "prompt_ids": [1 + i for i in range(n % 9 + 1)],
                "max_tokens": n,
                "ignore_eos": True,
            }
        )
    tokens, dones, order_ok = collect(peer, 64)
    assert order_ok
    assert set(dones) == set(wanted)
    for rid, n in wanted.items():
        assert len(dones[rid]) == 1, f"{rid}: {len(dones[rid])} dones"
        done = dones[rid][0]
        assert done["finish_reason"] == "length"
        assert done["usage"] == {"prompt_tokens": n % 9 + 1, "completion_tokens": n}
        assert len(tokens[rid]) == n


def test_text_prompt_streams_text_that_matches_the_tokens(tiny_server):
    with Client(tiny_server.address, timeout=60) as c:
        stream = c.generate("Hello, ringleader", max_tokens=24, ignore_eos=True)
        chunks = list(stream)
    assert stream.done.finish_reason == "length"
    assert stream.done.prompt_tokens == len(ByteTokenizer().encode("Hello, ringleader"))
    assert sum(len(ch.token_ids) for ch in chunks) == 24
    full = ByteTokenizer().decode(stream.token_ids)
    assert "".join(ch.text for ch in chunks) == full


def test_abort_mid_stream_ends_with_abort_and_frees_the_slot(tiny_server, peer):
    peer.send({"op": "generate", "id": 1, "prompt_ids": [5, 6, 7], "max_tokens": 500, "ignore_eos": True})
    peer.recv_until(lambda m: m["op"] == "token")
    peer.send({"op": "abort", "id": 1})
    msgs = peer.recv_until(lambda m: m["op"] == "done")
    done = msgs[-1]
    assert done["finish_reason"] == "abort" and done["id"] == 1
    assert 0 < done["usage"]["completion_tokens"] < 500
    assert not [m for m in peer.quiet_for(0.3) if m.get("id") == 1]
    with Client(tiny_server.address, timeout=30) as c:
        deadline = time.monotonic() + 10
        while c.stats()["device"]["active_slots"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats()["device"]["active_slots"] == 0


def test_a_client_that_vanishes_has_its_requests_aborted(tiny_server):
    with Client(tiny_server.address, timeout=30) as c:
        aborted_before = c.stats()["finished"].get("abort", 0)
    gone = RawPeer(tiny_server.address)
    for i in range(3):
        gone.send({"op": "generate", "id": i, "prompt_ids": [9], "max_tokens": 400, "ignore_eos": True})
    gone.recv_until(lambda m: m["op"] == "token")
    gone.close()
    with Client(tiny_server.address, timeout=60) as c:
        other = c.complete(prompt_ids=[1, 2], max_tokens=8, ignore_eos=True)
        assert other.done.finish_reason == "length" and len(other.token_ids) == 8
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            s = c.stats()
            if s["finished"].get("abort", 0) >= aborted_before + 3 and s["in_flight"] == 0:
                break
            time.sleep(0.05)
        assert s["finished"].get("abort", 0) >= aborted_before + 3
        assert s["in_flight"] == 0 and s["device"]["active_slots"] == 0


def test_seeded_sampling_is_unchanged_by_concurrency(tiny_server):
    params = dict(
        prompt_ids=[10, 20, 30],
        max_tokens=24,
        temperature=0.9,
        top_p=0.95,
        top_k=50,
        seed=1234,
        ignore_eos=True,
    )
    with Client(tiny_server.address, timeout=60) as c:
        alone = c.complete(**params).token_ids
        crowd = [
            c.generate(prompt_ids=[i, i + 1], max_tokens=30, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(12)
        ]
        again = c.complete(**params).token_ids
        for s in crowd:
            s.wait()
    assert alone == again and len(alone) == 24
    assert len(set(alone)) > 3, "sampling at temperature 0.9 should vary"


def test_duplicate_in_flight_id_is_rejected_and_the_first_goes_on(tiny_server, peer):
    peer.send({"op": "generate", "id": "dup", "prompt_ids": [1], "max_tokens": 60, "ignore_eos": True})
    peer.send({"op": "generate", "id": "dup", "prompt_ids": [1], "max_tokens": 5})
    msgs = peer.recv_until(lambda m: m["op"] == "done")
    assert msgs[-1]["error"]["code"] == "duplicate_id"
    msgs = peer.recv_until(lambda m: m["op"] == "done")
    assert msgs[-1]["finish_reason"] == "length"
    assert sum(len(m["token_ids"]) for m in msgs if m["op"] == "token") <= 60


def test_prompt_longer_than_the_context_is_a_bad_request(tiny_server, peer):
    peer.send({"op": "generate", "id": 3, "prompt": "x" * 600, "max_tokens": 4})
    done = peer.recv_until(lambda m: m["op"] == "done")[-1]
    assert done["finish_reason"] == "error" and done["error"]["code"] == "bad_request"
    assert "prompt" in done["error"]["message"]
    peer.send({"op": "generate", "id": 4, "prompt_ids": [1] * 10, "max_tokens": 600})
    done = peer.recv_until(lambda m: m["op"] == "done")[-1]
    assert done["error"]["code"] == "bad_request" and "max_tokens" in done["error"]["message"]


def test_chat_messages_on_a_model_without_a_template_are_a_bad_request(tiny_server, peer):
    peer.send({"op": "generate", "id": "c", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    (done,) = peer.recv_until(lambda m: m["op"] == "done")
    assert done["error"]["code"] == "bad_request"
    assert done["error"]["message"] == "messages: this model has no chat template; send prompt or prompt_ids"
    peer.send({"op": "generate", "id": "p", "prompt": "hi", "max_tokens": 4})
    assert peer.recv_until(lambda m: m["op"] == "done")[-1]["finish_reason"] in ("stop", "length")


def test_overload_rejects_with_overloaded_and_everyone_gets_one_done():
    with running_server(n_slots=2, sq_size=4, pending_cap=4, server_options={"max_queued": 3}) as bg:
        peer = RawPeer(bg.address)
        n = 40
        for i in range(n):
            peer.send(
                {"op": "generate", "id": i, "prompt_ids": [1, 2, 3], "max_tokens": 30, "ignore_eos": True}
            )
        tokens, dones, _ = collect(peer, n)
        peer.close()
    assert all(len(v) == 1 for v in dones.values()) and len(dones) == n
    reasons = Counter(
        d[0]["finish_reason"] if d[0]["finish_reason"] != "error" else d[0]["error"]["code"]
        for d in dones.values()
    )
    assert reasons["overloaded"] > 0 and reasons["length"] > 0
    assert reasons["overloaded"] + reasons["length"] == n
    for rid, d in dones.items():
        if d[0]["finish_reason"] == "length":
            assert len(tokens[rid]) == 30


class FailingStepRunner(EagerStepRunner):
    """Fault injection: the model step raises after a few steps, as a device fault would."""

    fail_after = 5

    def finish(self):
        self.fail_after -= 1
        if self.fail_after < 0:
            raise RuntimeError("injected device fault")
        super().finish()


class FailingBackend(CpuBackend):
    runner_class = FailingStepRunner


def test_engine_death_ends_every_request_with_engine_dead():
    with running_server(backend_cls=FailingBackend) as bg:
        peer = RawPeer(bg.address)
        for i in range(6):
            peer.send({"op": "generate", "id": i, "prompt_ids": [1], "max_tokens": 100, "ignore_eos": True})
        tokens, dones, _ = collect(peer, 6, timeout=30)
        assert all(len(v) == 1 for v in dones.values()) and len(dones) == 6
        assert {d[0]["error"]["code"] for d in dones.values()} == {"engine_dead"}
        peer.send({"op": "generate", "id": "late", "prompt_ids": [1], "max_tokens": 3})
        done = peer.recv_until(lambda m: m["op"] == "done")[-1]
        assert done["error"]["code"] == "engine_dead"
        peer.close()


def test_shutdown_with_requests_in_flight_gives_each_one_done():
    with running_server(server_options={"drain_timeout_s": 0.2}) as bg:
        peer = RawPeer(bg.address)
        for i in range(5):
            peer.send(
                {"op": "generate", "id": i, "prompt_ids": [1, 2], "max_tokens": 500, "ignore_eos": True}
            )
        peer.recv_until(lambda m: m["op"] == "token")
        stopper = threading.Thread(target=bg.stop)
        stopper.start()
        tokens, dones, _ = collect(peer, 5, timeout=30)
        stopper.join()
        peer.close()
    assert len(dones) == 5 and all(len(v) == 1 for v in dones.values())
    assert {d[0]["error"]["code"] for d in dones.values()} == {"shutdown"}


class HangingStepRunner(EagerStepRunner):
    """Fault injection: the step stops making progress (a hung device), past the watchdog."""

    hang_after = 3

    def finish(self):
        self.hang_after -= 1
        if self.hang_after == 0:
            time.sleep(3.0)
        super().finish()


class HangingBackend(CpuBackend):
    runner_class = HangingStepRunner


def test_a_stalled_heartbeat_ends_every_request_with_engine_dead():
    with running_server(backend_cls=HangingBackend, server_options={"watchdog_s": 0.5}) as bg:
        peer = RawPeer(bg.address)
        for i in range(4):
            peer.send({"op": "generate", "id": i, "prompt_ids": [1], "max_tokens": 100, "ignore_eos": True})
        tokens, dones, _ = collect(peer, 4, timeout=30)
        assert {d[0]["error"]["code"] for d in dones.values()} == {"engine_dead"}
        assert "heartbeat" in dones[0][0]["error"]["message"]
        assert all(len(v) == 1 for v in dones.values())  # late device events are dropped
        peer.close()


def test_async_client_streams_concurrently(tiny_server):
    import asyncio

    from ringleader.ipc.client import AsyncClient

    async def main():
        async with AsyncClient(tiny_server.address, timeout=60) as c:
            streams = [
                await c.generate(prompt_ids=[i + 1], max_tokens=5 + i, ignore_eos=True) for i in range(16)
            ]

            async def drain(s):
                n = 0
                async for chunk in s:
                    n += len(chunk.token_ids)
                return n, await s.wait()

            return await asyncio.gather(*(drain(s) for s in streams))

    results = asyncio.run(main())
    for i, (n, done) in enumerate(results):
        assert n == 5 + i and done.finish_reason == "length" and done.completion_tokens == 5 + i


def test_done_reports_the_server_timing_split(tiny_server):
    with Client(tiny_server.address, timeout=60) as c:
        s = c.complete(prompt_ids=[1, 2, 3], max_tokens=6, ignore_eos=True)
    t = s.done.timing
    assert t is not None and 0 <= t["queue_ms"] <= t["ttft_ms"] <= t["e2e_ms"]


def test_queue_time_grows_when_slots_are_busy():
    with running_server(n_slots=1) as bg:
        with Client(bg.address, timeout=60) as c:
            first = c.generate(prompt_ids=[1], max_tokens=40, ignore_eos=True)
            second = c.generate(prompt_ids=[2], max_tokens=2, ignore_eos=True)
            first.wait()
            second.wait()
    assert second.done.timing["queue_ms"] > first.done.timing["queue_ms"]
    assert second.done.timing["queue_ms"] >= 0.5 * (
        first.done.timing["e2e_ms"] - first.done.timing["ttft_ms"]
    )


def test_stats_returns_when_the_backend_keys_figures_by_number():
    """What hung the first GPU run: the CUDA backend's description keyed its step graphs by
    bucket number, and the client dropped the stats reply as malformed."""

    class NumberedFigures(CpuBackend):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.description = dict(self.description, step_graph_nodes={1: "119 kernel", 32: "124 kernel"})

    with running_server(backend_cls=NumberedFigures) as bg:
        with Client(bg.address, timeout=10) as c:
            stats = c.stats()
    assert stats["backend"]["step_graph_nodes"] == {"1": "119 kernel", "32": "124 kernel"}
    assert stats["protocol"] == "1.10"  # a client checks it before it counts on a 1.10 field
