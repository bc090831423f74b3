"""CPU microbenchmark of the static step's sampler: before and after sizing it by the bucket.

Before, every step sampled all n_slots entries with a full sort of the vocabulary
(`sorted_reference`, kept here as the specification the candidate sampler is tested against).
Now a step samples min(bucket, n_slots) entries (a step never samples more entries than it has
rows) and sorts nothing (device/sampling/sampler.py). Timed side by side in one process, median
of repeats after a warm-up, on random llama-3-sized logits (vocab 128256), mixing greedy rows
with top-k / top-p / plain temperature rows.

    python -m ringleader.bench.lab.sampler_micro --json bench/results/<date>-cpu-sampler/sampler.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ringleader.bench.report import save_json
from ringleader.device.sampling.sampler import SamplingTensors, counter_uniform, sample


def sorted_reference(logits, temperature, top_k, top_p, seed, counter):
    """The sampler's specification as a full stable sort of the vocabulary (the sampler the
    static step ran before it drew from candidates)."""
    V = logits.shape[1]
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    vals, idx = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(V)[None, :]
    vals = vals.masked_fill(~((top_k[:, None] <= 0) | (rank < top_k[:, None])), float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    cum = probs.cumsum(-1)
    probs = probs * (((cum - probs) < top_p[:, None]) | (top_p[:, None] >= 1.0) | (rank == 0))
    cum = probs.cumsum(-1)
    pos = (cum < (counter_uniform(seed, counter) * cum[:, -1])[:, None]).sum(-1).clamp(max=V - 1)
    return torch.where(greedy, logits.argmax(-1), idx.gather(1, pos[:, None]).squeeze(1))


def _params(n: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen) * 4
    kind = torch.arange(n) % 4  # greedy, top-k 50, top-p 0.9, plain temperature
    temperature = torch.where(kind == 0, 0.0, 0.8)
    top_k = torch.where(kind == 1, 50, 0)
    top_p = torch.where(kind == 2, 0.9, 1.0)
    return logits, temperature, top_k, top_p, torch.arange(n) * 7 + 1, torch.arange(n)


def _tensors(temperature, top_k, top_p, seed, counter) -> SamplingTensors:
    return SamplingTensors(counter, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(slot_counts=(32, 256), buckets=(1, 8, 32), vocab: int = 128256, repeats: int = 7) -> dict:
    rows = []
    for n_slots in slot_counts:
        all_slots = _params(n_slots, vocab)
        before = _median_ms(lambda a=all_slots: sorted_reference(*a), repeats)
        for bucket in buckets:
            m = min(bucket, n_slots)
            sliced = tuple(t[:m] for t in all_slots)
            after = _median_ms(lambda s=sliced: sample(s[0], _tensors(*s[1:])), repeats)
            rows.append(
                {
                    "n_slots": n_slots,
                    "bucket": bucket,
                    "sampled_rows": m,
                    "before_ms": round(before, 3),
                    "after_ms": round(after, 3),
                    "speedup": round(before / after, 1),
                }
            )
    return {
        "what": "static-step sampler on CPU: all n_slots rows + full sort (before) vs min(bucket, n_slots) rows from top-k candidates (after)",
        "vocab": vocab,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "repeats": repeats,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = run(vocab=args.vocab, repeats=args.repeats)
    print(f"vocab {result['vocab']}, {result['torch_threads']} torch threads, median of {args.repeats}")
    print(f"{'slots':>6} {'bucket':>6} {'rows':>5} {'before ms':>10} {'after ms':>9} {'x':>6}")
    for r in result["rows"]:
        print(
            f"{r['n_slots']:6d} {r['bucket']:6d} {r['sampled_rows']:5d} {r['before_ms']:10.2f}"
            f" {r['after_ms']:9.2f} {r['speedup']:6.1f}"
        )
    if args.json:
        save_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
