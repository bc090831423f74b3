"""What a draft's verification rows cost the CPU step: the eager step of B decoding slots, each
with d draft rows (the layout the scheduler lays out for speculative decoding: a segment of
1 + d rows per slot, every row sampled), timed against the same B slots with none, interleaved
round by round, quiet and beside one busy process (with the step's threads cut to the cores
it leaves, as the server's thread governor does).  This is the measurement behind
--speculative-max-batch and the adaptive draft length (docs/scheduler.md, speculative decoding).

    python -m ringleader.bench.lab.spec_rows --out bench/results/<date>-cpu-spec-rows
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import ringleader.device.model  # noqa: F401  (before the step modules: import order)
from ringleader.bench.smollm2 import smollm2_path
from ringleader.device.backends.common import load_model
from ringleader.device.engine_config import EngineConfig
from ringleader.device.step.step_layout import StepLayout

CTX = 320  # each slot's context: a chat prompt and some of its answer
PAGE = 16


def verification_layout(model, slots: int, drafts: int) -> StepLayout:
    """`slots` decoding slots, each its newest token then `drafts` draft tokens at consecutive
    positions from CTX - 1, every row sampled greedily (as sched_critical.h lays them out)."""
    rows = slots * (1 + drafts)
    pages = -(-(CTX + drafts) // PAGE)
    vocab = model.config.vocab_size
    lay = StepLayout.allocate(slots, rows, "cpu", pages, vocab, spec_tokens=max(drafts, 1))
    lay.block_table.copy_(torch.arange(slots * pages, dtype=torch.int32).view(slots, pages))
    for s in range(slots):
        start = s * (1 + drafts)
        lay.seg_slot[s], lay.seg_row_start[s], lay.seg_n_rows[s] = s, start, 1 + drafts
        for i in range(1 + drafts):
            r = start + i
            lay.token_ids[r] = (r * 7919 + 17) % vocab
            lay.positions[r] = CTX - 1 + i
            lay.slot_of[r] = s
            lay.sample_row[r] = r
            lay.sample_slot[r] = s if i == 0 else slots + s * drafts + i - 1
            lay.sample_counter[r] = i
    lay.params["temperature"][:rows] = 0.0
    lay.n_tokens.fill_(rows)
    lay.n_segments.fill_(slots)
    lay.n_samples.fill_(rows)
    lay.n_decode.fill_(slots)
    return lay


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def measure(weights: str, slot_counts, draft_counts, rounds: int) -> dict:
    cfg = EngineConfig(model=str(smollm2_path()), weights=weights).resolved("cpu")
    model = load_model(cfg, torch.float32, "cpu")
    n_pages = max(slot_counts) * -(-(CTX + max(draft_counts)) // PAGE) + 1
    step = model.eager_step(max(slot_counts) * 9, n_pages, PAGE, torch.float32)
    cells = [(b, d) for b in slot_counts for d in draft_counts]
    layouts = {cell: verification_layout(model, *cell) for cell in cells}
    times: dict = {cell: [] for cell in cells}
    for cell in cells:  # warm-up
        step.run(layouts[cell].n_tokens.item(), layouts[cell])
    for r in range(rounds):
        order = cells if r % 2 == 0 else cells[::-1]
        for cell in order:
            lay = layouts[cell]
            t0 = time.perf_counter()
            step.run(int(lay.n_tokens.item()), lay)
            times[cell].append(time.perf_counter() - t0)
    out = {}
    for b in slot_counts:
        base = statistics.median(times[(b, 0)])
        for d in draft_counts:
            med = statistics.median(times[(b, d)])
            out[f"{b}x{d}"] = {"slots": b, "drafts": d, "rows": b * (1 + d), "ms_p50": round(med * 1e3, 2),
                               "vs_no_draft": round(med / base, 3)}  # fmt: skip
    return out


def cpu_name() -> tuple[str, list[str]]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
        platform.processor(),
    )
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    keep = sorted(f for f in flags if f.startswith(("avx2", "avx512", "avx_vnni", "fma", "amx")))
    return name, keep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--weights", default="auto", help="auto (the GGUF's quantized matrices) or fp32")
    ap.add_argument("--slots", default="1,2,4,8")
    ap.add_argument("--drafts", default="0,1,2,4,8")
    args = ap.parse_args(argv)
    slots = [int(x) for x in args.slots.split(",")]
    drafts = [int(x) for x in args.drafts.split(",")]
    name, flags = cpu_name()
    result = {"cpu": name, "cpu_flags": flags, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "ctx": CTX, "weights": args.weights, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    result["quiet"] = measure(args.weights, slots, drafts, args.rounds)
    stop = mp.Event()
    busy = mp.Process(target=_burn, args=(stop,), daemon=True)
    busy.start()
    # the step's threads as the server's governor sets them beside a busy process: the cores it
    # leaves (on 2 cores, 1; a second thread would wait on the neighbour at every barrier)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    result["busy_threads"] = torch.get_num_threads()
    try:
        result["busy_neighbour"] = measure(args.weights, slots, drafts, args.rounds)
    finally:
        stop.set()
        busy.join(5)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_rows.json").write_text(json.dumps(result, indent=1))
    for form in ("quiet", "busy_neighbour"):
        print(form)
        for key, row in result[form].items():
            print(f"  {key:>5}: {row['rows']:3d} rows {row['ms_p50']:8.2f} ms  x{row['vs_no_draft']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
