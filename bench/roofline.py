"""The decode step against its memory roofline.

A decode step is memory-bound: it cannot take less than the bytes it must read (every weight
the step multiplies by, plus each row's cached k/v) divided by the memory bandwidth. This
measures, side by side in one process:

  copy bandwidth   a large device-to-device copy (bytes read + written) / time;
  step time        the static step (the CUDA graph the server replays, or on the CPU the same
                   step run eagerly) for `rows` decode rows each at context `ctx`, sampling
                   included, median over replays after warm-up;

and reports floor = (weight bytes + KV bytes) / bandwidth and ratio = step time / floor.

With --profile, after all the timing, each rows value's step is profiled (bench/step_profile.py):
its kernels by name over --profile-steps graph replays, the GPU idle gaps between them, the
captured graph's nodes by type; in the JSON under each step's "profile".

    python -m ringleader.bench.roofline --model llama-1b --dtype bfloat16 --rows 1,32 --ctx 512 --json PATH
    python -m ringleader.bench.roofline --model llama-1b --rows 1,32 --ctx 512 --json PATH --profile
    ringleader bench --roofline --model llama-1b --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ringleader.bench import step_profile
from ringleader.bench.report import save_json
from ringleader.device.model.llama import LlamaModel
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.static_step import StaticStep
from ringleader.device.step.step_layout import StepLayout

PAGE_SIZE = 16  # KV-cache positions per page, the engine's default


def weight_bytes_per_step(model: LlamaModel) -> int:
    """Bytes of the weights a decode step reads: every layer and the final norm, the lm_head
    (the embedding when tied), but only the step's own rows of the embedding table (~0)."""
    total = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    total += model.norm.weight.numel() * model.norm.weight.element_size()
    w = model.lm_head_weight
    return total + w.numel() * w.element_size()


def kv_bytes_per_step(model: LlamaModel, rows: int, ctx: int, dtype: torch.dtype) -> int:
    """Bytes of cached k and v that `rows` decode rows at context `ctx` read."""
    return rows * ctx * KVCache.bytes_per_token(model.config, dtype)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes read + written per second by dst.copy_(src), median of repeats."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    times = _timed(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> list[float]:
    fn()  # warm-up
    _sync(device)
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def decode_layout(rows: int, ctx: int, vocab: int, pages_per_slot: int, device: torch.device) -> StepLayout:
    """`rows` decode rows, one per slot, at position ctx - 1, each sampled greedily; slot s owns
    pages [s * pages_per_slot, (s + 1) * pages_per_slot)."""
    layout = StepLayout.allocate(rows, rows, device, pages_per_slot, vocab)
    pages = torch.arange(rows * pages_per_slot, dtype=torch.int32, device=device)
    layout.block_table.copy_(pages.view(rows, pages_per_slot))
    ids = torch.arange(rows, dtype=torch.int32, device=device)
    layout.token_ids.copy_((ids * 7919 + 17) % vocab)
    layout.positions.fill_(ctx - 1)
    layout.slot_of.copy_(ids)
    layout.sample_row[:rows] = ids
    layout.sample_slot[:rows] = ids
    layout.n_samples.fill_(rows)
    return layout


@dataclass
class DecodeStep:
    """One rows value's step, ready to run: `run` as it is timed (a graph replay on CUDA),
    `eager` the same step launched op by op, `graph` the captured graph (None on the CPU),
    `layout` the buffers it reads and writes (next_token: what it sampled)."""

    run: Callable[[], object]
    eager: Callable[[], object]
    graph: torch.cuda.CUDAGraph | None
    layout: StepLayout | None = None


def _new_graph(keep: bool) -> torch.cuda.CUDAGraph:
    """keep: the cudaGraph_t stays readable (raw_cuda_graph) after capture; a torch without
    keep_graph gives a plain graph, whose nodes are then not read."""
    if keep:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:
            pass
    return torch.cuda.CUDAGraph()


