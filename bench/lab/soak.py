"""Soak: keep a server under mixed load for minutes to hours and watch what drifts.

    python bench/lab/soak.py --duration 10m --concurrency 16 --interval 30 --json soak.json

It starts `python -m ringleader.hostctl.cli serve` (bench/servers.py) or drives one that is already running
(--address), with `--concurrency` workers on the real asyncio client (ringleader.ipc.client.AsyncClient).
Each worker sends one request at a time: random prompt and output lengths; a fraction of them
aborted part-way (--abort-fraction); a fraction sent on a bare DEALER socket that is closed after
a reply or two without reading the rest and without an abort (--disconnect-fraction), which is
how a crashed client looks to the server. Workers replace their client every --reconnect-every
requests, so the server keeps seeing new peers.

Every --interval seconds one row: server RSS (/proc/<pid>/statm of a server it started, else
`stats.process_rss_bytes`), server CPU seconds (process and per thread from `stats`), requests
ended, tokens, CPU seconds per 1000 output tokens, p50/p99 TTFT and E2E of the requests that
ended in the interval, and the terminal accounting: every request should end with exactly one
`done`; ones whose client hung up on purpose before it came count as `abandoned`. After the load
stops it waits --idle seconds and reads RSS again. The summary has the RSS slope in MB per 1000
requests over the second half of the run (least squares over the interval rows) and the server's
own books after idle (nothing in flight, accepted == finished).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from collections import Counter

import msgpack
import numpy as np
import zmq
import zmq.asyncio

if __package__ in (None, ""):  # `python bench/lab/soak.py` from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ringleader.bench.metrics import percentile
from ringleader.bench.servers import ServerOptions, ServerProcess, resolve_device
from ringleader.bench.workloads import (
    FIRST_PROMPT_ID,
    LAST_PROMPT_ID,
    LENGTH_DISTS,
    fit_context,
    sample_lengths,
)
from ringleader.device.engine_config import DEVICES, EngineConfig
from ringleader.hostctl.serving.metrics import pid_cpu_seconds
from ringleader.ipc.client import AsyncClient

_PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_duration(text: str) -> float:
    """'90' or '90s' -> 90.0; '10m' -> 600.0; '2h' -> 7200.0."""
    units = {"s": 1, "m": 60, "h": 3600}
    text = text.strip().lower()
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(
            f"expected a duration like 90, 90s, 10m or 2h, got {text!r}"
        ) from None


def proc_rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (OSError, IndexError, ValueError):
        return None


def proc_cpu_s(pid: int) -> float | None:
    """CPU of the server process it started (its CPU clock, ns; /proc ticks as a fallback)."""
    return pid_cpu_seconds(pid)


def self_cpu_s() -> float:
    """CPU of this process (the load generator), every thread, not its children."""
    return time.process_time()


def slope_per_1k(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of y over x, times 1000 (MB per 1000 requests); None under 3 points."""
    if len(xs) < 3 or max(xs) == min(xs):
        return None
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0] * 1000.0)


class Rec:
    """What the soak saw of one request."""

    __slots__ = ("end_t", "first_t", "kind", "outcome", "send_t", "tokens")

    def __init__(self, kind: str):
        self.kind = kind  # normal, abort or disconnect
        self.send_t = time.perf_counter()
        self.first_t: float | None = None
        self.end_t: float | None = None
        self.tokens = 0
        self.outcome = "none"  # finish reason, error:<code>, abandoned, no_done:<why>


