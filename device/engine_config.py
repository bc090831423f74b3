"""EngineConfig: what shapes the engine (the backend), carried from the CLI to the backends and
the bench.  Each default is written once, here: the field defaults, and the few that differ per
device in EngineConfig.resolved(), which says why.  Each field `ringleader serve` sets declares
its flag and help too (option(), ringleader.ipc.config_options): the command line is generated
from the fields.  Light to import (no torch): the CLI builds its options from it on every
invocation."""

from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass

from ringleader.device.null.null_options import (
    NULL_DEFAULT_VOCAB,
    NULL_MODEL,
    NULL_PATTERNS,
    NULL_STEP_WAITS,
    NullOptions,
)
from ringleader.ipc.config_options import named, option
from ringleader.ipc.limits import MAX_SLOTS

DEVICES = ("auto", "cpu", "cuda")
SCHEDULERS = ("device", "host")
LAUNCHES = ("auto", "pingpong", "resident", "pump")
STEP_SIGNALS = ("auto", "in-step", "node")
# the CUDA step's kernels for buckets of up to FUSED_MAX_ROWS rows (device/step/fused_step.py)
STEP_KERNELS = ("fused", "layered")
POLICIES = ("fifo", "priority", "static")
# speculative decoding: off, or prompt-lookup (n-gram) drafts proposed and verified by the
# scheduler (device/sched/sched_spec.h)
SPECULATIVE = ("off", "ngram")
DTYPES = ("float32", "bfloat16", "float16")
# how the weight matrices are stored: auto keeps a GGUF file's quantization (else the device's dtype)
WEIGHTS = ("auto", "fp32", "bf16", "quantized")
# the CPU's defaults where the field's is None (resolved()): the host has no free-memory probe
CPU_MAX_CTX = 2048
CPU_KV_CACHE_BYTES = 512 << 20