def decode_step(
    model: LlamaModel, rows: int, ctx: int, attention: str, keep_graph: bool = False
) -> DecodeStep:
    """The static step of `rows` decode rows at context `ctx`, captured as a CUDA graph on CUDA."""
    device = model.device
    max_ctx = max(ctx, PAGE_SIZE)
    pages_per_slot = -(-max_ctx // PAGE_SIZE)
    kv = StaticStep.new_kv_cache(model, rows * pages_per_slot, PAGE_SIZE)
    step = StaticStep(model, kv, rows, max_ctx, token_budget=rows, attention=attention)
    layout = decode_layout(rows, ctx, model.config.vocab_size, pages_per_slot, device)

    def eager() -> None:
        step.run(rows, layout)

    if device.type != "cuda":
        return DecodeStep(eager, eager, None, layout)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        step.run(rows, layout)  # compiles the kernels, initialises cuBLAS
        stream.synchronize()
        graph = _new_graph(keep_graph)
        with torch.cuda.graph(graph, stream=stream):
            step.run(rows, layout)
    if keep_graph and hasattr(graph, "instantiate"):
        graph.instantiate()  # a kept graph is otherwise instantiated by its first replay
    return DecodeStep(graph.replay, eager, graph, layout)


def step_seconds(
    model: LlamaModel, rows: int, ctx: int, attention: str, repeats: int
) -> tuple[float, dict[str, float]]:
    """Median seconds of one decode step of `rows` rows at context `ctx` (a CUDA graph replay
    on CUDA), and the spread."""
    return _step_time(decode_step(model, rows, ctx, attention).run, model.device, repeats)


def _step_time(fn, device: torch.device, repeats: int) -> tuple[float, dict[str, float]]:
    times = _timed(fn, device, repeats)
    return statistics.median(times), {"min_s": min(times), "max_s": max(times)}


def profile_step(step: DecodeStep, device: torch.device, n_steps: int) -> dict:
    """The step's per-kernel profile (bench/step_profile.py): graph replays on CUDA, the eager
    step's ops on the CPU."""
    if device.type == "cuda":
        return step_profile.profile_cuda_step(step.run, step.eager, step.graph, n_steps)
    return step_profile.profile_cpu_step(step.eager, n_steps)


def measure(
    model_name: str,
    device: str = "cuda",
    dtype: str = "bfloat16",
    rows_list: tuple[int, ...] = (1, 32),
    ctx: int = 512,
    attention: str = "triton",
    repeats: int = 50,
    copy_bytes: int = 1 << 30,
    profile: bool = False,
    profile_steps: int = 20,
) -> dict:
    dev = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    model = LlamaModel.from_spec(model_name, torch_dtype, dev)
    bandwidth = copy_bandwidth(dev, copy_bytes)
    weights = weight_bytes_per_step(model)
    steps: list[dict] = []
    out: dict = {
        "model": model_name,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": dtype,
        "attention": attention if dev.type == "cuda" else "torch",
        "ctx": ctx,
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "weight_bytes": weights,
        "steps": steps,
    }
    kept: list[tuple[dict, DecodeStep]] = []
    for rows in rows_list:
        kv = kv_bytes_per_step(model, rows, ctx, torch_dtype)
        step = decode_step(model, rows, ctx, attention if dev.type == "cuda" else "torch", keep_graph=profile)
        seconds, spread = _step_time(step.run, dev, repeats)
        floor = (weights + kv) / bandwidth
        steps.append(
            {
                "rows": rows,
                "kv_bytes": kv,
                "step_us": round(seconds * 1e6, 1),
                "floor_us": round(floor * 1e6, 1),
                "ratio": round(seconds / floor, 2),
                "achieved_GBps": round((weights + kv) / seconds / 1e9, 1),
                "step_min_us": round(spread["min_s"] * 1e6, 1),
                "step_max_us": round(spread["max_s"] * 1e6, 1),
            }
        )
        if profile:
            kept.append((steps[-1], step))
        del step
    # after all timing and capture: no profiler overhead in the timed figures, no session before a capture
    for entry, step in kept:
        entry["profile"] = profile_step(step, dev, profile_steps)
    return out


def format_table(r: dict) -> str:
    lines = [
        f"{r['model']} {r['dtype']} on {r['device']} ({r['attention']} attention), ctx {r['ctx']}: "
        f"copy bandwidth {r['copy_bandwidth_GBps']} GB/s, weights {r['weight_bytes'] / 1e6:.1f} MB",
        f"{'rows':>5} {'step us':>9} {'floor us':>9} {'ratio':>6} {'GB/s':>8}",
    ]
    for s in r["steps"]:
        lines.append(
            f"{s['rows']:5d} {s['step_us']:9.1f} {s['floor_us']:9.1f} {s['ratio']:6.2f} {s['achieved_GBps']:8.1f}"
        )
    for s in r["steps"]:
        if "profile" in s:
            lines += ["", step_profile.format_profile(s["rows"], s["profile"])]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rows", default="1,32", help="decode rows per step, comma-separated")
    ap.add_argument("--ctx", type=int, default=512, help="every row's context length")
    ap.add_argument("--attention", default="triton", choices=["triton", "torch"])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth copy")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the timing, each step's kernels by name (torch.profiler)",
    )
    ap.add_argument("--profile-steps", type=int, default=20, help="steps (graph replays) the profile records")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = measure(
        args.model,
        args.device,
        args.dtype,
        tuple(int(x) for x in args.rows.split(",")),
        args.ctx,
        args.attention,
        args.repeats,
        args.copy_mib << 20,
        profile=args.profile,
        profile_steps=args.profile_steps,
    )
    print(format_table(result))
    if args.json:
        save_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
