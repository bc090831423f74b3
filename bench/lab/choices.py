"""What `n` costs, and what one shared prefill saves: one request of n choices against the same
prompt served with the prefix cache off (n prefills side by side), in one process, on the CPU
backend, alternating the two servers.  Each repeat uses a fresh prompt (its first token
changes), so no repeat finds the previous one's pages.  Per run: the request's end-to-end and
first-token times, the prompt tokens the prefix cache held, and the rows the steps computed.

    python -m ringleader.bench.lab.choices --model $(python -m ringleader.bench.smollm2 | tail -1) \\
        --json bench/results/<date>-cpu-<what>/choices.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ringleader.bench.report import save_json
from ringleader.device.backends.cpu import CpuBackend
from ringleader.hostctl.serving.background_server import BackgroundServer
from ringleader.hostctl.serving.server import Server
from ringleader.ipc.client import Client


def _one(client: Client, prompt: list[int], n: int, max_tokens: int, seed: int) -> dict:
    before = client.stats()["device"]
    started = time.perf_counter()
    stream = client.complete(
        prompt_ids=prompt, n=n, max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=seed
    )
    e2e = time.perf_counter() - started
    after = client.stats()["device"]
    assert stream.done is not None and stream.done.ok, stream.done
    timing = stream.done.timing or {}
    return {
        "e2e_s": e2e,
        "ttft_ms": timing.get("ttft_ms"),
        "prefix_hit_tokens": int(after["prefix_cache_hits"]) - int(before["prefix_cache_hits"]),
        "step_rows": int(after["step_tokens"]) - int(before["step_tokens"]),
        "completion_tokens": stream.done.completion_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    runs: dict[str, list[dict]] = {"shared": [], "unshared": []}
    servers = {}
    try:
        for arm, caching in (("shared", True), ("unshared", False)):
            backend = CpuBackend(args.model, n_slots=8, max_ctx=1024, prefix_caching=caching)
            bg = BackgroundServer(Server(backend, "tcp://127.0.0.1:0")).__enter__()
            servers[arm] = (bg, Client(bg.address, timeout=600))
        vocab = servers["shared"][0].server.backend.model.vocab_size
        for rep in range(args.repeats):
            for arm in ("shared", "unshared") if rep % 2 == 0 else ("unshared", "shared"):
                first = 1 + rep * 2 + (arm == "shared")  # a fresh prompt: nothing cached for it
                prompt = [first] + [(7 + 13 * i) % vocab for i in range(args.prompt_len - 1)]
                runs[arm].append(_one(servers[arm][1], prompt, args.n, args.max_tokens, seed=rep))
                print(arm, runs[arm][-1], flush=True)
    finally:
        for bg, client in servers.values():
            client.close()
            bg.__exit__(None, None, None)
    summary = {
        arm: {
            key: statistics.median(r[key] for r in rs)
            for key in ("e2e_s", "ttft_ms", "prefix_hit_tokens", "step_rows")
        }
        for arm, rs in runs.items()
    }
    result = {
        "settings": vars(args) | {"json": str(args.json) if args.json else None},
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "runs": runs,
        "median": summary,
    }
    print(summary)
    if args.json:
        save_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
