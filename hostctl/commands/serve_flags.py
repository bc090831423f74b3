"""The flags of `ringleader serve` that set a config field: which flag sets which field of
EngineConfig (device/engine_config.py) or ServerConfig (hostctl/serving/config.py), with its
argparse options and help.  Each default comes from the field (written once, in its config);
None there means "per device", which the config's resolved() fills in and the help says.  The
serve command adds these options; the bench writes them for the servers it starts (serve_flags)."""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

from ringleader.device.engine_config import (
    CPU_KV_CACHE_BYTES,
    DEVICES,
    LAUNCHES,
    POLICIES,
    SCHEDULERS,
    WEIGHTS,
    EngineConfig,
)
from ringleader.device.null.null_options import NULL_DEFAULT_VOCAB, NULL_PATTERNS
from ringleader.hostctl.serving.config import ServerConfig


class Flag(NamedTuple):
    flag: str  # the option on the command line; it lands on args under the field's name
    options: dict[str, Any]  # argparse options besides the default (the field's)
    help: str


ENGINE_FLAGS: dict[str, Flag] = {
    "model": Flag(
        "--model",
        {},
        "a preset (tiny, llama-1b, llama-8b: random weights; null: no weights, no arithmetic, the "
        "runtime's own cost, see --null-*), a GGUF file (*.gguf: F32, F16, BF16, "
        "Q8_0, Q4_0, Q4_1, Q5_x, Q2_K..Q6_K) or a local Hugging Face checkpoint directory "
        "(default: %(default)s)",
    ),
    "device": Flag("--device", {"choices": DEVICES}, "auto: cuda when torch sees a GPU, else cpu"),
    "weights": Flag(
        "--weights",
        {"choices": WEIGHTS},
        "how the weight matrices are stored and multiplied: quantized keeps a GGUF file's "
        "Q4_0/Q4_1/Q4_K/Q5_x/Q8_0 matrices as they are (int4 kernels; Q2_K/Q3_K/Q6_K widened), "
        "fp32 and bf16 widen them; auto: quantized for a .gguf file, else fp32 on cpu and bf16 "
        "on cuda (on cuda, fp32 and bf16 also set the compute dtype)",
    ),
    "scheduler": Flag(
        "--scheduler",
        {"choices": SCHEDULERS},
        "CUDA: where sched_step runs (default device); the CPU backend is host-only",
    ),
    "launch": Flag(
        "--launch",
        {"choices": LAUNCHES},
        "CUDA launch mode of the device scheduler: resident (one WHILE graph; "
        "fails start-up if it cannot run), pump, or auto (resident, else pump; the "
        "mode that runs is in the log and in stats)",
    ),
    "policy": Flag(
        "--policy",
        {"choices": POLICIES},
        "admission: fifo, priority with aging (which also decides who gives up its KV pages "
        "first when they run out), or static batching (a baseline)",
    ),
    "n_slots": Flag(
        "--slots",
        {"type": int},
        "batch slots (max concurrent sequences; a slot holds KV pages only for its tokens)",
    ),
    "max_ctx": Flag(
        "--max-ctx",
        {"type": int},
        "the longest context of one request, prompt and output (default: %s on cpu; on cuda "
        "the model's limit, cut to what the KV pages hold)" % EngineConfig().resolved("cpu").max_ctx,
    ),
    "kv_cache_memory": Flag(
        "--kv-cache-memory",
        {"metavar": "BYTES|FRACTION"},
        "memory for the KV page pool: bytes (512MiB, 2GB, 1073741824), or on cuda a fraction "
        "(0, 1] of the memory free after the weights and the step's workspace (default: %s on "
        "cpu; on cuda what --gpu-memory-fraction leaves)" % "%dMiB" % (CPU_KV_CACHE_BYTES >> 20),
    ),
    "page_size": Flag("--page-size", {"type": int}, "token positions per KV page (a power of two)"),
    "prefix_caching": Flag(
        "--prefix-caching",
        {"action": argparse.BooleanOptionalAction},
        "keep the KV of full prompt pages after a request ends, so later requests whose prompts "
        "start with the same tokens (a system prompt, a conversation resent) skip their prefill "
        "(default: on)",
    ),
    "gpu_memory_fraction": Flag(
        "--gpu-memory-fraction",
        {"type": float},
        "CUDA: share of device memory for weights, KV cache and workspace",
    ),
    "token_budget": Flag("--token-budget", {"type": int}, "max token rows per step"),
    "aging_steps": Flag(
        "--aging-steps",
        {"type": int},
        "priority policy: a waiting request gains one level per this many steps",
    ),
    "seed": Flag("--seed", {"type": int}, "seed of the preset's random weights"),
    "threads": Flag(
        "--threads", {"type": int}, "torch CPU threads (default: torch's, one per core it may use)"
    ),
    "trace_path": Flag(
        "--trace",
        {},
        "CUDA: write the device timeline as Chrome-trace JSON to this file at shutdown",
    ),
    "run_budget_s": Flag(
        "--run-budget-s",
        {"type": float},
        "CUDA: the scheduler kernel exits on its own after this many seconds, and the server "
        "reports engine_dead (default: no limit; for timed runs that must never leave a kernel behind)",
    ),
    "chat_template": Flag(
        "--chat-template",
        {"metavar": "FILE"},
        "a Jinja chat template (as tokenizer_config.json's chat_template is written) that replaces "
        "the model's own, for a model whose template is missing or wrong; the template text itself "
        "is taken too when it is no file and holds {{ or {%% (default: the model's template)",
    ),
    "null_vocab": Flag(
        "--null-vocab",
        {"type": int, "metavar": "N"},
        "--model null: its vocabulary size (default %d; ids below 256 are bytes)" % NULL_DEFAULT_VOCAB,
    ),
    "null_step_us": Flag(
        "--null-step-us",
        {"type": float, "metavar": "US"},
        "--model null: a fixed busy time per step, in microseconds, standing in for a model's "
        "(default 0: the step costs nothing)",
    ),
    "null_pattern": Flag(
        "--null-pattern",
        {"choices": NULL_PATTERNS},
        "--model null: its tokens: next (the input token + 1, never EOS; default), repeat (the "
        "input token again), eos (end at once)",
    ),
}

