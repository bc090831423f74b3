"""What scoring a prompt costs on the CPU: the same prompts sent with max_tokens 0 (prefill only),
with prompt_logprobs 1 (lm-eval's ask) and with prompt_logprobs 20, interleaved round by round in
one run, over one server, quiet and beside a busy process (a shared edge machine).

    python bench/results/2026-11-29-prompt-logprobs-cpu/score_cost.py --weights quantized --out q.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import ringleader.device.model  # noqa: E402,F401  (before the steps: the package's import order)
from ringleader.bench import smollm2  # noqa: E402
from ringleader.bench.report import cpu_identity  # noqa: E402
from tests.conftest import RawPeer, running_server  # noqa: E402

FORMS = {"prefill": None, "prompt_logprobs=1": 1, "prompt_logprobs=20": 20}
TEXT = (
    "The printing press spread across Europe within a few decades, and with it came cheaper books, "
    "broadsheets and pamphlets that carried news, arguments and advertisements to readers who had "
)


def _busy(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _round(peer: RawPeer, prompts: list[str], asked: int | None, base: int) -> float:
    """Seconds until every prompt of the batch is scored (sent at once: a harness's batch)."""
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        extra = {} if asked is None else {"prompt_logprobs": asked}
        # its own first words: no prompt finds another's pages in the prefix cache
        peer.send({"op": "generate", "id": base + i, "prompt": f"{base + i}. {prompt}", "max_tokens": 0, **extra})
    done = 0
    while done < len(prompts):
        done += peer.recv(300)["op"] == "done"
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="quantized")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    prompts = [TEXT * 2] * args.batch
    model, flags = cpu_identity()
    out = {"cpu": model, "flags": [k for k, v in flags.items() if v], "weights": args.weights, "runs": {}}
    with running_server(str(smollm2.cached_path()), weights=args.weights, n_slots=8, max_ctx=512,
                        token_budget=256) as bg:  # fmt: skip
        peer = RawPeer(bg.address)
        peer.send({"op": "generate", "id": "tok", "prompt": prompts[0], "max_tokens": 0, "prompt_logprobs": 0})
        first = peer.recv(300)
        out["prompt_tokens"] = len(first["prompt_token_ids"])
        peer.recv(300)
        _round(peer, prompts, None, 10_000)  # warm-up
        for neighbour in ("quiet", "one busy process"):
            stop = multiprocessing.Event()
            busy = multiprocessing.Process(target=_busy, args=(stop,)) if neighbour != "quiet" else None
            if busy:
                busy.start()
            times: dict[str, list[float]] = {name: [] for name in FORMS}
            base = 100_000
            for _ in range(args.rounds):
                for name, asked in FORMS.items():  # interleaved: drift hits every form alike
                    times[name].append(_round(peer, prompts, asked, base))
                    base += args.batch
            if busy:
                stop.set()
                busy.join()
            plain = statistics.median(times["prefill"])
            out["runs"][neighbour] = {
                name: {
                    "median_s": round(statistics.median(t), 4),
                    "prompts_per_s": round(args.batch / statistics.median(t), 2),
                    "vs_prefill": round(statistics.median(t) / plain, 3),
                }
                for name, t in times.items()
            }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
