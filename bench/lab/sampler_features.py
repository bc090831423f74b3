"""What each sampling feature costs the sampler (device/sampling/sampler.py), side by side in one
process: the same rows and logits sampled plain, with min_p, with the penalties; the penalties and
temperature division alone (penalize_and_scale, and on a GPU its one-launch Triton form, with the
penalties on and with none, beside the bare division); the logprobs records (store_logprobs, and
on a GPU store_logprobs_triton) with every row asking 5 or 20 alternatives and with no row asking;
and the eager step's all-greedy argmax, median of repeats after a warm-up.  Rows mix greedy, top-k,
top-p and plain-temperature settings as the bench's workloads do.

    python -m ringleader.bench.lab.sampler_features --vocab 49152 --json bench/results/<date>-cpu-<what>/sampler_features.json
    python -m ringleader.bench.lab.sampler_features --device cuda   # adds the Triton forms
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ringleader.bench.report import save_json
from ringleader.device.sampling.sampler import (
    LOGPROBS_WORDS,
    SamplingTensors,
    penalize_and_scale,
    sample,
    store_logprobs,
)
from ringleader.ipc.layout import PROMPT_MARK


def _rows(
    m: int, vocab: int, n_slots: int, device: str, **fields: float
) -> tuple[torch.Tensor, SamplingTensors]:
    gen = torch.Generator().manual_seed(m)
    logits = (torch.randn(m, vocab, generator=gen) * 4).to(device)
    kind = torch.arange(m) % 4  # greedy, top-k 50, top-p 0.9, plain temperature
    counts = torch.randint(0, 3, (n_slots, vocab), generator=gen, dtype=torch.int32)
    counts |= PROMPT_MARK * (torch.rand(n_slots, vocab, generator=gen) < 0.01).int()
    values = dict(
        temperature=torch.where(kind == 0, 0.0, 0.8),
        top_k=torch.where(kind == 1, 50, 0).int(),
        top_p=torch.where(kind == 2, 0.9, 1.0),
        seed=torch.arange(m) * 7 + 1,
        **{name: torch.full((m,), value) for name, value in fields.items()},
    )
    params = SamplingTensors(
        torch.arange(m, dtype=torch.int32).to(device),
        counts.to(device),
        (torch.arange(m, dtype=torch.int32) % n_slots).to(device),
        **{k: v.to(device) for k, v in values.items()},
    )
    return logits, params


def _median_ms(fn: Callable[[], object], repeats: int, device: str) -> float:
    def timed() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    timed()  # warm-up (and Triton's compile)
    return statistics.median(timed() for _ in range(repeats))


def _measure(m: int, vocab: int, n_slots: int, repeats: int, device: str) -> dict:
    logits, plain = _rows(m, vocab, n_slots, device)
    _, with_min_p = _rows(m, vocab, n_slots, device, min_p=0.05)
    _, penalized = _rows(
        m, vocab, n_slots, device, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2
    )
    no_counts = SamplingTensors(plain.counter, **plain.values)
    min_p = SamplingTensors(with_min_p.counter, **with_min_p.values)
    # sample()'s divisor: 1 for greedy rows, the temperature for the others
    divisor = torch.where(plain.temperature <= 0, 1.0, plain.temperature).float()
    tokens = logits.argmax(-1)
    table = torch.zeros(n_slots, LOGPROBS_WORDS, dtype=torch.int32, device=device)
    assert plain.slot is not None
    slot = plain.slot

    def asking(top_n: int) -> torch.Tensor:
        return torch.full((m,), top_n, dtype=torch.int32, device=device)

    row: dict = {
        "rows": m,
        "plain_ms": _median_ms(lambda: sample(logits, no_counts), repeats, device),
        "min_p_ms": _median_ms(lambda: sample(logits, min_p), repeats, device),
        "penalties_ms": _median_ms(lambda: sample(logits, penalized), repeats, device),
        "penalize_scale_torch_ms": _median_ms(
            lambda: penalize_and_scale(logits, penalized, divisor), repeats, device
        ),
        "divide_only_torch_ms": _median_ms(lambda: logits / divisor[:, None], repeats, device),
        "greedy_argmax_ms": _median_ms(lambda: logits.argmax(-1), repeats, device),
    }
    # the torch form computes every row's record whether it asked or not
    for top_n, name in ((5, "top5"), (20, "top20"), (-1, "none")):
        top = asking(top_n)
        row[f"logprobs_{name}_torch_ms"] = _median_ms(
            lambda top=top: store_logprobs(table, slot, logits, tokens, top), repeats, device
        )
    if device == "cuda":
        from ringleader.device.sampling.triton_sampler import penalize_and_scale_triton, store_logprobs_triton

        row["penalize_scale_triton_ms"] = _median_ms(
            lambda: penalize_and_scale_triton(logits, penalized, divisor), repeats, device
        )
        row["neutral_scale_triton_ms"] = _median_ms(
            lambda: penalize_and_scale_triton(logits, plain, divisor), repeats, device
        )
        n_valid = torch.tensor([m], dtype=torch.int32, device=device)
        for top_n, name in ((5, "top5"), (20, "top20"), (-1, "none")):
            top = asking(top_n)
            row[f"logprobs_{name}_triton_ms"] = _median_ms(
                lambda top=top: store_logprobs_triton(table, slot, logits, tokens, top, n_valid),
                repeats,
                device,
            )
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def run(
    rows=(1, 8, 32), vocab: int = 49152, n_slots: int = 128, repeats: int = 9, device: str = "cpu"
) -> dict:
    return {
        "what": "sample() per feature, same rows and logits; medians in ms",
        "vocab": vocab,
        "n_slots": n_slots,
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "repeats": repeats,
        "rows": [_measure(m, vocab, n_slots, repeats, device) for m in rows],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = run(vocab=args.vocab, repeats=args.repeats, device=args.device)
    print(
        f"{result['device']}, vocab {result['vocab']}, {result['torch_threads']} torch threads, median of {args.repeats}"
    )
    for r in result["rows"]:
        print("  ".join(f"{k} {v}" for k, v in r.items()))
    if args.json:
        save_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
