"""The host's token path, before and after, side by side in one run (issue 51).

    python -m ringleader.bench.lab.token_path --tree before=/tmp/ab-before --tree after=. --out DIR
    python -m ringleader.bench.lab.token_path --tree device=. --tree host=. \
        --serve-args "device=--device cuda --scheduler device" --serve-args "host=--device cuda --scheduler host" ...

For each round and each tree (interleaved, so both see the same machine), one server from that
tree's code (`serve --model null --slots 256 --null-step-us 2000 --null-step-wait sleep`: a 2 ms
step that costs the host nothing, as a GPU's does, with its HTTP gateway), and against it:

  one-connection   256 streams over one DEALER socket (a service multiplexing its users)
  many-connections 256 streams over 256 DEALER sockets, one each
  http             64 streams through the gateway's streaming /v1/completions

each point with the client asking for batched frames (`hello`, protocol 1.7) and, on the after
tree, once more without (an older client against the new server). The client is the lean one
below, in its own process, so its CPU is not the server's. Per point: the server process's CPU
per 1k tokens (every thread: its CPU clock, hostctl.serving.metrics.pid_cpu_seconds), each server thread's (the server's own names from
`stats.thread_cpu_s`, ZeroMQ's I/O threads from /proc), TTFT p50/p99, tokens/s, tokens per frame,
and, where the server counts them (1.7), completion wakes per step and the wake latency.
`--cpu-interference N` repeats every point with N busy processes beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import zmq

from ringleader.bench.servers import free_port
from ringleader.hostctl.serving.metrics import pid_cpu_seconds


def task_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (comm) of another process, summed over its threads of one name
    (nanoseconds on CPU: each thread's schedstat, as the server's own thread_cpu_s)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[comm] = out.get(comm, 0.0) + ns / 1e9
    return out


# ---------------------------------------------------------------- the client (its own process)


def run_client(
    address: str, streams: int, connections: int, requests: int, output_len: int, hello: bool, text: bool
) -> dict:
    """Closed loop: `streams` requests in flight over `connections` sockets until `requests` ended.
    Reads per-request and batch frames alike; returns TTFTs, tokens, frames and its own CPU.
    text False: ids only (generate.detokenize false, where the server is 1.7 or later)."""
    ctx = zmq.Context()
    socks = []
    for _ in range(connections):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
        if hello:
            s.send(msgpack.packb({"op": "hello", "batch": True}))
    prompt = list(range(300, 332))
    ids_only = not text and server_revision(ctx, address) >= 7
    sent_at: dict[tuple[int, int], float] = {}
    first_at: dict[tuple[int, int], float] = {}
    next_id = 0
    ended = errors = tokens = frames = 0
    batched_frames = 0

    def send(conn: int) -> None:
        nonlocal next_id
        rid = next_id
        next_id += 1
        msg = {
            "op": "generate",
            "id": rid,
            "prompt_ids": prompt,
            "max_tokens": output_len,
            "ignore_eos": True,
        }
        if ids_only:
            msg["detokenize"] = False
        sent_at[(conn, rid)] = time.perf_counter()
        socks[conn].send(msgpack.packb(msg))

    for i in range(streams):
        send(i % connections)
    cpu0, t0 = time.process_time(), time.perf_counter()
    deadline = t0 + 600
    index = {s: i for i, s in enumerate(socks)}
    while ended < requests and time.perf_counter() < deadline:
        for s, _ in poller.poll(1000):
            conn = index[s]
            while True:
                try:
                    frame = s.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                now = time.perf_counter()
                frames += 1
                msg = msgpack.unpackb(frame)
                op = msg["op"]
                if op == "batch":
                    batched_frames += 1
                    tokens += len(msg["token_ids"])
                    for rid, n in zip(msg["ids"], msg["n_tokens"]):
                        if n and (conn, rid) not in first_at:
                            first_at[(conn, rid)] = now
                    dones = msg.get("done", ())
                elif op == "token":
                    tokens += len(msg["token_ids"])
                    key = (conn, msg["id"])
                    if msg["token_ids"] and key not in first_at:
                        first_at[key] = now
                    dones = ()
                elif op == "done":
                    dones = (msg,)
                else:
                    dones = ()
                for done in dones:
                    ended += 1
                    errors += done["finish_reason"] == "error"
                    if next_id < requests:
                        send(conn)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    ttft = sorted(first_at[k] - sent_at[k] for k in first_at)
    ctx.destroy(0)
    return {
        "ended": ended, "errors": errors, "tokens": tokens, "frames": frames,
        "batched_frames": batched_frames, "wall_s": wall, "client_cpu_s": cpu,
        "ttft_ms_p50": 1e3 * ttft[len(ttft) // 2] if ttft else None,
        "ttft_ms_p99": 1e3 * ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] if ttft else None,
    }  # fmt: skip


def server_revision(ctx: zmq.Context, address: str) -> int:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    s.send(msgpack.packb({"op": "stats"}))
    if not s.poll(10_000):
        raise TimeoutError("no stats from the server")
    reply = msgpack.unpackb(s.recv())
    s.close(0)
    return int(reply.get("protocol", "1.0").split(".")[1])


def run_http_client(url: str, streams: int, requests: int, output_len: int) -> dict:
    """`streams` streaming /v1/completions in flight through the gateway (the bench's HTTP
    generator, this tree's)."""
    from ringleader.bench.http_loadgen import measure_http
    from ringleader.bench.loadgen import Load
    from ringleader.bench.workloads import RequestSpec

    specs = [RequestSpec(prompt_ids=list(range(300, 332)), max_tokens=output_len)] * requests
    res = measure_http(url, specs, Load(concurrency=streams), model="null")
    recs = [r for r in res.records if r.ok]  # the null model's `next` pattern never ends early
    ttft = sorted(r.token_times()[0] - r.send_t for r in recs if r.token_times())
    return {
        "ended": len(res.records), "errors": len(res.records) - len(recs),
        "tokens": sum(r.output_tokens for r in recs), "frames": None, "batched_frames": None,
        "wall_s": res.wall_s, "client_cpu_s": res.loadgen_cpu_s,
        "ttft_ms_p50": 1e3 * ttft[len(ttft) // 2] if ttft else None,
        "ttft_ms_p99": 1e3 * ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] if ttft else None,
    }  # fmt: skip


# ---------------------------------------------------------------- the driver


class Server:
    def __init__(self, tree: str, step_us: float, slots: int, token_budget: int, extra: list[str]):
        self.port, self.http_port = free_port(), free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        cmd = [
            sys.executable, "-m", "ringleader.hostctl.cli", "serve", "--model", "null",
            "--slots", str(slots), "--null-step-us", str(step_us), "--null-step-wait", "sleep",
            "--policy", "fifo", "--no-prefix-caching", "--bind", self.address,
            "--http", f"127.0.0.1:{self.http_port}", "--max-inflight-per-client", "4096",
            "--token-budget", str(token_budget), *extra,
        ]  # fmt: skip
        # run from the tree: `python -m` puts the working directory first on sys.path
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                self.stats(timeout_ms=500)
                return
            except TimeoutError:
                time.sleep(0.2)
        raise RuntimeError("server did not answer stats")

    def stats(self, timeout_ms: int = 5000) -> dict:
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.address)
        try:
            s.send(msgpack.packb({"op": "stats"}))
            if not s.poll(timeout_ms):
                raise TimeoutError
            return msgpack.unpackb(s.recv())
        finally:
            s.close(0)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure_point(server: Server, tree: str, point: dict) -> dict:
    """One load point against a running server, the client in its own process (this tree's
    code for HTTP, the lean client above for ZeroMQ)."""
    cmd = [sys.executable, "-m", "ringleader.bench.lab.token_path", "client", json.dumps(point)]
    if point["kind"] == "http":
        point = {**point, "url": f"http://127.0.0.1:{server.http_port}"}
    else:
        point = {**point, "address": server.address}
    cmd[-1] = json.dumps(point)
    before, cpu0, tasks0 = server.stats(), pid_cpu_seconds(server.proc.pid), task_cpu_s(server.proc.pid)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    cpu1, tasks1, after = pid_cpu_seconds(server.proc.pid), task_cpu_s(server.proc.pid), server.stats()
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    client = json.loads(out.stdout.strip().splitlines()[-1])
    ktok = max(client["tokens"], 1) / 1000
    threads = {
        name: (after["thread_cpu_s"].get(name, 0.0) - before["thread_cpu_s"].get(name, 0.0)) * 1e3 / ktok
        for name in after.get("thread_cpu_s", {})
    }
    threads["zmq-io"] = (
        sum(tasks1.get(n, 0) - tasks0.get(n, 0) for n in tasks1 if n.startswith("ZMQbg")) * 1e3 / ktok
    )
    steps = after["device"].get("steps", 0) - before["device"].get("steps", 0)
    wakes = {}
    dev_after, dev_before = after["device"], before["device"]
    if "completion_wakes" in dev_after:
        wakes["completion_wakes_per_step"] = (
            dev_after["completion_wakes"] - dev_before["completion_wakes"]
        ) / max(steps, 1)
    if "completion_batches" in after:
        wakes["completion_batches_per_step"] = (
            after["completion_batches"] - before["completion_batches"]
        ) / max(steps, 1)
    for key in ("wake_latency_us_p50", "wake_latency_us_p99"):
        if dev_after.get(key) is not None:
            wakes[key] = dev_after[key]  # since the server started (a histogram: no per-run delta here)
    return {
        **{k: v for k, v in point.items() if k not in ("address", "url")},
        **client,
        "server_cpu_ms_per_1k": (cpu1 - cpu0) * 1e3 / ktok,
        "client_cpu_ms_per_1k": client["client_cpu_s"] * 1e3 / ktok,
        "tokens_per_s": client["tokens"] / client["wall_s"],
        "tokens_per_frame": client["tokens"] / client["frames"] if client["frames"] else None,
        "steps": steps,
        "threads_ms_per_1k": threads,
        **wakes,
    }


