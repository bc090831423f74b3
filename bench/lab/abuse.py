"""The abuse scenarios of the reliability issue, measured against a real `ringleader serve`.

    python bench/lab/abuse.py --json bench/results/<date>-<machine>-reliability/abuse.json

Starts one server per scenario (CPU backend, `tiny`, the serve defaults unless told otherwise;
`--max-inflight-per-client 0` so one client may hold the thousands of requests the scenarios
need) and reports:
- idle_client: CPU-seconds an idle `Client` I/O thread and an idle `AsyncClient` loop thread use
  in --idle-s seconds after a request;
- abort_all: 1,100 requests in flight, then an abort for each: seconds until the last `done`, the
  finish reasons, and another client's 4-token request right after;
- fairness: a client with 1,000 requests in flight, then another client's 4-token request: its
  latency and how many of the first client's requests finished meanwhile;
- vanished: a client with 1,700 requests in flight disconnects: seconds until the server holds
  none of them, the slowest `stats` answer meanwhile; then the same again and SIGTERM: seconds
  until the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import threading
import time
from collections import Counter

import msgpack
import zmq

from ringleader.bench.servers import ServerOptions, ServerProcess
from ringleader.device.engine_config import EngineConfig
from ringleader.hostctl.serving.metrics import thread_cpu_seconds
from ringleader.ipc.client import AsyncClient, Client


class Peer:
    """A raw DEALER: the scenarios need thousands of requests without a client's bookkeeping."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(address)

    def send(self, msg: dict) -> None:
        self.sock.send(msgpack.packb(msg, use_bin_type=True))

    def dones(self, n: int, timeout: float = 300.0) -> list[dict]:
        out, deadline = [], time.monotonic() + timeout
        while len(out) < n:
            if not self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"{len(out)} of {n} dones after {timeout} s")
            msg = msgpack.unpackb(self.sock.recv(), raw=False)
            if msg["op"] == "done":
                out.append(msg)
        return out

    def close(self) -> None:
        self.sock.close(0)


def generate(rid, n_out: int) -> dict:
    return {"op": "generate", "id": rid, "prompt_ids": [1, 2, 3, 4], "max_tokens": n_out, "ignore_eos": True}


def wait_in_flight(client: Client, pred, timeout: float = 120.0) -> tuple[float, float]:
    """Polls stats until pred(in_flight); returns (seconds waited, slowest stats answer)."""
    start, slowest = time.monotonic(), 0.0
    while True:
        t0 = time.monotonic()
        n = client.stats()["in_flight"]
        slowest = max(slowest, time.monotonic() - t0)
        if pred(n):
            return time.monotonic() - start, slowest
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"in_flight still {n} after {timeout} s")
        time.sleep(0.01)


def idle_client(address: str, idle_s: float) -> dict:
    with Client(address) as c:
        c.complete(prompt_ids=[1, 2], max_tokens=4)
        tid = c._thread.native_id
        before = thread_cpu_seconds(tid)
        time.sleep(idle_s)
        sync_cpu = thread_cpu_seconds(tid) - before

    async def run_async() -> float:
        async with AsyncClient(address) as c:
            await c.complete(prompt_ids=[1, 2], max_tokens=4)
            tid = threading.get_native_id()
            before = thread_cpu_seconds(tid)
            await asyncio.sleep(idle_s)
            return thread_cpu_seconds(tid) - before

    return {
        "idle_s": idle_s,
        "sync_io_thread_cpu_s": sync_cpu,
        "async_loop_thread_cpu_s": asyncio.run(run_async()),
    }


def abort_all(address: str, n: int = 1100) -> dict:
    owner, other = Peer(address), Peer(address)
    with Client(address) as c:
        for i in range(n):
            owner.send(generate(i, 512))
        wait_in_flight(c, lambda k: k == n)
        t0 = time.monotonic()
        for i in range(n):
            owner.send({"op": "abort", "id": i})
        reasons = Counter(d["finish_reason"] for d in owner.dones(n))
        seconds = time.monotonic() - t0
    t1 = time.monotonic()
    other.send(generate("probe", 4))
    other.dones(1)
    probe_s = time.monotonic() - t1
    owner.close()
    other.close()
    return {
        "in_flight": n,
        "abort_all_s": seconds,
        "finish_reasons": dict(reasons),
        "next_4_token_request_s": probe_s,
    }


def fairness(address: str, n: int = 1000, hog_tokens: int = 128) -> dict:
    hog, small = Peer(address), Peer(address)
    with Client(address) as c:
        for i in range(n):
            hog.send(generate(i, hog_tokens))
        wait_in_flight(c, lambda k: k == n)
        finished_before = sum(c.stats()["finished"].values())
        t0 = time.monotonic()
        small.send(generate("mine", 4))
        small.dones(1)
        latency = time.monotonic() - t0
        finished = sum(c.stats()["finished"].values()) - finished_before - 1
        window = c.stats()["device_window"]
    hog.close()
    small.close()
    return {
        "hog_requests": n,
        "hog_max_tokens": hog_tokens,
        "other_request_latency_s": latency,
        "hog_requests_finished_meanwhile": finished,
        "device_window": window,
    }


def vanished(address: str, server: ServerProcess, n: int = 1700) -> dict:
    with Client(address) as c:
        ghost = Peer(address)
        for i in range(n):
            ghost.send(generate(i, 512))
        wait_in_flight(c, lambda k: k == n)
        ghost.close()
        cleared_s, slowest_stats_s = wait_in_flight(c, lambda k: k == 0)
        ghost = Peer(address)
        for i in range(n):
            ghost.send(generate(i, 512))
        wait_in_flight(c, lambda k: k == n)
        ghost.close()
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(timeout=120)
    return {
        "in_flight": n,
        "ended_after_disconnect_s": cleared_s,
        "slowest_stats_meanwhile_s": slowest_stats_s,
        "sigterm_exit_s": time.monotonic() - t0,
        "exit_code": rc,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EngineConfig.model)
    p.add_argument("--slots", type=int, default=None, help="default: the serve default")
    p.add_argument("--drain-timeout", type=float, default=5.0)
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    results = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "model": args.model,
        "date": time.strftime("%Y-%m-%d"),
    }
    extra = ["--max-inflight-per-client", "0", "--drain-timeout", str(args.drain_timeout)]
    for name, run in (
        ("idle_client", lambda a, _: idle_client(a, args.idle_s)),
        ("abort_all", lambda a, _: abort_all(a)),
        ("fairness", lambda a, _: fairness(a)),
        ("vanished", vanished),
    ):
        options = ServerOptions(model=args.model, slots=args.slots, extra=extra)
        with ServerProcess(options.args()) as server:
            results[name] = run(server.address, server)
        print(name, json.dumps(results[name]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
