"""CPU micro-benchmark of the quantized matmuls at SmolLM2-135M's shapes.

Variants, timed side by side in one process (round-robin repeats, median per call):
  ours-<isa>       device/weights/cpu_quant_matmul.py built for isa native / avx2 / generic
                   (int8 activations, integer dots; avx2 on an AVX-512 machine measures the
                   AVX2 path)
  torch-int4       torch's _weight_int4pack_mm_for_cpu (CpuInt4Matmul of weight_kernels.py)
  dense-fp32       F.linear on the dequantized float32 weight
  dense-bf16       F.linear on a bf16 copy (activations cast in, the result cast out)
  torch-int4-aten-avx2  (--aten-avx2) torch's kernel with ATEN_CPU_CAPABILITY=avx2, timed in a
                   child process (the variable must be set before torch imports)

Shapes (K=576: qkv fused N=960, o N=576, gate|up N=3072; down K=1536 N=576; lm_head N=49152 in
Q8_0), from random GGUF bytes (Q4_1, lm_head Q8_0) or, with --model, layer 0's matrices and the
output (or tied embedding) matrix of a GGUF file (`python -m ringleader.bench.smollm2` prints
the SmolLM2 file's path). The per-step total is 30 layers x the 4 layer matrices + lm_head, per
variant: the matmul time of one decode step (M = 1) or of one step of M rows.

GB/s counts each variant's own weight bytes (ours: 20 B per 32 Q4_1 weights with fp16 scales,
36 B per 32 Q8_0 weights; torch-int4: 16 B of codes + 4 B of bf16 scale/zero per 32; dense:
4 or 2 B a weight). --generic-max-m bounds the rows the (slow) generic build is timed at.

    python -m ringleader.bench.lab.cpu_quant_micro --threads 1,2 --aten-avx2 --step --json out.json

Measured on a 2-core AMD EPYC (family 26) VM (avx2, avx512_vnni, avx512_bf16, avx_vnni), torch
2.13 (random Q4_1 bytes; the real SmolLM2 file gives the same within noise), us per call:

  2 threads, M=1        ours-native ours-avx2 torch-int4 int4@aten-avx2 dense-fp32 dense-bf16
  qkv   960x576               5.1       6.2       15.4         32.9        32.2       35.0
  gate_up 3072x576            9.2      13.0       31.2         91.7       123.2       78.5
  lm_head 49152x576 Q8_0    381.5     428.2     1128.5       2843.8      7030.7     1912.7
  step sum (30 x 4 + head)   1132      1403       3489         8739       13629       7544
  measured step, from memory 2932      3404       4881            -           -      12282

  step sums, 2 threads      M=8    M=16    M=64   M=256
  ours-native              2732    4788   16173   60940
  ours-avx2                5503   10553   38641  149074
  torch-int4               9280   17373   64449  282159
  dense-fp32              30194   39734  101473  339711
  dense-bf16               9147   11364   26769   82034

The per-call sums run from caches (one matrix timed over and over); the measured step streams
~98 MB of weights from memory (30 distinct layers), where a plain read of the same buffers
(torch.sum) takes ~1.9-2.5 ms on 2 threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ringleader.bench.report import save_json
from ringleader.device.backends.cpu_features import cpu_features
from ringleader.device.weights.cpu_quant_matmul import CpuQuantMatmul, isa_runs_here, kernel_path
from ringleader.device.weights.gguf_quants import BLOCK_LAYOUTS
from ringleader.device.weights.quant_weights import GGUFMatrix, cat_rows
from ringleader.device.weights.weight_kernels import CpuInt4Matmul

LAYERS = 30
# name -> (N, K, per-step count); lm_head's type is Q8_0, the layers' --qtype
SHAPES: dict[str, tuple[int, int, int]] = {
    "qkv": (960, 576, LAYERS),
    "o": (576, 576, LAYERS),
    "gate_up": (3072, 576, LAYERS),
    "down": (576, 1536, LAYERS),
    "lm_head": (49152, 576, 1),
}
# byte offsets of the f16 scale fields in a block (random bytes there could be inf or nan)
F16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
}
FLAGS_SHOWN = (
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
)
TARGET_ROUND_S = 0.01  # each variant's share of a round: enough calls to time reliably


def random_gguf(qtype: str, n: int, k: int, seed: int = 0) -> GGUFMatrix:
    """A GGUF matrix of random codes, with finite f16 scales of a trained model's magnitude."""
    block, type_size = BLOCK_LAYOUTS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // block, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(blocks.shape[0]) * 0.01).astype("<f2")
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return GGUFMatrix(torch.from_numpy(blocks).view(n, -1), qtype, (n, k), f"random.{qtype}")


