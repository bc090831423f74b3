"""The load generator: one zmq.asyncio DEALER socket speaking the wire protocol (docs/protocol.md),
asking for `batch` frames (1.7: one frame per step for all its streams) and reading plain ones too.

It is deliberately thin so that it is never the bottleneck: request frames are encoded before
the clock starts, replies are decoded with plain msgpack on one receive loop that stamps each
frame with time.perf_counter() as it is taken off the socket, and the closed loop sends the
next request straight from the `done` handler (no task per request). Its own CPU time
(time.process_time: this process, all threads, so zmq's I/O thread too, in nanoseconds) is
measured over the run.

Two ways to load the server:
- closed loop: `concurrency` requests in flight at all times until all are sent;
- open loop: requests sent at the arrival times given (see workloads.arrival_times),
  however many are already in flight. The lag between a request's scheduled and actual send
  time is reported (`send_lag_ms`): a large lag means the generator could not keep up.
Latencies are measured from the actual send time.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import zmq
import zmq.asyncio

from ringleader.bench.metrics import RequestRecord, summarize
from ringleader.bench.workloads import RequestSpec

log = logging.getLogger("ringleader.bench")


@dataclass
class Load:
    """How a run drives the server: closed loop at `concurrency`, or open loop at `request_rate`."""

    concurrency: int | None = None
    request_rate: float | None = None
    arrival_s: list[float] | None = None  # open loop: send time of each request from the start

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return f"rate={self.request_rate:g}/s"


@dataclass
class RunResult:
    records: list[RequestRecord]
    stats_before: dict
    stats_after: dict
    loadgen_cpu_s: float
    wall_s: float
    send_lag_ms: dict = field(default_factory=dict)
    warmup_failed: int = 0


@dataclass
class SendOptions:
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int = 0


def cpu_seconds_self() -> float:
    """CPU time of this process (all threads, not child processes): CLOCK_PROCESS_CPUTIME_ID,
    what getrusage(RUSAGE_SELF) user + system adds up to, at nanosecond resolution."""
    return time.process_time()


async def run_schedule(
    n: int, load: Load, send: Callable[[int, Callable[[], None]], None], timeout_s: float, lags: list[float]
) -> int:
    """Sends requests 0..n-1 as `load` says and waits until all have ended or `timeout_s` passed;
    returns how many had not ended. Shared by the ZeroMQ and the HTTP load generators.

    `send(i, finished)` starts request i at once (stamping its send time) and must arrange for
    `finished()` to be called exactly once when that request has ended. Closed loop: the first
    `concurrency` requests go out at once, and each `finished()` sends the next one straight
    away (no task per request). Open loop: a sender task sends request i at `load.arrival_s[i]`
    from the start, however many are in flight, and appends its lateness (s) to `lags`.
    """
    if n == 0:
        return 0
    loop = asyncio.get_running_loop()
    all_done = loop.create_future()
    remaining = n
    closed = load.concurrency is not None
    next_index = iter(range(n))

    def finished() -> None:
        nonlocal remaining
        remaining -= 1
        if closed:
            i = next(next_index, None)
            if i is not None:
                send(i, finished)
        if remaining == 0 and not all_done.done():
            all_done.set_result(None)

    async def send_on_schedule(arrival_s: list[float]) -> None:
        start = time.perf_counter()
        for i, at in enumerate(arrival_s):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            send(i, finished)
            lags.append(max(0.0, time.perf_counter() - (start + at)))

    if closed:
        if load.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        for _ in range(min(load.concurrency, n)):
            send(next(next_index), finished)
        sender = None
    else:
        if load.arrival_s is None or len(load.arrival_s) != n:
            raise ValueError("an open-loop load needs one arrival time per request")
        sender = loop.create_task(send_on_schedule(load.arrival_s))
    try:
        await asyncio.wait_for(asyncio.shield(all_done), timeout_s)
    except asyncio.TimeoutError:
        log.warning("run timed out after %.0f s with %d requests unfinished", timeout_s, remaining)
    finally:
        if sender is not None:
            sender.cancel()
    return remaining


class LoadGenerator:
    """Use inside one event loop: `async with LoadGenerator(addr) as gen: await gen.measure(...)`."""

    def __init__(self, address: str, *, timeout_s: float = 600.0, options: SendOptions | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.options = options or SendOptions()
        self.last_error: dict | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task | None = None
        self._ids = itertools.count(1)
        self._inflight: dict[int, tuple[RequestRecord, object]] = {}
        self._waiters: deque[asyncio.Future] = deque()  # stats and pong replies, FIFO
        self._lags: list[float] = []  # open loop: actual - scheduled send time of each request
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._hello_unanswered = False

    async def __aenter__(self) -> LoadGenerator:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self._sock = sock
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())
        self._hello_unanswered = True  # protocol 1.7: this connection's streams in `batch` frames
        self._send_frame(self._pack({"op": "hello", "batch": True}))
        return self

    async def __aexit__(self, *exc) -> None:
        for rid in list(self._inflight):
            self._send_frame(self._pack({"op": "abort", "id": rid}))
        if self._recv_task is not None:
            self._recv_task.cancel()
            try:
                await self._recv_task
            except (asyncio.CancelledError, Exception):
                pass
        if self._sock is not None:
            self._sock.close(linger=100)
        if self._ctx is not None:
            self._ctx.term()

    # ---- control messages -----------------------------------------------------------------
    async def _control(self, op: str, timeout: float, **fields) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._send_frame(self._pack({"op": op, **fields}))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no {op!r} reply from {self.address} within {timeout} s") from None

    async def ping(self, timeout: float = 5.0) -> float:
        t0 = time.perf_counter()
        await self._control("ping", timeout)
        return time.perf_counter() - t0

    async def stats(self, timeout: float = 30.0, timeline_after_seq: int | None = None) -> dict:
        """timeline_after_seq (protocol 1.6): the device timeline's figures over the steps after
        it only (timeline_after_seq() of the reply read before a run); a 1.5 server ignores it."""
        fields = {"timeline_after_seq": timeline_after_seq} if timeline_after_seq else {}
        reply = await self._control("stats", timeout, **fields)
        reply.pop("op", None)
        return reply

    # ---- a measured run ---------------------------------------------------------------------
    async def measure(
        self, specs: list[RequestSpec], load: Load, warmup: list[RequestSpec] | None = None
    ) -> RunResult:
        """Warm-up (excluded), stats, the run, stats again."""
        warmup_failed = 0
        if warmup:
            conc = max(1, min(len(warmup), load.concurrency or len(warmup)))
            recs = await self.run(warmup, Load(concurrency=conc))
            warmup_failed = sum(1 for r in recs if not r.ok)
        before = await self.stats()
        cpu0, t0 = cpu_seconds_self(), time.perf_counter()
        records = await self.run(specs, load)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds_self() - cpu0
        after = await self.stats(timeline_after_seq=timeline_after_seq(before))
        lag = summarize(self._lags, scale=1e3) if load.concurrency is None else {}
        return RunResult(records, before, after, cpu, wall, lag, warmup_failed)

    async def run(self, specs: list[RequestSpec], load: Load) -> list[RequestRecord]:
        """Sends every spec (closed or open loop) and waits for all their `done`s (or the timeout)."""
        records = [RequestRecord(i, len(s.prompt_ids), s.max_tokens) for i, s in enumerate(specs)]
        ids = [next(self._ids) for _ in specs]
        frames = [self._generate_frame(rid, s, i) for i, (rid, s) in enumerate(zip(ids, specs))]

        def send(i: int, finished) -> None:
            rec = records[i]
            self._inflight[ids[i]] = (rec, finished)
            rec.send_t = time.perf_counter()
            self._send_frame(frames[i])

        self._lags = []
        try:
            await run_schedule(len(specs), load, send, self.timeout_s, self._lags)
        finally:
            self._give_up(ids, records)
        return records

    def _give_up(self, ids: list[int], records: list[RequestRecord]) -> None:
        """Requests still unanswered (timeout) are aborted and counted as failed."""
        for rid, rec in zip(ids, records):
            if rid in self._inflight:
                del self._inflight[rid]
                self._send_frame(self._pack({"op": "abort", "id": rid}))
                rec.finish_reason, rec.error_code = "error", "timeout"
            elif rec.done_t is None and rec.send_t == 0.0:
                rec.finish_reason, rec.error_code = "error", "not_sent"

    def _generate_frame(self, rid: int, spec: RequestSpec, index: int) -> bytes:
        o = self.options
        return self._pack(
            {
                "op": "generate",
                "id": rid,
                "prompt_ids": spec.prompt_ids,
                "max_tokens": spec.max_tokens,
                "temperature": o.temperature,
                "seed": (o.seed + index) % (1 << 63),
                "ignore_eos": o.ignore_eos,
            }
        )

    # ---- socket I/O ---------------------------------------------------------------------------
    def _send_frame(self, frame: bytes) -> None:
        # the HWM is 0 (unlimited), so this completes at once; keep errors visible
        fut = self._sock.send(frame, copy=False)
        if fut.done() and fut.exception() is not None:
            raise fut.exception()

    async def _recv_loop(self) -> None:
        sock = self._sock
        while True:
            frame = await sock.recv(copy=True)
            self._dispatch(frame, time.perf_counter())
            while True:  # drain what is already queued without going back to the event loop
                try:
                    frame = sock.recv(zmq.NOBLOCK, copy=True)
                    if isinstance(frame, asyncio.Future):
                        frame = frame.result()
                except zmq.Again:
                    break
                self._dispatch(frame, time.perf_counter())

    def _dispatch(self, frame: bytes, t: float) -> None:
        try:
            self._handle(frame, t)
        except Exception:
            log.exception("load generator failed to handle a reply")

    def _handle(self, frame: bytes, t: float) -> None:
        try:
            msg = msgpack.unpackb(frame, raw=False)
            op = msg["op"]
        except Exception:
            log.warning("ignoring a malformed reply (%d bytes)", len(frame))
            return
        if op == "token":
            self._chunk(msg.get("id"), len(msg.get("token_ids") or ()), t)
        elif op == "batch":  # 1.7: chunks as columns, then dones (docs/protocol.md)
            for rid, n in zip(msg["ids"], msg["n_tokens"]):
                self._chunk(rid, n, t)
            for done in msg.get("done", ()):
                self._done(done, t)
        elif op == "done":
            self._done(msg, t)
        elif op == "hello":
            self._hello_unanswered = False
        elif op == "error" and self._hello_unanswered and msg.get("id") is None:
            self._hello_unanswered = False  # a server older than 1.7: per-request frames
        elif op in ("stats", "pong"):
            while self._waiters:
                fut = self._waiters.popleft()
                if not fut.done():
                    fut.set_result(msg)
                    break
        elif op == "error":
            self.last_error = msg
            log.warning("server rejected a frame: %s: %s", msg.get("code"), msg.get("message"))

    def _chunk(self, rid, n: int, t: float) -> None:
        entry = self._inflight.get(rid)
        if entry is not None:
            rec = entry[0]
            rec.chunk_t.append(t)
            rec.chunk_n.append(n)

    def _done(self, msg: dict, t: float) -> None:
        entry = self._inflight.pop(msg.get("id"), None)
        if entry is None:
            return
        rec, finished = entry
        rec.done_t = t
        rec.finish_reason = msg.get("finish_reason")
        rec.completion_tokens = (msg.get("usage") or {}).get("completion_tokens", 0)
        err = msg.get("error") or {}
        rec.error_code, rec.error_message = err.get("code"), err.get("message")
        timing = msg.get("timing")
        if isinstance(timing, dict) and isinstance(timing.get("queue_ms"), (int, float)):
            rec.server_queue_ms = float(timing["queue_ms"])
        finished()


def measure(
    address: str,
    specs: list[RequestSpec],
    load: Load,
    *,
    warmup: list[RequestSpec] | None = None,
    options: SendOptions | None = None,
    timeout_s: float = 600.0,
) -> RunResult:
    """Synchronous wrapper: one event loop and one socket for the whole measurement."""

    async def go() -> RunResult:
        async with LoadGenerator(address, timeout_s=timeout_s, options=options) as gen:
            await gen.ping(timeout=30.0)
            return await gen.measure(specs, load, warmup)

    return asyncio.run(go())


def timeline_after_seq(stats_before: dict) -> int | None:
    """What the `stats` read after a run asks for as timeline_after_seq: the device's `steps`
    counter read before it, so the device timeline's figures (bubble, step, scheduler phases)
    cover exactly the run's steps (their seq, step + 1, is above it), not the load points
    before; None where the reply has no such counter (an HTTP endpoint, hf)."""
    steps = (stats_before.get("device") or {}).get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0 else None


def read_stats(address: str, timeout: float = 10.0, timeline_after_seq: int | None = None) -> dict:
    async def go() -> dict:
        async with LoadGenerator(address) as gen:
            return await gen.stats(timeout, timeline_after_seq)

    return asyncio.run(go())


def wait_ready(address: str, timeout: float) -> bool:
    """True once the server answers a ping (tried every 0.2 s until `timeout`)."""

    async def go() -> bool:
        async with LoadGenerator(address) as gen:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    await gen.ping(timeout=min(0.5, max(0.05, deadline - time.monotonic())))
                    return True
                except TimeoutError:
                    pass
            return False

    return asyncio.run(go())
