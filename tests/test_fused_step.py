"""The fused decode step (device/step/fused_step.py) against the layered step, on the CPU.

Both steps are StaticStep: `step_kernels="layered"` (cuBLAS-style projections and a kernel per
pointwise op; on the CPU torch's matmuls and the Triton pointwise kernels) and "fused" (five
kernels a layer for buckets up to 32 rows). They run under the Triton interpreter in a child
process over the same hand-built layouts: prefill chunks larger than 32 rows (the layered path
in both), then a bucket of every row block (1, 16 and 32 rows: decode rows, a chunk beside
them, pad rows), for fp32 and bf16, and int4 weights (two digits, as Q5/Q8 files keep them;
bf16 weights beside fp32 activations are checked kernel by kernel in test_fused_projections). Each step's logits must agree to the dtype's rounding, the KV pages they write too,
and each greedy token wherever the layered logits' top two are further apart than that
tolerance (margin-aware parity: only the summation order differs). The same inputs feed both
steps each time, so a difference never compounds.

On the meta device (no interpreter): the kernel count per layer and the paths each option takes.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from ringleader.device.model import LlamaModel
from ringleader.device.model.presets import preset_config
from ringleader.device.step.static_step import StaticStep
from ringleader.device.step.step_layout import StepLayout
from ringleader.device.step.triton_attention import HAVE_TRITON
from tests.test_static_step import _fill, _shuffled_table
from tests.triton_interpreter import run_interpreted_checks_of

MARKER = "fused step checks passed"
N_SLOTS, PS, CTX, BUDGET = 8, 4, 64, 64
M = CTX // PS
N_PAGES = N_SLOTS * M
# (weights, activations dtype): the logits' tolerance in units of the dtype they are rounded to
# (bf16 weights round every projection, the lm_head's too, to bf16) at the logits' magnitude
CASES = {
    ("dense", torch.float32): (64, torch.float32),
    ("dense", torch.bfloat16): (3, torch.bfloat16),
    ("int4", torch.float32): (64, torch.float32),
}
EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}


def test_fused_step_under_interpreter():
    run_interpreted_checks_of("tests.test_fused_step", MARKER, timeout=900)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("model_name", ["tiny", "llama-1b"])
def test_five_kernels_a_layer_at_every_row_block(model_name):
    from ringleader.bench.lab.step_kernels import count_step

    for bucket in (1, 16, 32):
        fused = count_step(model_name, bucket=bucket, n_slots=32, max_ctx=512)
        assert fused["step_kernels"] == "fused" and fused["kernels_per_layer"] == 5, fused["by_kind"]
        kinds = dict(fused["by_kind"])
        # attention splits its context only where rows x kv heads leave SMs idle: one launch either way
        attention = kinds.pop("triton._ragged_attention_split_kernel", 0) + kinds.pop(
            "triton._ragged_attention_kernel", 0
        )
        assert attention == 1 and kinds == {
            "triton._qkv_rope_store_kernel": 1,
            "triton._add_projection_kernel": 2,
            "triton._gate_up_silu_kernel": 1,
        }, fused["by_kind"]
        # around the layers: the embedding (and its index cast), lm_head + argmax, one sampling
        # kernel, the logprobs kernel
        assert fused["kernels_outside_layers"] <= 6, fused["outside_layers_by_kind"]
        layered = count_step(model_name, bucket=bucket, n_slots=32, max_ctx=512, step_kernels="layered")
        assert layered["step_kernels"] == "layered" and layered["kernels_per_layer"] >= 9
    big = count_step(model_name, bucket=64, n_slots=32, max_ctx=512)
    assert big["step_kernels"] == "layered", "a bucket past 32 rows keeps the layered kernels"


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")
def test_fused_step_on_the_gpu():
    """The compiled kernels (tensor-core dots, the tickets' atomics, PDL where the GPU has it)
    against the layered step on the GPU, in bf16 as the product runs llama."""
    seen = check_parity("dense", torch.bfloat16, 3, torch.bfloat16, device="cuda")
    assert seen["compared_tokens"] == 10, seen


def test_the_options_and_the_fallbacks():
    model = LlamaModel.from_preset("tiny", torch.float32, "meta")
    kv = StaticStep.new_kv_cache(model, N_PAGES, PS)
    with pytest.raises(ValueError, match="step_kernels"):
        StaticStep(model, kv, N_SLOTS, CTX, BUDGET, step_kernels="megakernel")
    layered = StaticStep(model, kv, N_SLOTS, CTX, BUDGET, step_kernels="layered")
    assert layered.fused_decode is None and "layered" in layered.fused_off
    torch_attention = StaticStep(model, kv, N_SLOTS, CTX, BUDGET, attention="torch")
    assert torch_attention.fused_decode is None and "attention" in torch_attention.fused_off
    if not HAVE_TRITON:
        return
    fused = StaticStep(model, kv, N_SLOTS, CTX, BUDGET)
    assert fused.fused_decode is not None and fused.fused_off is None
    # the profile's GB/s: each projection kernel's weight bytes a step (fp32 tiny, 4 layers)
    c, elem = model.config, 4
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size * elem
    assert fused.fused_decode.weight_bytes_by_kernel() == {
        "_qkv_rope_store_kernel": 4 * qkv,
        "_add_projection_kernel": 4 * (c.num_heads * c.head_dim + c.intermediate_size) * c.hidden_size * elem,
        "_gate_up_silu_kernel": 4 * 2 * c.intermediate_size * c.hidden_size * elem,
        "_lm_head_argmax_kernel": c.vocab_size * c.hidden_size * elem,
    }
    # a projection the kernels cannot read (here: no weight at all) keeps the whole step layered
    model.layers[2].down = torch.nn.Identity()
    mixed = StaticStep(model, kv, N_SLOTS, CTX, BUDGET)
    assert mixed.fused_decode is None and "layer 2: down" in mixed.fused_off


# ---- the child ------------------------------------------------------------------------------


def _int4_projections(model: LlamaModel) -> None:
    """Every projection kept as two int4 digits of its own weight (the Triton int4 kernels in
    the layered step, the fused kernels' int4 path in the other)."""
    from ringleader.device.weights.triton_quant_matmul import TritonInt4Weight
    from ringleader.device.weights.weight_kernels import KernelLinear

    def as_int4(linear: torch.nn.Module) -> KernelLinear:
        w = linear.weight.detach().float()
        n, k = w.shape
        groups = w.view(n, k // 32, 32)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 255).clamp(min=1e-8)
        codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 255).to(torch.int32)
        digits = [
            ((codes >> 4).to(torch.uint8).view(n, k), 16 * scale, torch.zeros_like(scale)),
            ((codes & 15).to(torch.uint8).view(n, k), scale, low),
        ]
        int4 = TritonInt4Weight.from_digits(digits, 32, "cpu")
        return KernelLinear.of_kernel(int4.matmul, (n, k), "Q8_0", getattr(linear, "bias", None))

    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, as_int4(getattr(layer, name)))
    model.lm_head = as_int4(model.lm_head)


def _model(weights: str, dtype: torch.dtype, device: str = "cpu") -> LlamaModel:
    """`tiny` with two of its four layers (the interpreter's time goes by layers): seeded weights,
    kept as `weights` says."""
    config = dataclasses.replace(preset_config("tiny"), num_layers=2)
    model = LlamaModel(config, dtype, "meta").to_empty(device=device)
    model._init_random(seed=1)
    model.use_weight_kernels("bfloat16" if weights == "bfloat16" else "dense")
    if weights == "int4":
        _int4_projections(model)
    return model


def check_parity(
    weights: str, dtype: torch.dtype, ulps: float, rounded: torch.dtype, device: str = "cpu"
) -> dict:
    model = _model(weights, dtype, device)
    steps, caches = {}, {}
    for kind in ("layered", "fused"):
        caches[kind] = StaticStep.new_kv_cache(model, N_PAGES, PS)
        steps[kind] = StaticStep(
            model, caches[kind], N_SLOTS, CTX, BUDGET, step_kernels=kind, score_rows=SCORE_ROWS
        )
    assert steps["fused"].fused_decode is not None, steps["fused"].fused_off
    lay = StepLayout.allocate(N_SLOTS, BUDGET, device, M, score_rows=SCORE_ROWS)
    table = _shuffled_table(N_SLOTS, M, N_PAGES, seed=6)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (40,), generator=gen).tolist() for _ in range(N_SLOTS)]
    ctx = [0] * N_SLOTS
    # (bucket, segments as (slot, rows)): a 64-row prefill (the layered kernels in both steps:
    # run once), then one bucket of each fused row block: decode rows beside a chunk in 16 rows,
    # one decode row, decode rows beside a chunk and pad rows in 32
    schedule = [
        (64, [(0, 20), (1, 13), (2, 9), (3, 22), (4, 0)]),
        (16, [(0, 1), (1, 1), (2, 10), (3, 1)]),
        (1, [(0, 1)]),
        (32, [(0, 1), (1, 1), (2, 1), (3, 1), (4, 21)]),
    ]
    seen = {"compared_tokens": 0, "clear_tokens": 0, "scored_rows": 0}
    for bucket, segs in schedule:
        segs = [(slot, n) for slot, n in segs if n]
        segments = []
        for slot, n in segs:
            segments.append((slot, prompts[slot][ctx[slot] : ctx[slot] + n], ctx[slot]))
            ctx[slot] += n
        _fill(lay, segments, table)
        n_score = _score_chunks(lay, segments)
        out = {}
        for kind in ("layered", "fused") if bucket <= 32 else ("layered",):
            lay.next_token.fill_(-7)
            lay.step_prompt_logprobs.fill_(-7)
            logits = steps[kind].run(bucket, lay)[: len(segs)].clone()
            out[kind] = (logits, lay.next_token.clone(), lay.step_prompt_logprobs.clone())
        if "fused" in out:
            (want, want_tokens, want_scores), (got, got_tokens, got_scores) = out["layered"], out["fused"]
            what = f"{weights} {dtype} bucket {bucket}"
            tolerance = ulps * EPS[rounded] * want.abs().max().item()
            err = (got - want).abs().max().item()
            assert err <= tolerance, f"{what}: logits differ by {err:.3g} > {tolerance:.3g}"
            top2 = want.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * tolerance
            slots = torch.tensor([s for s, _ in segs], device=device)
            assert torch.equal(got_tokens[slots][clear], want_tokens[slots][clear]), what
            # prompt logprobs: the fused step scores its rows as the layered one, and no others
            assert bool((got_scores[n_score:] == -7).all()), what
            scored = [t[:n_score, 0].view(torch.float32) for t in (want_scores, got_scores)]
            if n_score:
                assert (scored[1] - scored[0]).abs().max().item() <= 2 * tolerance, what
            seen["scored_rows"] += n_score
            seen["compared_tokens"] += len(segs)
            seen["clear_tokens"] += int(clear.sum())
            for name in ("k", "v"):  # the scheduler's pages (the scratch page is the last)
                a, b = getattr(caches["fused"], name)[:, :-1], getattr(caches["layered"], name)[:, :-1]
                scale = b.float().abs().max().item()
                assert (a.float() - b.float()).abs().max() <= ulps * EPS[rounded] * scale, f"{what}: {name}"
        # the same inputs go on: the next step reads each cache as the layered step left it
        caches["fused"].k.copy_(caches["layered"].k)
        caches["fused"].v.copy_(caches["layered"].v)
    assert seen["clear_tokens"] >= seen["compared_tokens"] // 2 and seen["scored_rows"], seen
    return seen


