"""Counts the kernels of one static (CUDA-graph) model step, without a GPU.

The step is walked on the meta device, where nothing is computed: a TorchDispatchMode counts
every aten operator that launches a kernel (views and bare allocations launch none), and
device/step/triton_launch.py records each Triton launch instead of running it. Forward hooks
on the decoder layers split the count into what each layer costs and what the step costs
around them (embedding, final norm, lm_head, sampling). In a captured graph each counted launch
is one kernel node, paying launch and tail time inside the graph, which is why the decode step
wants few of them.

    python -m ringleader.bench.lab.step_kernels --model llama-1b --json PATH

prints the product path (Triton attention + fused pointwise kernels) next to the same step with
torch's pointwise ops and next to the all-torch reference, and writes {"kernels_per_layer",
"kernels_per_step", "by_kind": {...}, ...} for the first.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ringleader.bench.report import save_json
from ringleader.device.model.llama import LlamaModel
from ringleader.device.model.presets import preset_config
from ringleader.device.step.static_step import StaticStep
from ringleader.device.step.step_layout import StepLayout
from ringleader.device.step.triton_gemv import FUSED_MAX_ROWS
from ringleader.device.step.triton_launch import LaunchRecorder

PAGE_SIZE = 16  # KV-cache positions per page, the engine's default

# operators that launch no kernel: allocation without a fill, and aliasing bookkeeping
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "alias", "set_"}


class KernelCounter(TorchDispatchMode):
    """Counts kernel-launching aten operators by name while active; `marks` snapshot the total."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        # a kernel writes a tensor: operators returning dtypes or shapes launch none
        writes = any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out))
        if writes and not (func.is_view or name in _NO_KERNEL):
            self.counts["aten." + name] += 1
        return out


def count_step(
    model_name: str,
    bucket: int = 1,
    n_slots: int = 1,
    max_ctx: int = 4096,
    dtype: torch.dtype = torch.bfloat16,
    attention: str = "triton",
    fused: bool | None = None,
    step_kernels: str = "fused",
) -> dict:
    """Kernels of one StaticStep.run(bucket) of `model_name` (a preset), on the meta device;
    step_kernels as StaticStep takes it (the fused step runs buckets up to 32 rows)."""
    config = preset_config(model_name)
    model = LlamaModel(config, dtype, "meta")
    pages_per_slot = -(-max_ctx // PAGE_SIZE)
    kv = StaticStep.new_kv_cache(model, n_slots * pages_per_slot, PAGE_SIZE)
    budget = max(bucket, n_slots)
    step = StaticStep(
        model, kv, n_slots, max_ctx, budget, attention=attention, fused=fused, step_kernels=step_kernels
    )
    # as the backends keep them: the token counts the penalties read
    layout = StepLayout.allocate(n_slots, budget, "meta", pages_per_slot, config.vocab_size)

    aten, triton = KernelCounter(), LaunchRecorder()
    per_layer: list[Counter[str]] = []
    before: list[Counter[str]] = []

    def total() -> Counter[str]:
        return aten.counts + Counter({"triton." + k: n for k, n in triton.counts.items()})

    hooks = [
        h
        for layer in model.layers
        for h in (
            layer.register_forward_pre_hook(lambda *_: before.append(total())),
            layer.register_forward_hook(lambda *_: per_layer.append(total() - before.pop())),
        )
    ]
    fused_decode = step.fused_decode if bucket <= FUSED_MAX_ROWS else None
    if fused_decode is not None:  # the fused step runs its layers without their forward()
        layer_step = fused_decode.layer

        def counted_layer(*args):
            start = total()
            layer_step(*args)
            per_layer.append(total() - start)

        fused_decode.layer = counted_layer  # type: ignore[method-assign]
    # outside inference mode, so composite operators (linear, to, softmax...) reach the counter
    # decomposed into the operators that launch the kernels
    run = StaticStep.run.__wrapped__  # type: ignore[attr-defined]
    try:
        with torch.no_grad(), triton, aten:
            logits = run(step, bucket, layout)
    finally:
        for h in hooks:
            h.remove()
    step_total = total()
    # the first layer has no previous block output to add; every other layer is the same
    layer_counts = {sum(c.values()) for c in per_layer[1:]} or {sum(per_layer[0].values())}
    if len(layer_counts) != 1:
        raise AssertionError(f"layers launch different kernel counts: {sorted(layer_counts)}")
    around = step_total - sum(per_layer, Counter())
    return {
        "model": model_name,
        "attention": attention,
        "fused": step.fused,
        "step_kernels": "fused" if fused_decode is not None else "layered",
        "dtype": str(dtype).removeprefix("torch."),
        "bucket": bucket,
        "n_slots": n_slots,
        "max_ctx": max_ctx,
        "num_layers": config.num_layers,
        "sampled_rows": logits.shape[0],  # min(bucket, n_slots): sampling is sized by the bucket
        "kernels_per_layer": layer_counts.pop(),
        "kernels_per_step": sum(step_total.values()),
        "kernels_outside_layers": sum(around.values()),
        "by_kind": dict(sorted(per_layer[-1].items())),
        "outside_layers_by_kind": dict(sorted(around.items())),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--bucket", type=int, default=1, help="rows in the step (1: a 1-slot decode step)")
    ap.add_argument("--n-slots", type=int, default=1)
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--json", type=Path, help="write the product path's counts here")
    args = ap.parse_args(argv)
    kw = dict(
        bucket=args.bucket, n_slots=args.n_slots, max_ctx=args.max_ctx, dtype=getattr(torch, args.dtype)
    )
    fused = count_step(args.model, attention="triton", **kw)
    layered = count_step(args.model, attention="triton", step_kernels="layered", **kw)
    unfused = count_step(args.model, attention="triton", fused=False, **kw)
    plain = count_step(args.model, attention="torch", **kw)
    keep = ("kernels_per_layer", "kernels_per_step", "by_kind")
    fused["layered_path"] = {k: layered[k] for k in keep}  # --step-kernels layered: cuBLAS + pointwise
    fused["unfused_path"] = {k: unfused[k] for k in keep}  # Triton attention, torch pointwise ops
    fused["torch_path"] = {k: plain[k] for k in keep}  # the reference attention too
    print(f"{args.model}, bucket {args.bucket}, {args.n_slots} slot(s), max_ctx {args.max_ctx}, {args.dtype}")
    rows = (
        (f"{fused['step_kernels']} (product)", fused),
        ("layered", layered),
        ("unfused pointwise", unfused),
        ("torch reference", plain),
    )
    for label, r in rows:
        print(f"  {label:18s} {r['kernels_per_layer']:3d} kernels/layer, {r['kernels_per_step']:5d} per step")
    print("  per layer, product path:")
    for kind, n in fused["by_kind"].items():
        print(f"    {n:3d}  {kind}")
    if args.json:
        save_json(fused, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
