"""The decode step against its memory roofline.

A decode step is memory-bound: it cannot take less than the bytes it must read (every weight
the step multiplies by, plus each row's cached k/v) divided by the memory bandwidth. This
measures, side by side in one process:

  copy bandwidth   a large device-to-device copy (bytes read + written) / time;
  step time        the static step (the CUDA graph the server replays, or on the CPU the same
                   step run eagerly) for `rows` decode rows each at context `ctx`, sampling
                   included, median over replays after warm-up;

and reports floor = (weight bytes + KV bytes) / bandwidth and ratio = step time / floor.

Each step kind of --step-kernels (EngineConfig.step_kernels: fused, the five Triton kernels a
layer; layered, cuBLAS projections and a kernel per pointwise op) is its own StaticStep over the
same model and KV cache, timed side by side: every round replays each kind once, in turn, the
order reversed every other round, so the machine's drift lands on all of them alike. On the CPU
the kinds are one eager step, measured once and reported under each kind (step_kernels_note).

With --profile, after all the timing, each rows value's step of each kind is profiled
(bench/step_profile.py): its kernels by name over --profile-steps graph replays, the GPU idle
gaps between them, the captured graph's nodes by type; in the JSON under each step's "profile".

JSON: the first kind's steps under "steps" (as before there were kinds), every kind's under
"by_kind", the fused step's time over the layered one's per rows under "fused_over_layered"
(null unless both ran as steps of their own), a kind that failed to build under "errors".

    python -m ringleader.bench.roofline --model llama-1b --dtype bfloat16 --rows 1,32 --ctx 512 --json PATH
    python -m ringleader.bench.roofline --model llama-1b --rows 1,32 --ctx 512 --json PATH --profile
    python -m ringleader.bench.roofline --model llama-1b --step-kernels layered --json PATH
    ringleader bench --roofline --model llama-1b --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import inspect
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
from ringleader.device.step.triton_gemv import FUSED_MAX_ROWS

PAGE_SIZE = 16  # KV-cache positions per page, the engine's default
# EngineConfig.step_kernels' choices, the server's default first
STEP_KERNELS = ("fused", "layered")


def takes_step_kernels() -> bool:
    """Whether this StaticStep builds the step kind it is asked for (its step_kernels keyword)."""
    return "step_kernels" in inspect.signature(StaticStep).parameters


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


def _time_once(fn, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed(fn, device: torch.device, repeats: int) -> list[float]:
    return timed_side_by_side([fn], device, repeats)[0]


def timed_side_by_side(
    fns: list[Callable[[], object]], device: torch.device, repeats: int
) -> list[list[float]]:
    """Seconds of each of fns, `repeats` times each, interleaved: every round runs each once, in
    turn, the order reversed every other round (so no fn always follows the same one)."""
    for fn in fns:
        fn()  # warm-up
    _sync(device)
    out: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            out[i].append(_time_once(fns[i], device))
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
    # bytes per step by kernel name the step knows itself (the fused step's weights)
    known_bytes: dict[str, float] | None = None


def _new_graph(keep: bool) -> torch.cuda.CUDAGraph:
    """keep: the cudaGraph_t stays readable (raw_cuda_graph) after capture; a torch without
    keep_graph gives a plain graph, whose nodes are then not read."""
    if keep:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:
            pass
    return torch.cuda.CUDAGraph()


def decode_kv_cache(model: LlamaModel, rows: int, ctx: int) -> KVCache:
    """The paged cache `rows` decode rows at context `ctx` use (the scratch page beside)."""
    return StaticStep.new_kv_cache(model, rows * -(-max(ctx, PAGE_SIZE) // PAGE_SIZE), PAGE_SIZE)


def decode_step(
    model: LlamaModel,
    rows: int,
    ctx: int,
    attention: str,
    keep_graph: bool = False,
    step_kernels: str | None = None,
    kv: KVCache | None = None,
) -> DecodeStep:
    """The static step of `rows` decode rows at context `ctx`, captured as a CUDA graph on CUDA.
    step_kernels: the kind StaticStep builds (None: its default); kv: a cache from
    decode_kv_cache to share with another kind's step (None: a new one)."""
    device = model.device
    max_ctx = max(ctx, PAGE_SIZE)
    pages_per_slot = -(-max_ctx // PAGE_SIZE)
    if kv is None:
        kv = decode_kv_cache(model, rows, ctx)
    kind = {} if step_kernels is None else {"step_kernels": step_kernels}
    step = StaticStep(model, kv, rows, max_ctx, token_budget=rows, attention=attention, **kind)
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
    fused = getattr(step, "fused_decode", None) if rows <= FUSED_MAX_ROWS else None
    known = fused.weight_bytes_by_kernel() if fused is not None else None
    return DecodeStep(graph.replay, eager, graph, layout, known)


def profile_step(
    step: DecodeStep, device: torch.device, n_steps: int, step_kernels: str | None = None
) -> dict:
    """The step's per-kernel profile (bench/step_profile.py): graph replays on CUDA, the eager
    step's ops on the CPU; step_kernels: the kind(s) it is, named in the profile."""
    if device.type == "cuda":
        return step_profile.profile_cuda_step(
            step.run, step.eager, step.graph, n_steps, step_kernels, step.known_bytes
        )
    return step_profile.profile_cpu_step(step.eager, n_steps, step_kernels)


def steps_apart(device: torch.device) -> bool:
    """Whether each step kind is a StaticStep of its own: on CUDA, where StaticStep takes
    step_kernels (on the CPU every kind is the one eager step)."""
    return device.type == "cuda" and takes_step_kernels()


def kinds_note(device: torch.device, apart: bool) -> str | None:
    """Why the step kinds are one measured step, or None where each is its own."""
    if apart:
        return None
    if device.type != "cuda":
        return "on the CPU every step kind is the same eager step: measured once, reported under each kind"
    return "this StaticStep takes no step_kernels: its one step measured once, reported under each kind"


def build_kinds(
    model: LlamaModel, rows: int, ctx: int, attention: str, kinds: tuple[str, ...], apart: bool, keep: bool
) -> tuple[dict[str, DecodeStep], list[dict]]:
    """Each kind's step of `rows` rows over one KV cache (apart: a StaticStep per kind; else one
    step for all), and an error entry for each kind that failed to build: the others still run."""
    if not apart:
        one = decode_step(model, rows, ctx, attention, keep_graph=keep)
        return dict.fromkeys(kinds, one), []
    kv = decode_kv_cache(model, rows, ctx)
    built: dict[str, DecodeStep] = {}
    errors: list[dict] = []
    for kind in kinds:
        try:
            built[kind] = decode_step(model, rows, ctx, attention, keep, step_kernels=kind, kv=kv)
        except Exception as exc:  # a bring-up window keeps the other kinds' figures
            errors.append({"rows": rows, "step_kernels": kind, "error": f"{type(exc).__name__}: {exc}"})
    return built, errors


def step_entry(kind: str, rows: int, kv: int, weights: int, bandwidth: float, times: list[float]) -> dict:
    seconds, floor = statistics.median(times), (weights + kv) / bandwidth
    return {
        "rows": rows,
        "step_kernels": kind,
        "kv_bytes": kv,
        "step_us": round(seconds * 1e6, 1),
        "floor_us": round(floor * 1e6, 1),
        "ratio": round(seconds / floor, 2),
        "achieved_GBps": round((weights + kv) / seconds / 1e9, 1),
        "step_min_us": round(min(times) * 1e6, 1),
        "step_max_us": round(max(times) * 1e6, 1),
    }


def fused_over_layered(by_kind: dict[str, list[dict]]) -> list[dict]:
    """Per rows both kinds measured: the fused step's median time over the layered one's."""
    layered = {s["rows"]: s for s in by_kind.get("layered", [])}
    return [
        {
            "rows": f["rows"],
            "fused_us": f["step_us"],
            "layered_us": layered[f["rows"]]["step_us"],
            "ratio": round(f["step_us"] / layered[f["rows"]]["step_us"], 3),
        }
        for f in by_kind.get("fused", [])
        if f["rows"] in layered and layered[f["rows"]]["step_us"] > 0
    ]


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
    step_kernels: tuple[str, ...] = STEP_KERNELS,
) -> dict:
    dev = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    kinds = tuple(dict.fromkeys(step_kernels))
    model = LlamaModel.from_spec(model_name, torch_dtype, dev)
    bandwidth = copy_bandwidth(dev, copy_bytes)
    weights = weight_bytes_per_step(model)
    attention = attention if dev.type == "cuda" else "torch"
    apart = steps_apart(dev)
    by_kind: dict[str, list[dict]] = {kind: [] for kind in kinds}
    errors: list[dict] = []
    out: dict = {
        "model": model_name,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": dtype,
        "attention": attention,
        "ctx": ctx,
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "weight_bytes": weights,
        "step_kernels": list(kinds),
        "step_kernels_note": kinds_note(dev, apart),
    }
    kept: list[tuple[DecodeStep, list[dict]]] = []  # each distinct step and its kinds' entries
    for rows in rows_list:
        built, failed = build_kinds(model, rows, ctx, attention, kinds, apart, keep=profile)
        errors += failed
        steps = list({id(step): step for step in built.values()}.values())
        times = timed_side_by_side([step.run for step in steps], dev, repeats)
        kv = kv_bytes_per_step(model, rows, ctx, torch_dtype)
        for step, step_times in zip(steps, times, strict=True):
            entries = []
            for kind in (k for k in kinds if built.get(k) is step):
                entries.append(step_entry(kind, rows, kv, weights, bandwidth, step_times))
                by_kind[kind].append(entries[-1])
            if profile:
                kept.append((step, entries))
        del built, steps
    # after all timing and capture: no profiler overhead in the timed figures, no session before a capture
    for step, entries in kept:
        named = ",".join(e["step_kernels"] for e in entries)
        found = profile_step(step, dev, profile_steps, named)
        for entry in entries:
            entry["profile"] = found
    first = next((k for k in kinds if by_kind[k]), None)
    out["steps"] = by_kind[first] if first is not None else []
    out["by_kind"] = by_kind
    both = apart and {"fused", "layered"} <= set(kinds)
    out["fused_over_layered"] = fused_over_layered(by_kind) if both else None
    out["errors"] = errors
    return out


