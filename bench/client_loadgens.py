"""Load generators built on the clients a user links, for `--compare clients`: the C client's
closed-loop tool (clients/c, `ringleader-c-bench`), the bundled sync `Client` (one thread per
request in flight, as a threaded service uses it) and the bundled `AsyncClient` (one task per
request in flight). Each measures as bench/loadgen.py does (warm-up, the server's stats before and
after, this side's CPU over the run) and stamps a chunk when the client hands it to its user: what
a client adds to a token's way is in its times.

They are closed-loop only (`--concurrency`). The raw pyzmq generator (loadgen.py) and the HTTP one
(http_loadgen.py) run beside them as the other two passes of the variant.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from ringleader.bench.loadgen import (
    Load,
    RunResult,
    SendOptions,
    cpu_seconds_self,
    read_stats,
    timeline_after_seq,
)
from ringleader.bench.metrics import RequestRecord
from ringleader.bench.workloads import RequestSpec
from ringleader.ipc.client import AsyncClient, Client

REPO = Path(__file__).resolve().parents[1]
C_CLIENT_DIR = REPO / "clients" / "c"
C_BENCH = "ringleader-c-bench"


class ClientUnavailable(RuntimeError):
    """A client's load generator cannot run here; the message says why and what to do."""


def c_bench_binary(path: str | None = None) -> Path:
    """The C client's bench tool: `path`, else clients/c/build/ringleader-c-bench of this checkout,
    built with make when missing."""
    if path:
        binary = Path(path)
        if not binary.is_file():
            raise ClientUnavailable(f"--c-bench {path}: no such file")
        return binary
    binary = C_CLIENT_DIR / "build" / C_BENCH
    if binary.is_file():
        return binary
    if not (C_CLIENT_DIR / "Makefile").is_file():
        raise ClientUnavailable(
            "the C client is built from a checkout of ringleader (clients/c); pass --c-bench PATH"
        )
    if shutil.which("make") is None:
        raise ClientUnavailable("building the C client needs make and a C compiler")
    built = subprocess.run(["make", "-C", str(C_CLIENT_DIR)], capture_output=True, text=True, timeout=300)
    if built.returncode != 0 or not binary.is_file():
        raise ClientUnavailable(
            "building the C client failed (it needs libzmq3-dev and libmsgpack-dev):\n" + built.stderr[-2000:]
        )
    return binary


def _closed(load: Load) -> int:
    if load.concurrency is None:
        raise ClientUnavailable("the client load generators run closed loop only (--concurrency)")
    return load.concurrency


def _result(address: str, records, before, cpu_s, wall_s, warmup_failed) -> RunResult:
    after = read_stats(address, 30.0, timeline_after_seq(before))
    return RunResult(records, before, after, cpu_s, wall_s, {}, warmup_failed)


# ---- the C client ----------------------------------------------------------------------------


