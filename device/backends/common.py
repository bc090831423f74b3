"""What the CPU and CUDA backends share: step timing for stats and metrics, the ring
configuration an EngineConfig asks for, and the ModelInfo the frontend reads."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable

import numpy as np

from ringleader.device.backends.kv_pool import KvPool
from ringleader.device.engine_config import POLICIES as POLICY_NAMES
from ringleader.device.engine_config import EngineConfig
from ringleader.device.model import LlamaModel
from ringleader.device.model.presets import tokenizer_for
from ringleader.device.null.null_model import NullModel
from ringleader.device.text.chat_template import load_template_override
from ringleader.device.text.token_bytes import token_bytes
from ringleader.device.text.tokenizer import IncrementalDetokenizer
from ringleader.ipc import layout
from ringleader.ipc.backend import ModelInfo
from ringleader.ipc.histogram import Histogram, HistogramSnapshot
from ringleader.ipc.rings import RingConfig

log = logging.getLogger("ringleader.chat")

POLICIES = {name: layout.Policy[name.upper()] for name in POLICY_NAMES}


def percentile(values, q: float) -> float | None:
    return float(np.percentile(np.fromiter(values, dtype=np.float64), q)) if len(values) else None


class RecentValues:
    """The last `size` values in a preallocated array: appending allocates nothing, so the
    memory held is the same from the first step on (a deque of floats grew for 4096 steps)."""

    def __init__(self, size: int = 4096):
        self._buf = np.zeros(size, dtype=np.float64)
        self._n = 0  # values appended so far

    def append(self, value: float) -> None:
        self._buf[self._n % len(self._buf)] = value
        self._n += 1

    def __len__(self) -> int:
        return min(self._n, len(self._buf))

    def __iter__(self):
        return iter(self._buf[: len(self)].copy())


# seconds: a scheduler phase or a bubble is microseconds on a GPU, tens of them on a CPU
STEP_SECONDS_BUCKETS = (
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
    1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
)  # fmt: skip
TOKENS_PER_STEP_BUCKETS = tuple(1 << i for i in range(15))  # 1 .. 16384 rows


class StepHistograms:
    """Histograms of the steps for the metrics exporter (Backend.step_histograms), every one
    written and snapshotted under `lock`: the engine thread observes a built step in a bisect
    and a few adds (observe_step); the CUDA device scheduler's are fed from its timeline at
    scrape time (device_timeline.TimelineFeed) instead."""

    def __init__(self):
        self.lock = threading.Lock()
        self.critical = Histogram(STEP_SECONDS_BUCKETS)
        self.overlapped = Histogram(STEP_SECONDS_BUCKETS)
        self.bubble = Histogram(STEP_SECONDS_BUCKETS)
        self.tokens = Histogram(TOKENS_PER_STEP_BUCKETS)

    def observe_step(self, critical_s: float, overlapped_s: float, tokens: int) -> None:
        with self.lock:
            self.critical.observe(critical_s)
            self.overlapped.observe(overlapped_s)
            self.tokens.observe(tokens)

    def snapshot(self, *, bubble: bool, tokens: bool) -> dict[str, HistogramSnapshot]:
        """What Backend.step_histograms returns; `bubble`/`tokens`: whether this backend measures
        those (a series it cannot measure is left out, not reported as zero)."""
        with self.lock:
            out = {
                "sched_critical_s": self.critical.snapshot(),
                "sched_overlapped_s": self.overlapped.snapshot(),
            }
            if bubble:
                out["bubble_s"] = self.bubble.snapshot()
            if tokens:
                out["tokens_per_step"] = self.tokens.snapshot()
            return out


class StepTimer:
    """Recent durations, for stats (the last 4096 of each): the scheduler's critical phase (what
    the model step waits for), its overlapped phase, both (sched_step), and the model step; and
    the histograms of the steps that were built, for the metrics exporter."""

    def __init__(self):
        self.critical_us = RecentValues(4096)
        self.overlapped_us = RecentValues(4096)
        self.sched_us = RecentValues(4096)
        self.model_us = RecentValues(4096)
        self.histograms = StepHistograms()

    def add_sched(self, critical_us: float, overlapped_us: float, step_tokens: int = 0) -> None:
        """One pass of the scheduler; step_tokens: the rows of the step it built (0: none, and
        then the pass is not a step: the histograms count steps, as steps_total does)."""
        self.critical_us.append(critical_us)
        self.overlapped_us.append(overlapped_us)
        self.sched_us.append(critical_us + overlapped_us)
        if step_tokens:
            self.histograms.observe_step(critical_us * 1e-6, overlapped_us * 1e-6, step_tokens)

    def summary(self) -> dict:
        out = {}
        for name, values in (
            ("sched_critical_us", self.critical_us),
            ("sched_overlapped_us", self.overlapped_us),
            ("sched_step_us", self.sched_us),
            ("model_step_us", self.model_us),
        ):
            out[name + "_p50"], out[name + "_p99"] = percentile(values, 50), percentile(values, 99)
        return out


def ring_config_for(
    model: LlamaModel | NullModel,
    config: EngineConfig,
    max_ctx: int,
    pool: KvPool,
    score_rows: int | None = None,
) -> RingConfig:
    """The rings for `config` at `max_ctx` (the context the backend settled on: the model's
    limit or the device's memory may cut the configured one), over the KV pages of `pool`;
    score_rows: the most prompt rows a step scores (None: the token budget)."""
    if config.policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {config.policy!r}")
    n_slots, pending_cap = config.n_slots, config.pending_cap
    arena = 1 << max(20, (4 * max_ctx - 1).bit_length())  # room for several full contexts
    spec_tokens = config.num_speculative_tokens if config.speculative == "ngram" else 0
    cq = 1 << ((2 + spec_tokens) * n_slots + pending_cap + 4 * n_slots).bit_length()
    return RingConfig(
        n_slots=n_slots,
        max_ctx=max_ctx,
        token_budget=max(config.token_budget, n_slots),
        sq_size=config.sq_size,
        cq_size=max(cq, 8192),
        arena_size=arena,
        pending_cap=pending_cap,
        policy=POLICIES[config.policy],
        aging_steps=config.aging_steps,
        eos_ids=tuple(model.config.eos_token_ids[: layout.MAX_EOS_IDS]),
        page_size=pool.page_size,
        n_pages=pool.n_pages,
        prefix_caching=config.prefix_caching,
        vocab_size=model.config.vocab_size,
        grammar_words=config.structured_memory_mib << 18,  # MiB of int32 words
        score_rows=None if score_rows is None else min(score_rows, max(config.token_budget, n_slots)),
        spec_tokens=spec_tokens,
        spec_max_batch=config.speculative_max_batch,
    )


def token_texts(tokenizer) -> Callable[[int], str]:
    """One token's text, as its id decodes alone (special tokens spelled out, a partial UTF-8
    sequence as U+FFFD, as vLLM shows both), remembered per id: logprobs name a few tokens of a
    vocabulary again and again."""
    return functools.lru_cache(maxsize=1 << 16)(
        lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
    )


def load_model(cfg: EngineConfig, dtype, device: str) -> LlamaModel | NullModel:
    """The model a resolved config names, on `device`: the null model, or a Llama-family one
    (a preset, a GGUF file, a checkpoint) with its weights kept as --weights says."""
    if cfg.is_null_model:
        return NullModel(cfg.null_options(), device)
    return LlamaModel.from_spec(cfg.model, dtype, device, cfg.seed, cfg.model_weights())


def describe_weights(form: str, description: dict) -> str:
    """The start-up line's weights: "quantized, 73.2 MiB (matrices: 120 Q4_1, 1 Q8_0, 1 float32)",
    or "none" for a model without any (the null model)."""
    if not description["matrices"]:
        return "none"
    kinds = ", ".join(
        f"{n} {kind}" for kind, n in sorted(description["matrices"].items(), key=lambda kv: -kv[1])
    )
    return f"{form}, {description['weight_mib']} MiB (matrices: {kinds})"


def model_info(spec: str, model: LlamaModel | NullModel, max_ctx: int) -> ModelInfo:
    """What the frontend reads of the model `spec` names.  Its name is the model's short one
    (ModelConfig.name: a preset's name, a GGUF file's stem, a checkpoint directory's name), not
    the path, as vllm and llama-server name a model."""
    tokenizer = tokenizer_for(spec)
    return ModelInfo(
        name=model.config.name,
        vocab_size=model.config.vocab_size,
        max_context=max_ctx,
        eos_token_ids=tuple(model.config.eos_token_ids),
        tokenizer=tokenizer,
        new_detokenizer=(lambda **options: IncrementalDetokenizer(tokenizer, **options))
        if tokenizer
        else None,
        token_text=token_texts(tokenizer) if tokenizer else None,
        encode_chat=tokenizer.encode_chat if getattr(tokenizer, "chat_template", None) else None,
        token_bytes=functools.cache(lambda: token_bytes(tokenizer)) if tokenizer else None,
    )


def with_chat_template(info: ModelInfo, override: str | None) -> ModelInfo:
    """`info` with the chat template `serve --chat-template` gives (EngineConfig.chat_template,
    load_template_override) in place of the model's own; `info` itself when there is none.  It
    renders with the model's BOS and EOS text and its generation prompt, as the model's own does."""
    if override is None:
        return info
    tokenizer = info.tokenizer
    if tokenizer is None:
        log.warning("--chat-template not used: %s has no tokenizer, so it serves token ids only", info.name)
        return info
    tokenizer.chat_template = load_template_override(override)  # tokenizer_for made it for `info` alone
    return dataclasses.replace(info, encode_chat=tokenizer.encode_chat)
