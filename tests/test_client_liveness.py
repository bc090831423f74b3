"""Clients that let go: an idle client costs no CPU, a dead or absent server raises instead of
hanging, and a stream nobody reads any more (closed, collected, its task cancelled) is aborted on
the server.  Real sockets on 127.0.0.1, the real server on `tiny` where a server is needed."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time

import msgpack
import pytest
import zmq

from ringleader.hostctl.serving.metrics import thread_cpu_seconds
from ringleader.ipc.client import ERR_DISCONNECTED, AsyncClient, Client
from tests.conftest import wait_until

LONG = dict(prompt_ids=[1, 2, 3], max_tokens=400, ignore_eos=True)


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def aborts_seen(server) -> int:
    return server.server.metrics.snapshot()["finished"].get("abort", 0)


def test_idle_sync_client_io_thread_sleeps(tiny_server):
    with Client(tiny_server.address, timeout=60) as c:
        c.complete(prompt_ids=[1, 2], max_tokens=4)
        c.stats()
        tid = c._thread.native_id
        before = thread_cpu_seconds(tid)
        time.sleep(3.0)
        used = thread_cpu_seconds(tid) - before
    assert used < 0.06, f"idle client I/O thread used {used:.2f} CPU-s in 3 s"


def test_idle_async_client_loop_thread_sleeps(tiny_server):
    result = {}

    async def main():
        async with AsyncClient(tiny_server.address, timeout=60) as c:
            await c.complete(prompt_ids=[1, 2], max_tokens=4)
            await c.stats()
            tid = threading.get_native_id()
            before = thread_cpu_seconds(tid)
            await asyncio.sleep(3.0)
            result["used"] = thread_cpu_seconds(tid) - before

    thread = threading.Thread(target=lambda: asyncio.run(main()))
    thread.start()
    thread.join(30)
    assert result["used"] < 0.06, f"idle async client used {result['used']:.2f} CPU-s in 3 s"


def test_no_server_raises_instead_of_hanging():
    address = free_address()
    with Client(address, connect_timeout=0.5) as c:
        start = time.monotonic()
        done = c.generate(prompt_ids=[1], max_tokens=2).wait()
        assert done.error_code == ERR_DISCONNECTED and "no connection" in done.error_message
        with pytest.raises(ConnectionError, match="no connection"):
            c.stats()
        assert time.monotonic() - start < 5

    async def main():
        async with AsyncClient(address, connect_timeout=0.5) as c:
            stream = await c.generate(prompt_ids=[1], max_tokens=2)
            done = await stream.wait()
            assert done.error_code == ERR_DISCONNECTED
            with pytest.raises(ConnectionError):
                await c.ping()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_server_that_goes_silent_is_pinged_then_given_up():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with Client(f"tcp://127.0.0.1:{port}", reply_timeout=0.9) as c:
            stream = c.generate(prompt_ids=[1], max_tokens=2)
            seen = []
            while router.poll(3000):
                seen.append(msgpack.unpackb(router.recv_multipart()[1])["op"])
                if "ping" in seen:
                    break
            done = stream.wait(timeout=10)
        # a connection says hello (1.7, before or after the generate); then silence costs one ping
        assert sorted(seen[:2]) == ["generate", "hello"] and seen[2:3] == ["ping"]
        assert done.error_code == ERR_DISCONNECTED and "no reply" in done.error_message
    finally:
        router.close(0)


def test_closing_or_dropping_a_sync_stream_aborts_it(tiny_server):
    with Client(tiny_server.address, timeout=60) as c:
        base = aborts_seen(tiny_server)
        stream = c.generate(**LONG)
        next(iter(stream))
        stream.close()
        assert wait_until(lambda: aborts_seen(tiny_server) == base + 1)
        assert stream.done is not None and c.in_flight == 0

        stream = c.generate(**LONG)
        next(iter(stream))
        del stream
        gc.collect()
        assert wait_until(lambda: aborts_seen(tiny_server) == base + 2)
        assert c.in_flight == 0
        with c.generate(**LONG) as stream:
            next(iter(stream))
        assert wait_until(lambda: aborts_seen(tiny_server) == base + 3)
        # a finished stream that is dropped later must not abort the next request of that id
        done = c.complete(prompt_ids=[1], max_tokens=2, request_id="same")
        again = c.generate(prompt_ids=[1], max_tokens=8, request_id="same", ignore_eos=True)
        del done
        gc.collect()
        assert again.wait().finish_reason == "length"


def test_cancelling_the_consumer_task_aborts_the_request(tiny_server):
    async def main():
        async with AsyncClient(tiny_server.address, timeout=60) as c:
            base = aborts_seen(tiny_server)

            async def consume(s, first: asyncio.Event):
                async for _ in s:
                    first.set()
                    await asyncio.sleep(0)

            # cancel mid-stream: on a loaded machine the server may send a whole stream in a few
            # frames before the client reads any, and such a stream ends before the cancel lands
            for _ in range(10):
                first = asyncio.Event()
                stream = await c.generate(**LONG)
                task = asyncio.create_task(consume(stream, first))
                await asyncio.wait_for(first.wait(), 30)
                if not task.done():
                    break
                await task
            else:
                pytest.fail(f"every stream ended before it could be cancelled; the last: {stream.done}")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert c.in_flight == 0
            deadline = time.monotonic() + 20
            while aborts_seen(tiny_server) != base + 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert aborts_seen(tiny_server) == base + 1

            async with await c.generate(**LONG) as s:  # leaving the block aborts
                await s.__anext__()
            stream = await c.generate(**LONG)
            del stream  # garbage collection of an unfinished stream aborts too
            gc.collect()
            deadline = time.monotonic() + 20
            while aborts_seen(tiny_server) != base + 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert aborts_seen(tiny_server) == base + 3
            assert c.in_flight == 0

    asyncio.run(asyncio.wait_for(main(), 60))