class TapClient(AsyncClient):
    """AsyncClient that also counts the `done` frames per id, so a duplicate `done` shows up
    (the client itself drops what comes after a request's first `done`)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.done_frames: Counter = Counter()  # request id -> `done` frames received

    def _dispatch(self, frame: bytes) -> None:
        try:
            obj = msgpack.unpackb(frame, raw=False)
            if obj.get("op") == "done":
                self.done_frames[obj.get("id")] += 1
        except Exception:
            pass
        super()._dispatch(frame)

    def duplicates(self) -> int:
        return sum(1 for n in self.done_frames.values() if n > 1)


class Soak:
    def __init__(self, args, address: str, server_pid: int | None):
        self.a, self.address, self.pid = args, address, server_pid
        self.rng = random.Random(args.seed)
        self.nrng = np.random.default_rng(args.seed)
        self.ctx = zmq.asyncio.Context()
        self.ended: list[Rec] = []  # ended since the last row
        self.totals: Counter = Counter()  # outcome -> requests, whole run
        self.kinds: Counter = Counter()
        self.duplicate_dones = 0
        self.sent = self.n_ended = self.tokens = 0
        self.rows: list[dict] = []
        self.max_ctx: int | None = None
        self._lens: list[tuple[int, int]] = []

    # ---- the workload -----------------------------------------------------------------------
    def lengths(self) -> tuple[int, int]:
        if not self._lens:
            a = self.a
            ins = sample_lengths(a.length_dist, a.input_len, 4096, self.nrng, a.range_ratio)
            outs = sample_lengths(a.length_dist, a.output_len, 4096, self.nrng, a.range_ratio)
            self._lens = list(zip(ins.tolist(), outs.tolist()))
        n_in, n_out = self._lens.pop()
        return fit_context(n_in, n_out, self.max_ctx) if self.max_ctx else (n_in, n_out)

    def request(self) -> tuple[str, dict]:
        u = self.rng.random()
        kind = (
            "disconnect"
            if u < self.a.disconnect_fraction
            else "abort"
            if u < self.a.disconnect_fraction + self.a.abort_fraction
            else "normal"
        )
        n_in, n_out = self.lengths()
        fields = dict(
            prompt_ids=[self.rng.randrange(FIRST_PROMPT_ID, LAST_PROMPT_ID) for _ in range(n_in)],
            max_tokens=n_out,
            ignore_eos=self.a.ignore_eos,
            temperature=self.a.temperature,
            seed=self.rng.randrange(1 << 63),
        )
        return kind, fields

    def end(self, rec: Rec, outcome: str) -> None:
        rec.end_t, rec.outcome = time.perf_counter(), outcome
        self.ended.append(rec)
        self.totals[outcome] += 1
        self.n_ended += 1
        self.tokens += rec.tokens

    # ---- one request -------------------------------------------------------------------------
    async def run_client_request(self, client: AsyncClient, kind: str, fields: dict) -> None:
        rec, stream = Rec(kind), None
        abort_after = self.rng.randint(0, max(0, fields["max_tokens"] - 1)) if kind == "abort" else None
        try:
            stream = await client.generate(**fields, timeout=self.a.request_timeout)
            if abort_after == 0:
                await stream.abort()
            async for chunk in stream:
                if chunk.token_ids and rec.first_t is None:
                    rec.first_t = time.perf_counter()
                rec.tokens += len(chunk.token_ids)
                if abort_after and rec.tokens >= abort_after:
                    abort_after = None
                    await stream.abort()
        except TimeoutError:
            if stream is not None:
                await stream.abort()
            return self.end(rec, "no_done:timeout")
        d = stream.done
        outcome = f"error:{d.error_code}" if d.error_code else d.finish_reason
        if d.error_code in ("disconnected", "client_closed", "bad_reply"):  # made up by the client
            outcome = f"no_done:{d.error_code}"
        self.end(rec, outcome)

    async def run_disconnect(self, fields: dict) -> None:
        """A bare socket that reads one to three replies and hangs up without an abort."""
        rec = Rec("disconnect")
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        outcome = "abandoned"
        try:
            await sock.send(msgpack.packb({"op": "generate", "id": 1, **fields}, use_bin_type=True))
            for _ in range(self.rng.randint(1, 3)):
                if not await sock.poll(int(self.a.request_timeout * 1000)):
                    break
                msg = msgpack.unpackb(await sock.recv(), raw=False)
                if msg.get("op") == "token":
                    rec.first_t = rec.first_t or time.perf_counter()
                    rec.tokens += len(msg.get("token_ids") or ())
                elif msg.get("op") == "done":
                    err = (msg.get("error") or {}).get("code")
                    outcome = f"error:{err}" if err else msg.get("finish_reason")
                    break
        finally:
            sock.close(0)
        self.end(rec, outcome)

    async def close_client(self, client: TapClient) -> None:
        await client.aclose()
        self.duplicate_dones += client.duplicates()

    async def worker(self, w: int, deadline: float) -> None:
        client, used = None, 0
        try:
            while time.monotonic() < deadline:
                kind, fields = self.request()
                self.sent += 1
                self.kinds[kind] += 1
                if kind == "disconnect":
                    await self.run_disconnect(fields)
                    continue
                if client is None:
                    client = TapClient(self.address, timeout=self.a.request_timeout)
                await self.run_client_request(client, kind, fields)
                used += 1
                if self.a.reconnect_every and used % self.a.reconnect_every == 0:
                    await self.close_client(client)
                    client = None
        finally:
            if client is not None:
                await self.close_client(client)

    # ---- measuring ---------------------------------------------------------------------------
    async def server_stats(self, ctl: AsyncClient) -> dict:
        try:
            return await ctl.stats(timeout=15.0)
        except Exception as exc:
            return {"error": repr(exc)}

    def rss(self, stats: dict) -> float | None:
        if self.pid is not None:
            return proc_rss_mb(self.pid)
        b = stats.get("process_rss_bytes")
        return b / 2**20 if isinstance(b, (int, float)) else None

    def cpu(self, stats: dict) -> float | None:
        if self.pid is not None:
            return proc_cpu_s(self.pid)
        return stats.get("process_cpu_s")

    async def row(self, ctl: AsyncClient, t0: float, prev: dict, phase: str) -> dict:
        stats = await self.server_stats(ctl)
        recs, self.ended = self.ended, []
        ok = [r for r in recs if r.kind == "normal" and r.outcome in ("stop", "length")]
        ms = lambda xs: [x * 1e3 for x in xs if x is not None]  # noqa: E731
        ttft = ms(r.first_t - r.send_t if r.first_t else None for r in ok)
        e2e = ms(r.end_t - r.send_t for r in ok)
        cpu, out_tok = self.cpu(stats), stats.get("output_tokens")
        d_cpu = cpu - prev["cpu"] if cpu is not None and prev.get("cpu") is not None else None
        d_tok = out_tok - prev["out_tok"] if out_tok is not None and prev.get("out_tok") is not None else None
        lg = self_cpu_s()
        row = {
            "t_s": round(time.monotonic() - t0, 2),
            "phase": phase,
            "rss_mb": self.rss(stats),
            "requests_sent": self.sent,
            "requests_ended": self.n_ended,
            "ended_in_interval": len(recs),
            "client_tokens": self.tokens,
            "server_output_tokens": out_tok,
            "server_cpu_s": cpu,
            "server_cpu_s_interval": d_cpu,
            "cpu_s_per_1k_tokens": d_cpu / (d_tok / 1000) if d_cpu is not None and d_tok else None,
            "thread_cpu_s": stats.get("thread_cpu_s"),
            "loadgen_cpu_s_interval": lg - prev.get("lg", lg),
            "ttft_ms_p50": percentile(ttft, 50),
            "ttft_ms_p99": percentile(ttft, 99),
            "e2e_ms_p50": percentile(e2e, 50),
            "e2e_ms_p99": percentile(e2e, 99),
            "outcomes": dict(Counter(r.outcome for r in recs)),
            "in_flight": stats.get("in_flight"),
            "host_queue": stats.get("host_queue"),
            "arena_used": stats.get("arena_used"),
        }
        if "error" in stats:
            row["stats_error"] = stats["error"]
        prev.update(cpu=cpu, out_tok=out_tok, lg=lg)
        self.rows.append(row)
        self.print_row(row)
        return stats

    @staticmethod
    def print_row(r: dict) -> None:
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(
            f"{r['t_s']:8.1f} {r['phase']:<5} rss {f(r['rss_mb'], '7.1f')} MB  ended {r['requests_ended']:7d}"
            f" (+{r['ended_in_interval']:5d})  cpu/1k tok {f(r['cpu_s_per_1k_tokens'], '6.3f')} s"
            f"  ttft p50/p99 {f(r['ttft_ms_p50'], '6.1f')}/{f(r['ttft_ms_p99'], '6.1f')} ms"
            f"  e2e p50/p99 {f(r['e2e_ms_p50'], '7.1f')}/{f(r['e2e_ms_p99'], '7.1f')} ms"
            f"  lg cpu {r['loadgen_cpu_s_interval']:.1f} s  {r['outcomes']}",
            flush=True,
        )

    async def run(self) -> dict:
        a = self.a
        ctl = AsyncClient(self.address, timeout=30.0)
        stats0 = await self.server_stats(ctl)
        if "error" in stats0:
            raise SystemExit(f"soak: no stats from {self.address}: {stats0['error']}")
        self.max_ctx = (stats0.get("backend") or {}).get("max_ctx")
        t0 = time.monotonic()
        prev: dict = {}
        await self.row(ctl, t0, prev, "start")
        deadline = t0 + a.duration
        workers = [asyncio.ensure_future(self.worker(w, deadline)) for w in range(a.concurrency)]
        next_row = t0 + a.interval
        while not all(w.done() for w in workers):
            await asyncio.wait(workers, timeout=max(0.0, next_row - time.monotonic()))
            if time.monotonic() >= next_row:
                await self.row(ctl, t0, prev, "load")
                next_row += a.interval
        for w in workers:
            w.result()  # a worker that crashed is a soak bug: say so
        load_end = await self.row(ctl, t0, prev, "drain")
        idle_stats = load_end
        idle_end = time.monotonic() + a.idle
        while time.monotonic() < idle_end:
            await asyncio.sleep(min(a.interval, max(0.0, idle_end - time.monotonic())))
            idle_stats = await self.row(ctl, t0, prev, "idle")
        await ctl.aclose()
        self.ctx.term()
        return self.summary(stats0, load_end, idle_stats)

    def summary(self, stats0: dict, load_end: dict, idle: dict) -> dict:
        load_rows = [
            r for r in self.rows if r["phase"] in ("start", "load", "drain") and r["rss_mb"] is not None
        ]
        half = [r for r in load_rows if r["t_s"] >= self.a.duration / 2]
        dup = self.duplicate_dones
        no_done = sum(n for k, n in self.totals.items() if k.startswith("no_done"))
        acc = idle.get("accepted", 0) - stats0.get("accepted", 0)
        fin = sum((idle.get("finished") or {}).values()) - sum((stats0.get("finished") or {}).values())
        all_ok = [r["e2e_ms_p99"] for r in self.rows if r["e2e_ms_p99"] is not None]
        return {
            "requests_sent": self.sent,
            "requests_ended": self.n_ended,
            "by_kind": dict(self.kinds),
            "outcomes": dict(self.totals),
            "abandoned": self.totals.get("abandoned", 0),
            "without_done": no_done,
            "duplicate_dones": dup,
            "accounting_ok": no_done == 0
            and dup == 0
            and self.sent == self.n_ended
            and idle.get("in_flight") == 0
            and acc - fin == idle.get("in_flight"),
            "server": {
                "accepted": acc,
                "finished": fin,
                "in_flight_after_idle": idle.get("in_flight"),
                "host_queue_after_idle": idle.get("host_queue"),
                "arena_used_after_idle": idle.get("arena_used"),
            },
            "rss_mb_start": load_rows[0]["rss_mb"] if load_rows else None,
            "rss_mb_max": max((r["rss_mb"] for r in load_rows), default=None),
            "rss_mb_load_end": self.rows_phase("drain", "rss_mb"),
            "rss_mb_after_idle": self.rows[-1]["rss_mb"],
            "idle_s": self.a.idle,
            "rss_mb_per_1k_requests_second_half": slope_per_1k(
                [r["requests_ended"] for r in half], [r["rss_mb"] for r in half]
            ),
            "rss_mb_per_1k_requests_whole_run": slope_per_1k(
                [r["requests_ended"] for r in load_rows], [r["rss_mb"] for r in load_rows]
            ),
            "second_half_rows": len(half),
            "cpu_s_per_1k_tokens": self.whole_run_cpu_per_1k(),
            "e2e_ms_p99_worst_interval": max(all_ok, default=None),
        }

    def rows_phase(self, phase: str, key: str):
        return next((r[key] for r in self.rows if r["phase"] == phase), None)

    def whole_run_cpu_per_1k(self) -> float | None:
        first, last = self.rows[0], next(r for r in self.rows if r["phase"] == "drain")
        if None in (
            first["server_cpu_s"],
            last["server_cpu_s"],
            first["server_output_tokens"],
            last["server_output_tokens"],
        ):
            return None
        tok = last["server_output_tokens"] - first["server_output_tokens"]
        return (last["server_cpu_s"] - first["server_cpu_s"]) / (tok / 1000) if tok else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/lab/soak.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--address",
        help="drive this running server instead of starting one "
        "(RSS then comes from its stats, or from /proc with --server-pid)",
    )
    p.add_argument("--server-pid", type=int, help="with --address: read RSS and CPU from /proc/PID")
    p.add_argument(
        "--duration",
        type=parse_duration,
        default=parse_duration("10m"),
        help="how long to send load: 90, 90s, 10m, 2h",
    )
    p.add_argument("--interval", type=parse_duration, default=30.0, help="seconds between report rows")
    p.add_argument(
        "--idle",
        type=parse_duration,
        default=30.0,
        help="seconds to watch the idle server after the load stops (RSS after idle)",
    )
    p.add_argument("--concurrency", type=int, default=16, help="workers, one request in flight each")
    p.add_argument("--input-len", type=int, default=128, help="mean prompt length (tokens)")
    p.add_argument("--output-len", type=int, default=64, help="mean max_tokens")
    p.add_argument(
        "--length-dist",
        choices=LENGTH_DISTS,
        default="uniform",
        help="length distribution of prompts and outputs (see bench/workloads.py)",
    )
    p.add_argument("--range-ratio", type=float, default=0.9, help="uniform: lengths in L(1 +- r)")
    p.add_argument(
        "--abort-fraction",
        type=float,
        default=0.1,
        help="share of requests aborted after a random number of tokens (0 = at once)",
    )
    p.add_argument(
        "--disconnect-fraction",
        type=float,
        default=0.02,
        help="share of requests whose client reads 1-3 replies, then closes its socket "
        "without an abort (counted as abandoned unless their done came first)",
    )
    p.add_argument(
        "--reconnect-every",
        type=int,
        default=100,
        help="a worker replaces its client after this many requests (0: never)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let EOS end requests (default: output length = max_tokens)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="a request with no reply for this long counts as no_done:timeout",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--json", help="write every row and the summary here")
    g = p.add_argument_group("the server it starts (ignored with --address)")
    g.add_argument("--model", default=EngineConfig.model)
    g.add_argument("--device", default=EngineConfig.device, choices=DEVICES)
    g.add_argument("--slots", type=int)
    g.add_argument("--max-ctx", type=int)
    g.add_argument("--token-budget", type=int)
    g.add_argument("--threads", type=int, help="torch threads of the server")
    g.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to `serve` as is (repeatable); set MALLOC_ARENA_MAX and the like "
        "in soak's own environment, which the server inherits",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.abort_fraction + args.disconnect_fraction <= 1:
        raise SystemExit("soak: --abort-fraction + --disconnect-fraction must be within [0, 1]")
    server = None
    if args.address:
        address, pid = args.address, args.server_pid
    else:
        opts = ServerOptions(
            model=args.model,
            device=resolve_device(args.device),
            slots=args.slots,
            max_ctx=args.max_ctx,
            token_budget=args.token_budget,
            threads=args.threads,
            extra=list(args.server_arg),
        )
        server = ServerProcess(opts.args())
        address = server.start()
        pid = server.proc.pid
        print(f"soak: started `{' '.join(server.command)}` (pid {pid})", flush=True)
    try:
        soak = Soak(args, address, pid)
        summary = asyncio.run(soak.run())
    finally:
        server_tail = server.output_tail() if server is not None else None
        code = server.stop() if server is not None else None
    summary["server_exit_code"] = code
    print("soak summary: " + json.dumps(summary, indent=1), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        out = {
            "config": vars(args),
            "address": address,
            "server_pid": pid,
            "server_command": server.command if server else None,
            "host": {
                "python": platform.python_version(),
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX"),
            },
            "rows": soak.rows,
            "summary": summary,
            "server_output_tail": server_tail,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if summary["accounting_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