# The fields with option() are `ringleader serve`'s options, in the order --help lists them.
# fmt: off
@dataclass(frozen=True)
class EngineConfig:
    model: str = option(
        "tiny", flag="--model",
        help="a preset (tiny, llama-1b, llama-8b: random weights; null: no weights, no arithmetic, "
        "the runtime's own cost, see --null-*), a GGUF file (*.gguf: F32, F16, BF16, Q8_0, Q4_0, "
        "Q4_1, Q5_x, Q2_K..Q6_K) or a local Hugging Face checkpoint directory (default: %(default)s)")
    device: str = option(
        "auto", flag="--device", choices=DEVICES, help="auto: cuda when torch sees a GPU, else cpu")
    weights: str = option(
        "auto", flag="--weights", choices=WEIGHTS,
        help="how the weight matrices are stored and multiplied: quantized keeps a GGUF file's "
        "Q4_0/Q4_1/Q4_K/Q5_x/Q8_0 matrices as they are (int4 kernels; Q2_K/Q3_K/Q6_K widened), "
        "fp32 and bf16 widen them; auto: quantized for a .gguf file, else fp32 on cpu and bf16 "
        "on cuda (on cuda, fp32 and bf16 also set the compute dtype)")
    # weights and KV cache (None: per device, resolved()); a torch dtype is accepted
    dtype: str | None = None
    scheduler: str | None = option(  # None: per device, resolved()
        None, flag="--scheduler", choices=SCHEDULERS,
        help="CUDA: where sched_step runs (default device); the CPU backend is host-only")
    launch: str = option(
        "auto", flag="--launch", choices=LAUNCHES,
        help="CUDA launch mode of the device scheduler: pingpong (two WHILE graphs taking turns, "
        "the next step's parked while one computes), resident (one WHILE graph), pump (a host "
        "thread relaunching an unrolled graph), or auto (pingpong, else resident, else pump; the "
        "mode that runs is in the log and in stats); pingpong and resident fail start-up if they "
        "cannot run")
    step_signal: str = option(
        "auto", flag="--step-signal", choices=STEP_SIGNALS,
        help="CUDA device scheduler: where a step hands the turn back: in-step (the last node of "
        "each step's own graph, started ahead by a programmatic edge on sm_90+ and waiting there "
        "for the step's end), node (a node of the launch graph after the step), or auto (in-step, "
        "else node; the one that runs is in stats)")
    policy: str = option(
        "fifo", flag="--policy", choices=POLICIES,
        help="admission: fifo, priority with aging (which also decides who gives up its KV pages "
        "first when they run out), or static batching (a baseline)")
    n_slots: int = option(
        128, flag="--slots", type=int,
        help="batch slots (max concurrent sequences; a slot holds KV pages only for its tokens)")
    max_ctx: int | None = option(  # None: per device, resolved()
        None, flag="--max-ctx", type=int,
        help=f"the longest context of one request, prompt and output (default: {CPU_MAX_CTX} on "
        "cpu; on cuda the model's limit, cut to what the KV pages hold)")
    # bytes (an int, or text such as 512MiB, 2GB) or a fraction; None: per device, resolved()
    kv_cache_memory: int | float | str | None = option(
        None, flag="--kv-cache-memory", metavar="BYTES|FRACTION",
        help="memory for the KV page pool: bytes (512MiB, 2GB, 1073741824), or on cuda a fraction "
        "(0, 1] of the memory free after the weights and the step's workspace (default: "
        f"{CPU_KV_CACHE_BYTES >> 20}MiB on cpu; on cuda what --gpu-memory-fraction leaves)")
    page_size: int = option(
        16, flag="--page-size", type=int, help="token positions per KV page (a power of two)")
    prefix_caching: bool = option(
        True, flag="--prefix-caching", type=bool,
        help="keep the KV of full prompt pages after a request ends, so later requests whose "
        "prompts start with the same tokens (a system prompt, a conversation resent) skip their "
        "prefill (default: on)")
    structured_memory_mib: int = option(
        64, flag="--structured-memory-mib", type=int, metavar="MIB",
        help="memory for structured output's compiled constraints (JSON schemas, regexes, choices), "
        "device memory on cuda: the largest one a request may bring, and the room kept to reuse "
        "those sent again (default: %(default)s)")
    gpu_memory_fraction: float = option(
        0.9, flag="--gpu-memory-fraction", type=float,
        help="CUDA: share of device memory for weights, KV cache and workspace")
    token_budget: int = option(  # raised to n_slots if below
        256, flag="--token-budget", type=int, help="max token rows per step")
    prompt_logprobs_rows: int | None = option(
        None, flag="--prompt-logprobs-rows", type=int, metavar="N",
        help="the most prompt rows one step scores for requests with prompt_logprobs (echo with "
        "logprobs); a longer prompt is scored over several steps; 0: such requests are refused "
        "(default: the token budget on cpu; 16 on cuda, whose step graphs compute that many more "
        "lm_head rows each step)")
    speculative: str | None = option(  # None: per device, resolved()
        None, flag="--speculative", choices=SPECULATIVE,
        help="speculative decoding: ngram drafts each decoding request's next tokens by finding "
        "its last tokens earlier in its prompt or output (prompt lookup), and the step verifies "
        "them (greedy and seeded output unchanged; fewer steps per token where text repeats); "
        "off: one token per request per step (default: ngram on cpu, where it measured faster; "
        "off on cuda until a GPU run measures it)")
    num_speculative_tokens: int = option(
        4, flag="--num-speculative-tokens", type=int, metavar="K",
        help="the most draft tokens a request verifies per step, 1-8 (each an extra row); a "
        "request's own draft length adapts to what it accepts (default: %(default)s)")
    speculative_max_batch: int = option(
        8, flag="--speculative-max-batch", type=int, metavar="N",
        help="no request drafts while more than N requests decode, where verification rows "
        "cost more than they save (default: %(default)s)")
    aging_steps: int = option(
        64, flag="--aging-steps", type=int,
        help="priority policy: a waiting request gains one level per this many steps")
    seed: int = option(0, flag="--seed", type=int, help="seed of the preset's random weights")
    threads: int | None = option(  # the CPU backend's; None: adaptive (cpu_threads.py)
        None, flag="--threads", type=int,
        help="CPU backend: the step's threads, fixed (default: adaptive, one per core this "
        "process may use that other processes leave free)")
    trace_path: str | None = option(
        None, flag="--trace",
        help="CUDA: write the device timeline as Chrome-trace JSON to this file at shutdown")
    sq_size: int = 1024  # submission ring entries
    pending_cap: int = 1024  # requests the scheduler holds beyond the slots
    attention: str = "triton"  # CUDA step attention kernel
    step_kernels: str = option(
        "fused", flag="--step-kernels", choices=STEP_KERNELS,
        help="CUDA: the decode step's kernels for buckets of up to 32 rows: fused (five Triton "
        "kernels a layer, norms, RoPE, SiLU and residual adds inside the projections, greedy rows "
        "sampled in the lm_head, programmatic dependent launch on sm_90+) or layered (cuBLAS "
        "projections and a kernel per pointwise op; larger buckets always) (default: %(default)s)")
    stop_grace_s: float = 2.0  # CUDA: the scheduler kernel's grace to finish a stop
    run_budget_s: float | None = option(
        None, flag="--run-budget-s", type=float,
        help="CUDA: the scheduler kernel exits on its own after this many seconds, and the server "
        "reports engine_dead (default: no limit; for timed runs that must never leave a kernel "
        "behind)")
    chat_template: str | None = option(
        None, flag="--chat-template", metavar="FILE",
        help="a Jinja chat template (as tokenizer_config.json's chat_template is written) that "
        "replaces the model's own, for a model whose template is missing or wrong; the template "
        "text itself is taken too when it is no file and holds {{ or {%% (default: the model's "
        "template)")
    # --model null (device/null/null_options.py); None: the null model's default, refused with
    # any other model
    null_vocab: int | None = option(
        None, flag="--null-vocab", type=int, metavar="N",
        help=f"--model null: its vocabulary size (default {NULL_DEFAULT_VOCAB}; ids below 256 are "
        "bytes)")
    null_step_us: float | None = option(
        None, flag="--null-step-us", type=float, metavar="US",
        help="--model null: a fixed busy time per step, in microseconds, standing in for a "
        "model's (default 0: the step costs nothing)")
    null_pattern: str | None = option(
        None, flag="--null-pattern", choices=NULL_PATTERNS,
        help="--model null: its tokens: next (the input token + 1, never EOS; default), repeat "
        "(the input token again), eos (end at once)")
    null_step_wait: str | None = option(
        None, flag="--null-step-wait", choices=NULL_STEP_WAITS,
        help="--model null on the CPU: how the step's busy time is spent: spin (holds a core, as a "
        "CPU model's arithmetic; default) or sleep (gives the core back, as a host waiting on a "
        "GPU's step); CUDA's step always spins on the GPU")
    # fmt: on

    def __post_init__(self) -> None:
        if self.dtype is not None and not isinstance(self.dtype, str):  # torch.float32 -> "float32"
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        for name, allowed in (
            ("device", DEVICES),
            ("scheduler", SCHEDULERS),
            ("launch", LAUNCHES),
            ("step_signal", STEP_SIGNALS),
            ("step_kernels", STEP_KERNELS),
            ("policy", POLICIES),
            ("dtype", DTYPES),
            ("weights", WEIGHTS),
            ("speculative", SPECULATIVE),
        ):
            value = getattr(self, name)
            if value is not None and value not in allowed:  # argparse refuses these by flag already
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        for name, low, high in _INT_BOUNDS:
            value = getattr(self, name)
            if value is None and name in ("max_ctx", "threads", "prompt_logprobs_rows"):  # None: per device
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not low <= value <= high:
                limits = f"in [{low}, {high}]" if high < _NO_LIMIT else f">= {low}"
                raise ValueError(f"{named(EngineConfig, name)} must be an integer {limits}, got {value!r}")
        if self.weights == "quantized" and not self._names_gguf:
            raise ValueError(
                f"--weights quantized keeps a GGUF file's quantization; {self.model} is not a "
                ".gguf file (use --weights auto, fp32 or bf16)"
            )
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction!r}")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_memory_size(self.kv_cache_memory))
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"{named(EngineConfig, 'page_size')} must be a power of two, got {self.page_size}")
        if self.run_budget_s is not None and not self.run_budget_s > 0:
            raise ValueError(
                f"{named(EngineConfig, 'run_budget_s')} must be a positive number of seconds, "
                f"got {self.run_budget_s!r}"
            )
        self.null_options()  # refuses a bad null-model option, or one without --model null
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", os.fspath(self.chat_template))  # a Path is accepted
            from ringleader.device.text.chat_template import (
                load_template_override,  # jinja2 only when asked for
            )

            # compiled here, so a bad template fails in one line before any weights load
            load_template_override(self.chat_template)

    @classmethod
    def of(cls, config: EngineConfig | str | None = None, /, **fields) -> EngineConfig:
        """Keyword construction, as backends and open_backend() take it: a config or a model
        spec (or neither), with fields given by name on top."""
        if isinstance(config, EngineConfig):
            return dataclasses.replace(config, **fields) if fields else config
        if config is not None:
            fields["model"] = config
        return cls(**fields)

    def resolved(self, device: str | None = None) -> EngineConfig:
        """This config on `device` (default: self.device; auto: what torch sees), with the
        defaults that differ per device filled in.  The one place they are written."""
        kind = resolve_device(device or self.device)
        if kind == "cpu":
            if self.scheduler not in (None, "host"):
                raise ValueError("the cpu backend schedules on a host thread; --scheduler device needs CUDA")
            if self.trace_path:
                raise ValueError("--trace records the CUDA device timeline; the cpu backend has none")
            if self.dtype not in (None, "float32"):
                raise ValueError(f"the cpu backend computes in float32, got dtype {self.dtype!r}")
            if isinstance(self.kv_cache_memory, float):
                raise ValueError(
                    f"--kv-cache-memory {self.kv_cache_memory}: a fraction is of free device memory, "
                    "CUDA only; give the cpu backend bytes (e.g. 512MiB)"
                )
            return dataclasses.replace(
                self,
                device="cpu",
                scheduler="host",  # the CPU build only: no device to run a persistent kernel on
                # no free-memory probe on the host (CUDA has one): a fixed longest context
                max_ctx=self.max_ctx or CPU_MAX_CTX,
                # a few hundred MB, not n_slots full contexts: pages follow the tokens, and a
                # pool this size holds ~11k tokens of SmolLM2-135M (5 contexts of 2048) in fp32
                kv_cache_memory=self.kv_cache_memory or CPU_KV_CACHE_BYTES,
                dtype="float32",  # the only dtype the CPU backend computes in
                # measured faster on the CPU's workloads, greedy and sampled, 1 and 8 streams
                # (bench/results/2026-11-29-cpu-speculative)
                speculative=self.speculative or "ngram",
                weights=self._auto_weights("float32") if self.weights == "auto" else self.weights,
            )
        # --weights fp32 / bf16 name the dtype on CUDA (weights and activations alike)
        implied = {"fp32": "float32", "bf16": "bfloat16"}.get(self.weights)
        if implied and self.dtype not in (None, implied):
            raise ValueError(
                f"--weights {self.weights} computes in {implied} on cuda, but dtype is {self.dtype}"
            )
        dtype = (
            self.dtype or implied or "bfloat16"
        )  # bf16: half the memory of float32 for weights and KV cache
        return dataclasses.replace(
            self,
            device="cuda",
            scheduler=self.scheduler or "device",  # the persistent scheduler kernel is the product
            # max_ctx None stays: the model's own limit, cut to what the page pool holds; and
            # kv_cache_memory None: the pool takes what --gpu-memory-fraction leaves
            dtype=dtype,
            weights=self._auto_weights(dtype) if self.weights == "auto" else self.weights,
            speculative=self.speculative or "off",  # no GPU run has measured it yet
        )

    @property
    def is_null_model(self) -> bool:
        return self.model == NULL_MODEL

    def null_options(self) -> NullOptions:
        """The null model's options (its defaults for the fields left None); ValueError naming
        the flag on a bad one, or on one given with another model."""
        given = {
            flag: value
            for flag, value in (
                ("--null-vocab", self.null_vocab),
                ("--null-step-us", self.null_step_us),
                ("--null-pattern", self.null_pattern),
                ("--null-step-wait", self.null_step_wait),
            )
            if value is not None
        }
        if given and not self.is_null_model:
            raise ValueError(f"{', '.join(given)} goes with --model null, not --model {self.model}")
        defaults = NullOptions()
        return NullOptions(
            vocab_size=defaults.vocab_size if self.null_vocab is None else self.null_vocab,
            step_us=defaults.step_us if self.null_step_us is None else self.null_step_us,
            pattern=defaults.pattern if self.null_pattern is None else self.null_pattern,
            step_wait=defaults.step_wait if self.null_step_wait is None else self.null_step_wait,
        )

    @property
    def _names_gguf(self) -> bool:
        """--model names a GGUF file (by suffix, as gguf_checkpoint.is_gguf, which imports torch)."""
        return str(self.model).lower().endswith(".gguf")

    def _auto_weights(self, dtype: str) -> str:
        """--weights auto: a GGUF file keeps its quantization (int4 kernels, ~4x less memory than
        fp32), anything else is dense in the compute dtype."""
        return "quantized" if self._names_gguf else ("fp32" if dtype == "float32" else "bf16")

    def model_weights(self) -> str:
        """LlamaModel's weight form (llama.WEIGHT_FORMS) for this resolved config."""
        if self.weights == "quantized":
            return "quantized"
        if self.weights == "bf16" and self.dtype == "float32":
            return "bfloat16"  # the CPU: matrices in bf16 beside fp32 activations
        return "dense"