def measure_c(
    address: str,
    specs: list[RequestSpec],
    load: Load,
    *,
    warmup: list[RequestSpec] | None = None,
    options: SendOptions | None = None,
    timeout_s: float = 600.0,
    binary: Path | None = None,
) -> RunResult:
    """One run of `ringleader-c-bench`: its warm-up first (the tool sends the first len(warmup)
    of `specs` unmeasured: it reads one file), then `specs`; their records, and its own CPU over
    the measured run (getrusage in the tool, libzmq's thread too)."""
    concurrency, o = _closed(load), options or SendOptions()
    binary = binary or c_bench_binary()
    with tempfile.TemporaryDirectory(prefix="rl-c-bench-") as tmp:
        requests = Path(tmp) / "requests.txt"
        lines = [f"{s.max_tokens} {' '.join(map(str, s.prompt_ids))}" for s in specs]
        requests.write_text("\n".join(lines) + "\n")
        cmd = [str(binary), "--address", address, "--requests-file", str(requests)]
        cmd += ["--concurrency", str(concurrency), "--warmup", str(min(len(warmup or []), len(specs)))]
        cmd += ["--temperature", repr(o.temperature), "--seed", str(o.seed), "--timeout-s", str(timeout_s)]
        if o.ignore_eos:
            cmd.append("--ignore-eos")
        before = read_stats(address, 30.0)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 60)
    if not proc.stdout.strip():
        raise ClientUnavailable(f"{binary.name} exited with {proc.returncode}: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout)
    records = []
    for i, (spec, r) in enumerate(zip(specs, out["requests"], strict=True)):
        rec = RequestRecord(i, len(spec.prompt_ids), spec.max_tokens, send_t=r["send_t"])
        rec.chunk_t, rec.chunk_n = list(r["chunk_t"]), list(r["chunk_n"])
        rec.done_t, rec.finish_reason = r.get("done_t"), r.get("finish_reason")
        rec.error_code, rec.error_message = r.get("error_code"), r.get("error_message")
        rec.completion_tokens = int(r.get("completion_tokens") or 0)
        rec.server_queue_ms = r.get("server_queue_ms")
        records.append(rec)
    cpu = float(out["cpu_user_s"]) + float(out["cpu_sys_s"])
    return _result(address, records, before, cpu, float(out["wall_s"]), 0)


# ---- the bundled Python clients -------------------------------------------------------------


def _sampling(options: SendOptions, index: int) -> dict:
    o = options
    fields: dict = {"ignore_eos": o.ignore_eos}
    if o.temperature > 0:
        fields.update(temperature=o.temperature, seed=(o.seed + index) % (1 << 63))
    return fields


def _sync_run(client: Client, specs: list[RequestSpec], concurrency: int, options: SendOptions) -> list:
    records = [RequestRecord(i, len(s.prompt_ids), s.max_tokens) for i, s in enumerate(specs)]
    next_index = iter(range(len(specs)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            rec, spec = records[i], specs[i]
            rec.send_t = time.perf_counter()
            stream = client.generate(
                prompt_ids=spec.prompt_ids, max_tokens=spec.max_tokens, **_sampling(options, i)
            )
            for chunk in stream:
                rec.chunk_t.append(time.perf_counter())
                rec.chunk_n.append(len(chunk.token_ids))
            _finish(rec, stream.done)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(specs)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def _finish(rec: RequestRecord, done) -> None:
    rec.done_t = time.perf_counter()
    rec.finish_reason, rec.completion_tokens = done.finish_reason, done.completion_tokens
    rec.error_code, rec.error_message = done.error_code, done.error_message
    queue_ms = (done.timing or {}).get("queue_ms")
    rec.server_queue_ms = float(queue_ms) if isinstance(queue_ms, (int, float)) else None


def measure_python_sync(
    address: str,
    specs: list[RequestSpec],
    load: Load,
    *,
    warmup: list[RequestSpec] | None = None,
    options: SendOptions | None = None,
    timeout_s: float = 600.0,
) -> RunResult:
    """The sync `Client`, one thread per request in flight."""
    concurrency, options = _closed(load), options or SendOptions()
    with Client(address, timeout=timeout_s) as client:
        warm = _sync_run(client, warmup or [], max(1, concurrency), options)
        before = client.stats()
        cpu0, t0 = cpu_seconds_self(), time.perf_counter()
        records = _sync_run(client, specs, concurrency, options)
        wall, cpu = time.perf_counter() - t0, cpu_seconds_self() - cpu0
    return _result(address, records, before, cpu, wall, sum(1 for r in warm if not r.ok))


async def _async_run(
    client: AsyncClient, specs: list[RequestSpec], concurrency: int, options: SendOptions
) -> list:
    records = [RequestRecord(i, len(s.prompt_ids), s.max_tokens) for i, s in enumerate(specs)]
    next_index = iter(range(len(specs)))

    async def worker() -> None:
        for i in next_index:  # one shared iterator: each task takes the next request
            rec, spec = records[i], specs[i]
            rec.send_t = time.perf_counter()
            stream = await client.generate(
                prompt_ids=spec.prompt_ids, max_tokens=spec.max_tokens, **_sampling(options, i)
            )
            async for chunk in stream:
                rec.chunk_t.append(time.perf_counter())
                rec.chunk_n.append(len(chunk.token_ids))
            _finish(rec, await stream.wait())

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
    return records


def measure_python_async(
    address: str,
    specs: list[RequestSpec],
    load: Load,
    *,
    warmup: list[RequestSpec] | None = None,
    options: SendOptions | None = None,
    timeout_s: float = 600.0,
) -> RunResult:
    """The `AsyncClient`, one task per request in flight, on one event loop."""
    concurrency, options = _closed(load), options or SendOptions()

    async def go() -> RunResult:
        async with AsyncClient(address, timeout=timeout_s) as client:
            warm = await _async_run(client, warmup or [], max(1, concurrency), options)
            before = await client.stats()
            cpu0, t0 = cpu_seconds_self(), time.perf_counter()
            records = await asyncio.wait_for(_async_run(client, specs, concurrency, options), timeout_s)
            wall, cpu = time.perf_counter() - t0, cpu_seconds_self() - cpu0
            after = await client.stats(timeline_after_seq=timeline_after_seq(before))
        return RunResult(records, before, after, cpu, wall, {}, sum(1 for r in warm if not r.ok))

    return asyncio.run(go())