def points(args) -> list[dict]:
    common = {"requests": args.requests, "output_len": args.output_len}
    return [
        {"kind": "zmq", "name": "one-connection", "streams": args.streams, "connections": 1, **common},
        {"kind": "zmq", "name": "one-connection-text", "streams": args.streams, "connections": 1, "text": True,
         **common},
        {"kind": "zmq", "name": "many-connections", "streams": args.streams, "connections": args.streams, **common},
        {"kind": "http", "name": "http", "streams": args.http_streams, "requests": args.http_requests,
         "output_len": args.output_len},
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "report":  # the summary again, from a run's rows.json
        rows = json.loads((Path(argv[1]) / "rows.json").read_text())
        trees = list(dict.fromkeys(r["tree"] for r in rows))
        (Path(argv[1]) / "summary.md").write_text(summary(rows, trees))
        return 0
    if argv and argv[0] == "client":
        point = json.loads(argv[1])
        if point["kind"] == "http":
            res = run_http_client(point["url"], point["streams"], point["requests"], point["output_len"])
        else:
            res = run_client(
                point["address"], point["streams"], point["connections"], point["requests"],
                point["output_len"], point["hello"], point.get("text", False),
            )  # fmt: skip
        print(json.dumps(res))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH, the code a server runs")
    p.add_argument(
        "--serve-args", action="append", default=[],
        help="NAME=ARGS: more `serve` arguments for that tree's server (e.g. device=--device cuda)",
    )  # fmt: skip
    p.add_argument(
        "--token-budget", type=int, default=8192, help="serve --token-budget: every prompt in one step"
    )
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--step-us", type=float, default=2000.0)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--http-streams", type=int, default=64)
    p.add_argument("--http-requests", type=int, default=256)
    p.add_argument(
        "--legacy-client", action="append", default=[], metavar="NAME",
        help="on that tree's server, also run each ZeroMQ point without hello (an older client)",
    )  # fmt: skip
    p.add_argument("--cpu-interference", type=int, default=0)
    p.add_argument("--only", default="", help="comma list of point names to run")
    args = p.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree)
    extra = {name: args.split() for name, args in (a.split("=", 1) for a in args.serve_args)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    wanted = {n for n in args.only.split(",") if n}
    for rnd in range(args.rounds):
        for busy in sorted({0, args.cpu_interference}):
            for name, tree in trees.items():
                server = Server(tree, args.step_us, args.slots, args.token_budget, extra.get(name, []))
                try:
                    for point in points(args):
                        if wanted and point["name"] not in wanted:
                            continue
                        legacy = name in args.legacy_client and point["kind"] == "zmq"
                        hellos = [True, False] if legacy else [True]
                        for hello in hellos:
                            run = {**point, "hello": hello}
                            row = _measure_busy(server, tree, run, busy)
                            row.update(tree=name, round=rnd, busy=busy)
                            rows.append(row)
                            print(_line(row), flush=True)
                finally:
                    server.stop()
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    (out / "summary.md").write_text(summary(rows, list(trees)))
    return 0


def _median(values: list[float]) -> float:
    values = sorted(v for v in values if v is not None)
    if not values:
        return float("nan")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def summary(rows: list[dict], trees: list[str]) -> str:
    """Medians over the rounds, per (busy, point, client kind, tree), with each tree's ratio to
    the first tree's server CPU (the first named is the baseline)."""
    keys = sorted({(r["busy"], r["name"], r["hello"]) for r in rows}, key=lambda k: (k[0], k[1], not k[2]))
    base = trees[0]
    out = [
        "| busy | point | client | tree | server CPU ms/1k tok | x lower than " + base
        + " | completions | frontend | engine | zmq-io | other | TTFT p50 / p99 ms | tok/s | tok/frame "
        + "| wakes/step | wake µs p50 / p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for busy, name, hello in keys:
        base_cpu = _median([r["server_cpu_ms_per_1k"] for r in rows if (r["busy"], r["name"], r["hello"], r["tree"]) == (busy, name, True, base)])  # fmt: skip
        for tree in trees:
            mine = [
                r for r in rows if (r["busy"], r["name"], r["hello"], r["tree"]) == (busy, name, hello, tree)
            ]
            if not mine:
                continue
            cpu = _median([r["server_cpu_ms_per_1k"] for r in mine])
            th = {k: _median([r["threads_ms_per_1k"].get(k, 0.0) for r in mine]) for k in ("completions", "frontend", "engine", "zmq-io")}  # fmt: skip
            other = cpu - sum(th.values())
            wakes = _median([r.get("completion_wakes_per_step") for r in mine])
            lat = (_median([r.get("wake_latency_us_p50") for r in mine]), _median([r.get("wake_latency_us_p99") for r in mine]))  # fmt: skip
            tpf = _median([r["tokens_per_frame"] for r in mine])
            client = ("hello" if hello else "no hello (1.6)") if name != "http" else "gateway"
            out.append(
                f"| {busy} | {name} | {client} | {tree} | {cpu:.2f} | {base_cpu / cpu:.1f} | "
                + " | ".join(f"{th[k]:.2f}" for k in ("completions", "frontend", "engine", "zmq-io"))
                + f" | {other:.2f} | {_median([r['ttft_ms_p50'] for r in mine]):.1f} / "
                + f"{_median([r['ttft_ms_p99'] for r in mine]):.1f} | {_median([r['tokens_per_s'] for r in mine]):,.0f} | "
                + (f"{tpf:.1f}" if tpf == tpf else "-")
                + f" | {wakes:.2f} | {lat[0]:g} / {lat[1]:g} |"
            )
    return "\n".join(out) + "\n"


def _measure_busy(server: Server, tree: str, point: dict, busy: int) -> dict:
    if not busy:
        return measure_point(server, tree, point)
    from ringleader.bench.interference import CpuInterference

    with CpuInterference(busy):
        return measure_point(server, tree, point)


def _line(r: dict) -> str:
    th = " ".join(f"{k}={v:.2f}" for k, v in sorted(r["threads_ms_per_1k"].items()))
    wk = " ".join(f"{k}={r[k]:.2f}" for k in r if k.startswith(("completion_", "wake_")))
    return (
        f"{r['tree']:>7} r{r['round']} busy={r['busy']} {r['name']:>16} hello={int(r['hello'])} "
        f"server={r['server_cpu_ms_per_1k']:.2f}ms/1k client={r['client_cpu_ms_per_1k']:.2f} "
        f"tok/s={r['tokens_per_s']:.0f} tok/frame={r['tokens_per_frame'] or 0:.1f} "
        f"ttft p50/p99={r['ttft_ms_p50']:.1f}/{r['ttft_ms_p99']:.1f}ms errors={r['errors']} | {th} | {wk}"
    )


if __name__ == "__main__":
    sys.exit(main())