_NO_LIMIT = 1 << 62
# (field, lowest, highest): the integer fields' ranges, checked once here so a bad value is
# refused by name (and by its serve flag, where it has one) before any weights load
_INT_BOUNDS = (
    ("n_slots", 1, MAX_SLOTS),
    ("max_ctx", 2, _NO_LIMIT),  # one prompt token and one generated
    ("page_size", 1, _NO_LIMIT),
    ("token_budget", 1, _NO_LIMIT),
    ("aging_steps", 1, _NO_LIMIT),
    ("prompt_logprobs_rows", 0, _NO_LIMIT),
    ("num_speculative_tokens", 1, 8),
    ("speculative_max_batch", 0, _NO_LIMIT),
    ("threads", 1, _NO_LIMIT),
    ("sq_size", 1, _NO_LIMIT),  # no flag: set by programs that embed the engine
    ("pending_cap", 1, _NO_LIMIT),
    ("structured_memory_mib", 1, 4095),  # the grammar array's words are u32 offsets
)

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip


def parse_memory_size(value: int | float | str) -> int | float:
    """--kv-cache-memory: bytes as an int or text with a unit (512MiB, 2G and 2GiB binary, 2GB
    decimal), or a fraction in (0, 1] written with a point (0.5); returns int bytes or the float."""
    text = str(value).strip().lower().replace("_", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number) :]
    try:
        if unit not in _UNITS:
            raise ValueError
        if "." in number and not unit:
            fraction = float(number)
            if not 0.0 < fraction <= 1.0:
                raise ValueError
            return fraction
        size = float(number) * _UNITS[unit]
        if size < 1 or ("." in number and not unit):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"--kv-cache-memory must be bytes (1073741824, 512MiB, 2GB) or a fraction of free "
            f"device memory in (0, 1] such as 0.5, got {value!r}"
        ) from None
    return int(size)


def resolve_device(device: str) -> str:
    """auto -> cuda when torch sees a GPU, else cpu; cpu and cuda as they are."""
    if device not in DEVICES:
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device != "auto":
        return device
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:
        return "cpu"


def cuda_unavailable_reason() -> str | None:
    """Why --device cuda cannot run here, with what to do instead; None when torch sees a GPU."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is a CPU-only build"
    else:
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU on this machine"
    return f"--device cuda needs a CUDA GPU that torch can see: {why}; serve on the CPU with --device cpu"