SCORE_ROWS = 6  # prompt logprobs: the score entries each step takes


def _score_chunks(lay: StepLayout, segments) -> int:
    """Score entries for the rows of the step's multi-row chunks (each scoring the chunk's next
    token, 3 alternatives), at most SCORE_ROWS; returns their count (n_score)."""
    entries, row = [], 0
    for _, ids, _ in segments:
        entries += [(row + j, ids[j + 1]) for j in range(len(ids) - 1)]
        row += len(ids)
    entries = entries[:SCORE_ROWS]
    lay.n_score[0] = len(entries)
    for i, (r, token) in enumerate(entries):
        lay.score_row[i], lay.score_token[i], lay.score_top[i] = r, token, 3
    return len(entries)


def run_interpreted_checks() -> None:
    """Entry point of the child process (TRITON_INTERPRET=1 set before anything imported triton)."""
    from ringleader.device.step import fused_projections as fp
    from tests.test_triton_fused import _interpreter_rounds_bf16_to_nearest
    from tests.test_triton_quant_matmul import _interpreter_dots_bf16

    assert type(fp._add_projection_kernel).__name__ == "InterpretedFunction", "triton imported too early"
    _interpreter_dots_bf16()
    assert _interpreter_rounds_bf16_to_nearest(), "this triton's interpreter has no cast hook"
    t0 = time.perf_counter()
    for (weights, dtype), (ulps, rounded) in CASES.items():
        t1 = time.perf_counter()
        seen = check_parity(weights, dtype, ulps, rounded)
        print(f"{weights} {dtype}: {seen} in {time.perf_counter() - t1:.1f} s")
    print(f"{MARKER} in {time.perf_counter() - t0:.1f} s")
