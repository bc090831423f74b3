"""Client and AsyncClient against a tiny in-test ROUTER server on 127.0.0.1 (real sockets, no engine)."""

import asyncio
import threading
import time

import pytest
import zmq

from ringleader.ipc import protocol as P
from ringleader.ipc.client import ERR_CLIENT_CLOSED, ERR_DISCONNECTED, AsyncClient, Client, Done, TokenChunk
from tests.conftest import wait_until

LIMITS = P.Limits(vocab_size=1000, max_context=512, max_tokens_cap=256)


class EchoServer:
    """Echoes each prompt id back as one token per tick, round-robin over active requests (so streams interleave).

    A request whose first prompt id is 999 never gets tokens (stays in flight until aborted).
    """

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.active = {}  # (identity, id) -> [remaining ids, prompt_tokens, sent]
        self.received = []
        self.aborts = []
        self.stop = threading.Event()
        self.closed = threading.Event()
        self.silent = False  # when set, ignore every frame (for timeout tests)
        self.stats_delay = 0.0  # seconds before a stats reply goes out (replies stay in order)
        self.stats_count = 0
        self.delayed = []  # (due, identity, msg)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def send(self, identity, msg):
        self.sock.send_multipart([identity, P.encode(msg)])

    def handle(self, identity, data):
        if self.silent:
            return
        try:
            req = P.decode_request(data, LIMITS)
        except P.ProtocolError as exc:
            self.send(identity, P.reject_msg(exc))
            return
        self.received.append(req)
        if isinstance(req, P.GenerateRequest):
            key = (identity, req.id)
            if key in self.active:
                self.send(identity, P.done_msg(req.id, "error", 0, 0, P.ERR_DUPLICATE_ID, "id in flight"))
                return
            ids = list(req.prompt_ids) if req.prompt_ids is not None else [ord(c) % 1000 for c in req.prompt]
            self.active[key] = [ids[: req.sampling.max_tokens], len(ids), 0]
        elif isinstance(req, P.AbortRequest):
            self.aborts.append(req.id)
            entry = self.active.pop((identity, req.id), None)
            if entry is not None:
                self.send(identity, P.done_msg(req.id, "abort", entry[1], entry[2]))
        elif isinstance(req, P.StatsRequest):
            self.stats_count += 1
            msg = P.stats_msg(
                {"active": len(self.active), "version": P.PROTOCOL_VERSION, "n": self.stats_count}
            )
            self.delayed.append((time.monotonic() + self.stats_delay, identity, msg))
        elif isinstance(req, P.PingRequest):
            self.send(identity, P.pong_msg())

    def tick(self):
        while self.delayed and self.delayed[0][0] <= time.monotonic():
            _, identity, msg = self.delayed.pop(0)
            self.send(identity, msg)
        for key in list(self.active):
            identity, rid = key
            remaining, prompt_tokens, sent = self.active[key]
            if remaining and remaining[0] == 999:
                continue
            if remaining:
                tok = remaining.pop(0)
                self.active[key][2] = sent + 1
                self.send(identity, P.token_msg(rid, [tok], f"<{tok}>"))
            else:
                del self.active[key]
                self.send(identity, P.done_msg(rid, "length", prompt_tokens, sent))

    def run(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop.is_set():
            if poller.poll(1):
                while True:
                    try:
                        identity, data = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(identity, data)
            self.tick()
        self.sock.close()
        self.ctx.term()
        self.closed.set()

    def shutdown(self):
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def server():
    srv = EchoServer()
    yield srv
    srv.shutdown()


# ------------------------------------------------------------ sync client


def test_single_stream(server):
    with Client(server.address, timeout=5) as client:
        stream = client.generate(prompt_ids=[5, 6, 7], max_tokens=10)
        chunks = list(stream)
        assert chunks == [TokenChunk([5], "<5>"), TokenChunk([6], "<6>"), TokenChunk([7], "<7>")]
        assert stream.done == Done("length", 3, 3)
        assert stream.done.ok
        assert stream.token_ids == [5, 6, 7]
        assert stream.text == "<5><6><7>"
        assert client.in_flight == 0


def test_many_threads_interleaved_streams(server):
    errors = []
    with Client(server.address, timeout=10) as client:

        def worker(w):
            try:
                streams = [client.generate(prompt_ids=[w, s, w + s, 7], max_tokens=8) for s in range(6)]
                for s, stream in enumerate(streams):
                    assert stream.wait().finish_reason == "length"
                    assert stream.token_ids == [w, s, w + s, 7]
                    assert stream.done.completion_tokens == 4
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert client.in_flight == 0
    assert len([r for r in server.received if isinstance(r, P.GenerateRequest)]) == 48


def test_user_ids_and_duplicates(server):
    with Client(server.address, timeout=5) as client:
        stream = client.generate(prompt_ids=[999], max_tokens=4, request_id="mine")
        assert stream.id == "mine"
        with pytest.raises(ValueError):
            client.generate(prompt_ids=[1], max_tokens=4, request_id="mine")
        with pytest.raises(TypeError):
            client.generate(prompt_ids=[1], max_tokens=4, request_id=1.5)
        with pytest.raises(ValueError):
            client.generate(prompt_ids=[1], max_tokens=4, request_id="x" * 300)
        auto = client.generate(prompt_ids=[2], max_tokens=4)
        assert isinstance(auto.id, int) and auto.id != "mine"
        assert auto.wait().finish_reason == "length"
        stream.abort()
        assert stream.wait().finish_reason == "abort"


def test_abort_mid_stream(server):
    with Client(server.address, timeout=5) as client:
        stream = client.generate(prompt_ids=[1, 999], max_tokens=4)
        first = next(stream)
        assert first.token_ids == [1]
        stream.abort()
        assert list(stream) == []
        assert stream.done == Done("abort", 2, 1)
        assert wait_until(lambda: stream.id in server.aborts)


def test_bad_request_comes_back_as_done(server):
    with Client(server.address, timeout=5) as client:
        done = client.complete(prompt_ids=[1], max_tokens=300).done  # over the server's cap, 256
        assert done.finish_reason == "error" and not done.ok
        assert done.error_code == "bad_request"
        assert done.error_message.startswith("max_tokens:")
        with pytest.raises(ValueError, match="^temperature: "):  # refused before it is sent
            client.generate(prompt_ids=[1], max_tokens=4, temperature=float("nan"))
        assert client.in_flight == 0
        # the client still works afterwards
        assert client.complete("ab", max_tokens=5).token_ids == [ord("a"), ord("b")]


def test_oversize_request_refused_locally(server):
    with Client(server.address, timeout=5, max_frame_bytes=1000) as client:
        with pytest.raises(ValueError, match="frame limit"):
            client.generate("x" * 2000)
        assert client.in_flight == 0


def test_stats_and_ping(server):
    with Client(server.address, timeout=5) as client:
        rtt = client.ping()
        assert 0 <= rtt < 5
        stats = client.stats()
        assert stats == {"active": 0, "version": 1, "n": 1}
        results = []
        threads = [
            threading.Thread(target=lambda: results.append((client.stats(), client.ping()))) for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(results) == 8


def test_timeouts_raise_timeout_error(server):
    server.silent = True
    with Client(server.address, timeout=0.2) as client:
        stream = client.generate(prompt_ids=[1], max_tokens=4)
        with pytest.raises(TimeoutError, match="within 0.2"):
            next(stream)
        with pytest.raises(TimeoutError):
            stream.wait(timeout=0.1)
        with pytest.raises(TimeoutError):
            client.stats()
        with pytest.raises(TimeoutError):
            client.ping(timeout=0.05)


def test_late_stats_reply_goes_to_its_own_waiter(server):
    server.stats_delay = 0.3
    with Client(server.address, timeout=5) as client:
        with pytest.raises(TimeoutError):
            client.stats(timeout=0.05)
        # the late reply to the first request must not be taken as the answer to the second
        assert client.stats()["n"] == 2


class LateCloseClient(Client):
    """Holds its I/O thread between sending (step 4) and the stop check (step 8) until close() has run."""

    def _check_liveness(self) -> None:
        super()._check_liveness()
        if self._core.poll_interval() is not None:  # a request is in flight: wait here for close()
            wait_until(lambda: self._stopping, timeout=5)


# LateCloseClient: a close() that lands after the I/O thread's send step still sends its aborts
@pytest.mark.parametrize("client_class", [Client, LateCloseClient])
def test_close_ends_open_streams_and_aborts_on_server(server, client_class):
    client = client_class(server.address, timeout=5)
    stream = client.generate(prompt_ids=[999], max_tokens=4)
    assert wait_until(lambda: any(isinstance(r, P.GenerateRequest) for r in server.received))
    client.close()
    assert stream.wait().error_code == ERR_CLIENT_CLOSED
    assert wait_until(lambda: stream.id in server.aborts, timeout=5)
    with pytest.raises(RuntimeError):
        client.generate("x")
    client.close()  # idempotent


def test_server_disconnect_fails_in_flight_streams():
    server = EchoServer()
    with Client(server.address, timeout=5) as client:
        stream = client.generate(prompt_ids=[999], max_tokens=4)
        assert wait_until(lambda: bool(server.active))
        server.shutdown()
        done = stream.wait(timeout=5)
        assert done.finish_reason == "error" and done.error_code == ERR_DISCONNECTED


def test_no_server_times_out():
    ctx = zmq.Context()
    probe = ctx.socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(0)
    ctx.term()
    with Client(f"tcp://127.0.0.1:{port}", timeout=0.2) as client:
        with pytest.raises(TimeoutError):
            client.complete("hi")


# ------------------------------------------------------------ asyncio client


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_async_interleaved_streams(server):
    async def main():
        async with AsyncClient(server.address, timeout=10) as client:

            async def one(i):
                stream = await client.generate(prompt_ids=[i, i + 1, i + 2], max_tokens=8)
                chunks = [chunk async for chunk in stream]
                assert [c.token_ids[0] for c in chunks] == [i, i + 1, i + 2]
                assert stream.done == Done("length", 3, 3)
                assert stream.text == f"<{i}><{i + 1}><{i + 2}>"
                return stream.token_ids

            results = await asyncio.gather(*(one(i) for i in range(40)))
            assert results == [[i, i + 1, i + 2] for i in range(40)]
            assert client.in_flight == 0
            stats, rtt = await asyncio.gather(client.stats(), client.ping())
            assert stats["version"] == 1 and rtt >= 0

    run(main())


def test_async_abort_bad_request_and_ids(server):
    async def main():
        async with AsyncClient(server.address, timeout=5) as client:
            stream = await client.generate(prompt_ids=[3, 999], max_tokens=4, request_id="a1")
            with pytest.raises(ValueError):
                await client.generate(prompt_ids=[1], max_tokens=4, request_id="a1")
            assert (await stream.__anext__()).token_ids == [3]
            await stream.abort()
            done = await stream.wait()
            assert done == Done("abort", 2, 1)
            with pytest.raises(ValueError, match="^top_p: "):  # refused before it is sent
                await client.generate(prompt_ids=[1], max_tokens=4, top_p=0)
            bad = await client.complete(prompt_ids=[1], max_tokens=300)
            assert bad.done.error_code == "bad_request" and bad.done.error_message.startswith("max_tokens:")

    run(main())


def test_async_timeouts_and_close(server):
    async def main():
        server.silent = True
        client = AsyncClient(server.address, timeout=0.2)
        stream = await client.generate(prompt_ids=[1], max_tokens=4)
        with pytest.raises(TimeoutError):
            await stream.__anext__()
        with pytest.raises(TimeoutError):
            await client.stats()
        with pytest.raises(TimeoutError):
            await client.ping(timeout=0.05)
        await client.aclose()
        assert (await stream.wait()).error_code == ERR_CLIENT_CLOSED
        with pytest.raises(RuntimeError):
            await client.generate("x")

    run(main())


def test_async_server_disconnect():
    server = EchoServer()

    async def main():
        async with AsyncClient(server.address, timeout=5) as client:
            stream = await client.generate(prompt_ids=[999], max_tokens=4)
            while not server.active:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(server.shutdown)
            done = await stream.wait(timeout=5)
            assert done.error_code == ERR_DISCONNECTED

    run(main())