def format_table(r: dict) -> str:
    by_kind = r.get("by_kind") or {"": r["steps"]}
    lines = [
        f"{r['model']} {r['dtype']} on {r['device']} ({r['attention']} attention), ctx {r['ctx']}: "
        f"copy bandwidth {r['copy_bandwidth_GBps']} GB/s, weights {r['weight_bytes'] / 1e6:.1f} MB",
    ]
    if r.get("step_kernels_note"):
        lines.append(f"note: {r['step_kernels_note']}")
    lines.append(f"{'rows':>5} {'kernels':>8} {'step us':>9} {'floor us':>9} {'ratio':>6} {'GB/s':>8}")
    for rows in dict.fromkeys(s["rows"] for steps in by_kind.values() for s in steps):
        for kind, steps in by_kind.items():
            for s in (s for s in steps if s["rows"] == rows):
                lines.append(
                    f"{rows:5d} {kind:>8} {s['step_us']:9.1f} {s['floor_us']:9.1f} {s['ratio']:6.2f} "
                    f"{s['achieved_GBps']:8.1f}"
                )
    for x in r.get("fused_over_layered") or []:
        lines.append(
            f"rows {x['rows']}: fused/layered {x['ratio']:.3f} ({x['fused_us']} / {x['layered_us']} us)"
        )
    for e in r.get("errors") or []:
        lines.append(f"rows {e['rows']}, {e['step_kernels']}: not measured, {e['error']}")
    seen: set[int] = set()  # a profile shared by kinds (one step) printed once
    for steps in by_kind.values():
        for s in steps:
            if "profile" in s and id(s["profile"]) not in seen:
                seen.add(id(s["profile"]))
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
    ap.add_argument(
        "--step-kernels",
        default=",".join(STEP_KERNELS),
        help=f"the step kinds to time side by side, comma-separated, of {', '.join(STEP_KERNELS)} "
        "(default: %(default)s; the first's figures are the JSON's steps)",
    )
    return ap


def parse_kinds(text: str) -> tuple[str, ...]:
    """The comma list of step kinds, in order, each once; ValueError on an unknown one."""
    kinds = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    unknown = [k for k in kinds if k not in STEP_KERNELS]
    if unknown or not kinds:
        raise ValueError(f"--step-kernels takes {', '.join(STEP_KERNELS)}, got {text!r}")
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        kinds = parse_kinds(args.step_kernels)
    except ValueError as exc:
        parser.error(str(exc))
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
        step_kernels=kinds,
    )
    print(format_table(result))
    if args.json:
        save_json(result, args.json)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