def model_matrices(path: str) -> dict[str, GGUFMatrix]:
    """Layer 0's matrices (q|k|v and gate|up fused by rows) and the output matrix of a GGUF file."""
    import ringleader.device.model  # noqa: F401 - gguf_checkpoint's imports need the model package first
    from ringleader.device.weights.gguf_checkpoint import _kept_quantized, open_gguf

    tensors = {t.name: t for t in open_gguf(path).tensors}

    def get(name: str) -> GGUFMatrix:
        return _kept_quantized(tensors[name], "cpu")

    def fused(*names: str) -> GGUFMatrix:
        out = cat_rows([get(f"blk.0.{n}.weight") for n in names])
        if not isinstance(out, GGUFMatrix):
            raise SystemExit(f"{path}: {names} differ in type; this benchmark takes one type per matrix")
        return out

    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return {
        "qkv": fused("attn_q", "attn_k", "attn_v"),
        "o": get("blk.0.attn_output.weight"),
        "gate_up": fused("ffn_gate", "ffn_up"),
        "down": get("blk.0.ffn_down.weight"),
        "lm_head": get(head),
    }


def cpu_header() -> dict:
    cpu = cpu_features()
    model, flags = cpu.model, cpu.flags
    return {
        "model": model,
        "cores": cpu.cores,
        "flags": [f for f in FLAGS_SHOWN if f in flags],
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "loadavg_at_start": os.getloadavg()[0],  # other work on the cores skews the 2-thread cells
    }


class Variant:
    def __init__(
        self, name: str, fn: Callable[[torch.Tensor], torch.Tensor], nbytes: int, max_m: int = 1 << 30
    ):
        self.name, self.fn, self.nbytes, self.max_m = name, fn, nbytes, max_m


def variants_for(matrix: GGUFMatrix, isas: list[str], torch_only: bool, generic_max_m: int) -> list[Variant]:
    n, k = matrix.shape
    out = []
    if not torch_only:
        for isa in isas:
            op = CpuQuantMatmul.from_gguf(matrix, isa)
            out.append(
                Variant(f"ours-{isa}", op, op.nbytes, generic_max_m if op.path == "generic" else 1 << 30)
            )
    int4 = CpuInt4Matmul(matrix.digits(), n)
    out.append(Variant("torch-int4", int4, int4.nbytes))
    if not torch_only:
        w32 = matrix.dense(torch.float32)
        w16 = w32.to(torch.bfloat16)
        out.append(Variant("dense-fp32", lambda x, w=w32: F.linear(x, w), w32.numel() * 4))
        out.append(
            Variant("dense-bf16", lambda x, w=w16: F.linear(x.to(torch.bfloat16), w).float(), w16.numel() * 2)
        )
    return out


