"""A bystander stream's token gaps while a new JSON schema compiles, against the same stream with
nothing compiling, in alternating rounds (CPU backend, SmolLM2-135M Q4_1, greedy, 120 tokens).
The compile runs in the compiler process (hostctl/serving/compile_worker.py)."""

import json
import time

import numpy as np

from ringleader.bench import smollm2
from ringleader.hostctl.serving.background_server import BackgroundServer
from ringleader.hostctl.serving.server import Server
from ringleader.device.backends.cpu import CpuBackend
from ringleader.ipc.client import Client

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "city"],
}


def gaps(c, compile_at: float | None, n: int):
    stamps, sent = [], None
    stream = c.generate(prompt="Once upon a time", max_tokens=120, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    for _ in stream:
        now = time.perf_counter()
        stamps.append(now)
        if compile_at is not None and sent is None and now - t0 > compile_at:
            schema = json.loads(json.dumps(SCHEMA))
            schema["properties"]["name"]["maxLength"] += n  # a schema not seen yet: a cold compile
            sent = c.generate(prompt="Who?", structured={"json": schema}, max_tokens=60)
    if sent is not None:
        sent.wait()
    return np.diff(stamps) * 1000, (sent.done.timing or {}).get("ttft_ms") if sent else None


def main():
    backend = CpuBackend(str(smollm2.cached_path()), n_slots=8, max_ctx=1024, token_budget=64)
    with BackgroundServer(Server(backend, "tcp://127.0.0.1:0")) as bg, Client(bg.address, timeout=300) as c:
        c.generate(prompt="warm", max_tokens=4).wait()
        rows = []
        for n in range(4):
            for label, at in (("nothing compiling", None), ("a cold compile", 0.5)):
                g, ttft = gaps(c, at, n + 1)
                rows.append((n, label, np.percentile(g, 50), np.percentile(g, 99), g.max(), ttft))
        print("| round | bystander beside | gap p50 ms | gap p99 ms | gap max ms | compiling request TTFT ms |")
        print("|---:|---|---:|---:|---:|---:|")
        for n, label, p50, p99, mx, ttft in rows:
            print(f"| {n} | {label} | {p50:.1f} | {p99:.1f} | {mx:.1f} | {'' if ttft is None else f'{ttft:.0f}'} |")
        print(json.dumps(c.stats()["structured"]))


if __name__ == "__main__":
    main()