_CPU, _CUDA = ServerConfig().resolved("cpu"), ServerConfig().resolved("cuda")

# ServerConfig's max_queued_tokens, max_tokens_cap and max_frame_bytes have no flag: a program
# that embeds the server sets them
SERVER_FLAGS: dict[str, Flag] = {
    "max_queued": Flag(
        "--max-queue",
        {"type": int},
        "requests held on the host when the rings are full; beyond: overloaded",
    ),
    "max_inflight_per_client": Flag(
        "--max-inflight-per-client",
        {"type": int},
        "requests one client may have in flight; beyond: overloaded (0: no cap)",
    ),
    "max_queue_ms": Flag(
        "--max-queue-ms",
        {"type": float},
        "a request without its first token this long after arrival ends with error code timeout (0: no limit)",
    ),
    "default_max_tokens": Flag(
        "--default-max-tokens",
        {"type": int, "metavar": "N"},
        "a request without max_tokens (an OpenAI chat request without it, too) generates up "
        "to the rest of the model's context, at most N tokens (default: no cap)",
    ),
    "watchdog_s": Flag(
        "--watchdog-s",
        {"type": float},
        "heartbeat stall that declares the engine dead "
        f"(default {_CUDA.watchdog_s:g} on cuda, {_CPU.watchdog_s:g} on cpu)",
    ),
    "drain_timeout_s": Flag(
        "--drain-timeout",
        {"type": float},
        "on SIGINT/SIGTERM, seconds to let in-flight requests finish (the whole "
        "stop takes at most this + 5 s)",
    ),
}


def _add_options(p: argparse.ArgumentParser, flags: dict[str, Flag], defaults: object) -> None:
    for name, (flag, options, help) in flags.items():
        if "choices" not in options and "action" not in options:
            options = {"metavar": flag[2:].upper().replace("-", "_"), **options}
        p.add_argument(flag, dest=name, default=getattr(defaults, name), help=help, **options)


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The EngineConfig fields `serve` takes, on args under their field names."""
    _add_options(p, ENGINE_FLAGS, EngineConfig())


def add_server_options(p: argparse.ArgumentParser) -> None:
    """The ServerConfig fields `serve` takes, on args under their field names."""
    _add_options(p, SERVER_FLAGS, ServerConfig())


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in ENGINE_FLAGS})


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**{name: getattr(args, name) for name in SERVER_FLAGS})


def serve_flags(**fields: object) -> list[str]:
    """`ringleader serve` flags for EngineConfig and ServerConfig fields given by name (None: the
    server's default)."""
    out: list[str] = []
    for name, value in fields.items():
        flag = (ENGINE_FLAGS.get(name) or SERVER_FLAGS[name]).flag
        if isinstance(value, bool):  # a --x/--no-x switch
            out.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            out += [flag, str(value)]
    return out