def time_cell(variants: list[Variant], x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds per call of each variant, the variants interleaved round by round."""
    reps, slowest = {}, 0.0
    for v in variants:
        v.fn(x)
        t0 = time.perf_counter()
        v.fn(x)
        once = max(time.perf_counter() - t0, 1e-7)
        reps[v.name], slowest = max(1, int(TARGET_ROUND_S / once)), max(slowest, once)
    rounds = repeats if slowest < 0.1 else max(3, repeats // 2)  # a call of 0.1 s: fewer rounds
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            r = reps[v.name]
            t0 = time.perf_counter()
            for _ in range(r):
                v.fn(x)
            times[v.name].append((time.perf_counter() - t0) / r)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(args: argparse.Namespace) -> dict:
    matrices = (
        model_matrices(args.model)
        if args.model
        else {
            name: random_gguf("Q8_0" if name == "lm_head" else args.qtype, n, k, seed=i)
            for i, (name, (n, k, _)) in enumerate(SHAPES.items())
        }
    )
    matrices = {name: m for name, m in matrices.items() if not args.shapes or name in args.shapes}
    isas = [isa for isa in args.isas if isa_runs_here(isa)]
    built = {name: variants_for(m, isas, args.torch_only, args.generic_max_m) for name, m in matrices.items()}
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m_rows in args.m:
            for name, variants in built.items():
                n, k = matrices[name].shape
                x = torch.randn(m_rows, k)
                timed = time_cell([v for v in variants if m_rows <= v.max_m], x, args.repeats)
                for v in variants:
                    if v.name in timed:
                        s = timed[v.name]
                        results.append(
                            {
                                "threads": threads,
                                "m": m_rows,
                                "shape": name,
                                "n": n,
                                "k": k,
                                "qtype": matrices[name].qtype,
                                "variant": v.name,
                                "us": s * 1e6,
                                "weight_bytes": v.nbytes,
                                "gbps": v.nbytes / s / 1e9,
                            }
                        )
                if not args.quiet:
                    line = "  ".join(f"{nm} {s * 1e6:.1f}" for nm, s in timed.items())
                    print(f"T={threads} M={m_rows} {name}: {line}", file=sys.stderr, flush=True)
    return {
        "cpu": cpu_header(),
        "paths": {isa: kernel_path(isa) for isa in isas} if not args.torch_only else {},
        "source": args.model or f"random GGUF bytes ({args.qtype}, lm_head Q8_0)",
        "results": results,
    }


def model_layers(path: str) -> tuple[list[dict[str, GGUFMatrix]], GGUFMatrix]:
    """Every layer's matrices of a GGUF file (q|k|v and gate|up fused) and its output matrix."""
    import ringleader.device.model  # noqa: F401 - gguf_checkpoint's imports need the model package first
    from ringleader.device.weights.gguf_checkpoint import _kept_quantized, open_gguf

    tensors = {t.name: t for t in open_gguf(path).tensors}
    n_layers = 1 + max(int(name.split(".")[1]) for name in tensors if name.startswith("blk."))

    def get(name: str) -> GGUFMatrix:
        return _kept_quantized(tensors[name], "cpu")

    layers = []
    for i in range(n_layers):
        b = f"blk.{i}."
        layers.append(
            {
                "qkv": cat_rows([get(b + n + ".weight") for n in ("attn_q", "attn_k", "attn_v")]),
                "o": get(b + "attn_output.weight"),
                "gate_up": cat_rows([get(b + n + ".weight") for n in ("ffn_gate", "ffn_up")]),
                "down": get(b + "ffn_down.weight"),
            }
        )
    return layers, get("output.weight" if "output.weight" in tensors else "token_embd.weight")


def step_callables(kind: str, matrix: GGUFMatrix) -> Callable[[torch.Tensor], torch.Tensor]:
    if kind.startswith("ours-"):
        return CpuQuantMatmul.from_gguf(matrix, kind.removeprefix("ours-"))
    if kind == "torch-int4":
        return CpuInt4Matmul(matrix.digits(), matrix.shape[0])
    w = matrix.dense(torch.float32)
    if kind == "dense-fp32":
        return lambda x, w=w: F.linear(x, w)
    w16 = w.to(torch.bfloat16)
    return lambda x, w=w16: F.linear(x.to(torch.bfloat16), w).float()


def run_steps(args: argparse.Namespace) -> list[dict]:
    """Whole decode steps: every layer's own matrices (30 x 4, ~100 MB in our format: more than
    the L3 cache, so the weights stream from memory as in serving) and lm_head, in step order."""
    if args.model:
        layers, head = model_layers(args.model)
    else:
        layers = [
            {
                name: random_gguf(args.qtype, n, k, seed=1000 + 10 * i + j)
                for j, (name, (n, k, _)) in enumerate(SHAPES.items())
                if name != "lm_head"
            }
            for i in range(LAYERS)
        ]
        head = random_gguf("Q8_0", *SHAPES["lm_head"][:2], seed=999)
    kinds = [f"ours-{isa}" for isa in args.isas if isa_runs_here(isa) and kernel_path(isa) != "generic"]
    kinds += [k for k in ("torch-int4", "dense-fp32", "dense-bf16") if k in args.step_variants]
    order = ("qkv", "o", "gate_up", "down")
    steps = {}
    for kind in kinds:
        calls = [
            (step_callables(kind, layer[name]), layer[name].shape[1]) for layer in layers for name in order
        ]
        steps[kind] = calls + [(step_callables(kind, head), head.shape[1])]
    out = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m_rows in args.step_m:
            xs = {k: torch.randn(m_rows, k) for k in {k for calls in steps.values() for _, k in calls}}
            variants = [
                Variant(kind, lambda _x, calls=calls, xs=xs: [f(xs[k]) for f, k in calls], 0)
                for kind, calls in steps.items()
            ]
            timed = time_cell(variants, xs[576] if 576 in xs else next(iter(xs.values())), args.repeats)
            for kind, sec in timed.items():
                out.append(
                    {"threads": threads, "m": m_rows, "variant": kind, "us": sec * 1e6, "layers": len(layers)}
                )
            if not args.quiet:
                line = "  ".join(f"{nm} {sec * 1e6:.0f}" for nm, sec in timed.items())
                print(f"step T={threads} M={m_rows}: {line}", file=sys.stderr, flush=True)
    return out


def step_totals(results: list[dict]) -> list[dict]:
    """Per (threads, M, variant): the 30 layers' 4 matrices + lm_head, where all five were timed."""
    cells: dict[tuple, dict[str, float]] = {}
    for r in results:
        cells.setdefault((r["threads"], r["m"], r["variant"]), {})[r["shape"]] = r["us"]
    out = []
    for (threads, m_rows, variant), by_shape in cells.items():
        if set(by_shape) == set(SHAPES):
            total = sum(SHAPES[s][2] * us for s, us in by_shape.items())
            out.append({"threads": threads, "m": m_rows, "variant": variant, "us": total})
    return out


def aten_avx2_results(args: argparse.Namespace) -> list[dict]:
    """torch's int4 kernel under ATEN_CPU_CAPABILITY=avx2, timed by a child run of this module."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "aten_avx2.json"
        cmd = [
            sys.executable,
            "-m",
            "ringleader.bench.lab.cpu_quant_micro",
            "--torch-only",
            "--quiet",
            "--json",
            str(out),
            "--threads",
            ",".join(map(str, args.threads)),
            "--m",
            ",".join(map(str, args.m)),
            "--repeats",
            str(args.repeats),
            "--qtype",
            args.qtype,
        ]
        if args.model:
            cmd += ["--model", args.model]
        if args.shapes:
            cmd += ["--shapes", ",".join(args.shapes)]
        subprocess.run(cmd, check=True, env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"})
        import json

        child = json.loads(out.read_text())
    if child["cpu"]["torch_cpu_capability"] != "AVX2":
        print(f"note: the child ran at {child['cpu']['torch_cpu_capability']}, not AVX2", file=sys.stderr)
    for r in child["results"]:
        r["variant"] = "torch-int4-aten-avx2"
    return child["results"]


def print_report(report: dict) -> None:
    cpu = report["cpu"]
    print(f"CPU: {cpu['model']} ({cpu['cores']} cores), flags: {' '.join(cpu['flags'])}")
    print(f"torch {cpu['torch']} (capability {cpu['torch_cpu_capability']}); kernel paths: {report['paths']}")
    print(f"weights: {report['source']}; load average {cpu['loadavg_at_start']:.2f} at start")
    results = report["results"]
    variants = list(dict.fromkeys(r["variant"] for r in results))
    for threads in sorted({r["threads"] for r in results}):
        for m_rows in sorted({r["m"] for r in results}):
            rows = [r for r in results if r["threads"] == threads and r["m"] == m_rows]
            print(f"\nthreads={threads} M={m_rows}: us per call (GB/s of weight bytes)")
            print(f"{'shape':<9}" + "".join(f"{v:>22}" for v in variants))
            for shape in SHAPES:
                cells = {r["variant"]: r for r in rows if r["shape"] == shape}
                if not cells:
                    continue
                line = f"{shape:<9}"
                for v in variants:
                    r = cells.get(v)
                    line += f"{r['us']:>13.1f} ({r['gbps']:5.1f})" if r else f"{'-':>22}"
                print(line)
            totals = {
                t["variant"]: t["us"]
                for t in report["step_totals"]
                if t["threads"] == threads and t["m"] == m_rows
            }
            if totals:
                print(
                    f"{'step sum':<9}"
                    + "".join(f"{totals[v]:>22.0f}" if v in totals else f"{'-':>22}" for v in variants)
                )
    if report.get("steps"):
        print("\nmeasured decode steps (every layer's own weights, streamed from memory): us per step")
        for t in report["steps"]:
            print(f"  threads={t['threads']} M={t['m']:<4} {t['variant']:<14} {t['us']:10.0f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def ints(s: str) -> list[int]:
        return [int(v) for v in s.split(",") if v]

    ap.add_argument("--threads", type=ints, default=[1, 2])
    ap.add_argument("--m", type=ints, default=[1, 8, 16, 64, 256], help="activation rows")
    ap.add_argument("--isas", type=lambda s: s.split(","), default=["native", "avx2", "generic"])
    ap.add_argument("--qtype", default="Q4_1", help="the layers' type for random weights")
    ap.add_argument("--model", help="a GGUF file: time its layer 0 and output matrices")
    ap.add_argument("--shapes", type=lambda s: s.split(","), help=f"a subset of {','.join(SHAPES)}")
    ap.add_argument("--repeats", type=int, default=7, help="rounds over the variants")
    ap.add_argument(
        "--generic-max-m", type=int, default=16, help="the most rows the generic build is timed at"
    )
    ap.add_argument(
        "--aten-avx2", action="store_true", help="also torch's kernel at ATEN_CPU_CAPABILITY=avx2"
    )
    ap.add_argument(
        "--step", action="store_true", help="also time whole decode steps over 30 distinct layers"
    )
    ap.add_argument("--step-m", type=ints, default=[1, 16], help="activation rows of the measured steps")
    ap.add_argument(
        "--step-variants",
        type=lambda s: s.split(","),
        default=["torch-int4", "dense-bf16"],
        help="torch's variants in the measured steps (dense-fp32 holds 0.5 GB)",
    )
    ap.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    report = run(args)
    if args.aten_avx2:
        report["results"] += aten_avx2_results(args)
    report["step_totals"] = step_totals(report["results"])
    report["cpu"]["loadavg_at_end"] = os.getloadavg()[0]
    if args.step and not args.torch_only:
        report["steps"] = run_steps(args)
    if args.json:
        save_json(report, args.json)
    if not args.torch_only:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
