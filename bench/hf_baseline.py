"""The `hf` variant: transformers' own continuous batching on the same model, in this process.

Written against transformers 5.x's ContinuousBatchingManager (the engine behind
`model.generate_batch`); run on the CPU (the tiny preset in the tests, SmolLM2-135M GGUF in
bench/results/2026-11-23-cpu-smollm2/), UNVERIFIED on a GPU. The benchmark offers it on both.

The model, in the dtype the server computes in on that device (float32 on the CPU):
- a preset: transformers' LlamaForCausalLM is built from the preset's config and the weights
  are copied from `ringleader.device.model.LlamaModel.from_preset(...)` (same name, seed, dtype and device
  as the server uses, hence the same random weights; fused qkv and gate_up are split back into
  HF's projections);
- a .gguf file: `from_pretrained(dir, gguf_file=name)`, transformers' own GGUF loader, which
  dequantizes the file as ringleader's loader does (needs the `gguf` package);
- a checkpoint directory: from_pretrained.

The load: `generate_batch` submits everything at once and returns at the end, which fits neither
a closed nor an open loop, so this drives the same manager through `add_request` /
`get_result` with the workload's lengths and the run's concurrency or arrival times. Per-token
times come from the manager's `record_timestamps` (time.perf_counter, the clock the load
generator uses), one token per "message"; `done` is when the result was taken from the queue.
Server CPU is this whole process's CPU (the "server" is in-process), so loadgen_cpu_s is not
separable and reported as None.
"""

from __future__ import annotations

import time
from pathlib import Path

from ringleader.bench.loadgen import Load, RunResult, SendOptions
from ringleader.bench.metrics import RequestRecord
from ringleader.bench.workloads import RequestSpec
from ringleader.hostctl.serving.metrics import process_rss_bytes

DTYPES = {"cpu": "float32", "cuda": "bfloat16"}


def hf_config_for(config):
    """transformers LlamaConfig equivalent to a ringleader ModelConfig."""
    from transformers import LlamaConfig

    if config.rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, **config.rope_scaling}
    else:
        rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        rope_parameters=rope,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_ids[0] if config.eos_token_ids else None,
    )


def internal_to_hf(state: dict, config) -> dict:
    """LlamaModel state dict -> HF LlamaForCausalLM names (the inverse of checkpoint.hf_to_internal)."""
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = state[src + "attn_norm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "mlp_norm.weight"]
        for suffix in ("weight", "bias"):
            if src + f"qkv.{suffix}" in state:
                q, k, v = state[src + f"qkv.{suffix}"].split([q_dim, kv_dim, kv_dim], 0)
                for name, t in (("q", q), ("k", k), ("v", v)):
                    out[dst + f"self_attn.{name}_proj.{suffix}"] = t
            if src + f"o.{suffix}" in state:
                out[dst + f"self_attn.o_proj.{suffix}"] = state[src + f"o.{suffix}"]
        gate, up = state[src + "gate_up.weight"].chunk(2, 0)
        out[dst + "mlp.gate_proj.weight"] = gate
        out[dst + "mlp.up_proj.weight"] = up
        out[dst + "mlp.down_proj.weight"] = state[src + "down.weight"]
    out["lm_head.weight"] = state["lm_head.weight"] if "lm_head.weight" in state else state["embed.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def build_hf_model(spec: str, device: str, seed: int = 0, dtype: str | None = None):
    """(hf_model, ours): the HF model on `device`, and ringleader's model it was copied from (presets);
    in `dtype`, by default the one the server computes in on that device."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from ringleader.device.model import LlamaModel
    from ringleader.device.model.presets import PRESETS
    from ringleader.device.weights.gguf_checkpoint import is_gguf

    dtype = getattr(torch, dtype or DTYPES.get(device, "float32"))
    if spec not in PRESETS:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its weight-loading bar (the GGUF dequantizing bar is plain tqdm)
        path = Path(spec)
        if is_gguf(spec):
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
        return model.to(device).eval(), None
    ours = LlamaModel.from_preset(spec, dtype, device, seed)
    model = LlamaForCausalLM(hf_config_for(ours.config)).to(dtype=dtype, device=device).eval()
    missing, unexpected = model.load_state_dict(internal_to_hf(ours.state_dict(), ours.config), strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise RuntimeError(
            f"weight copy into transformers failed: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    return model, ours


def logits_gap(hf_model, ours, prompt_ids: list[int]) -> float:
    """Max |difference| of the last position's logits, HF vs ringleader (a weight-copy check)."""
    import torch

    a = ours.prompt_logits(prompt_ids).float()
    with torch.inference_mode():
        b = hf_model(torch.tensor([prompt_ids], device=hf_model.device)).logits[0, -1].float()
    return float((a - b.to(a.device)).abs().max())


def _cpu_s() -> float:
    """This process's CPU (os.times user + system), in nanoseconds rather than 10-ms ticks."""
    return time.process_time()


def cache_blocks(cb, kv_tokens: int) -> int:
    """Blocks of transformers' paged cache that hold kv_tokens: its tokens per block are
    `page_size` in newer releases and `block_size` up to 5.17 (seen on the GPU image)."""
    block_tokens = getattr(cb, "page_size", None) or getattr(cb, "block_size", None)
    if not block_tokens:
        raise ValueError(f"{type(cb).__name__} names no tokens per block (page_size or block_size)")
    return -(-kv_tokens // block_tokens)


class HfRunner:
    """Drives one ContinuousBatchingManager through runs shaped like the server runs."""

    def __init__(
        self,
        model,
        *,
        slots: int | None,
        token_budget: int | None,
        options: SendOptions,
        kv_tokens: int | None = None,
        timeout_s: float = 600.0,
    ):
        from transformers import GenerationConfig

        self.model, self.options, self.timeout_s = model, options, timeout_s
        o = options
        self._eos = model.config.eos_token_id
        gen = GenerationConfig(
            do_sample=o.temperature > 0,
            temperature=o.temperature or None,
            max_new_tokens=256,
            eos_token_id=-1 if o.ignore_eos else self._eos,
        )
        cb = None
        try:
            from transformers import ContinuousBatchingConfig

            cb = ContinuousBatchingConfig(max_requests_per_batch=slots, max_batch_tokens=token_budget)
            if kv_tokens:  # the cache's capacity in tokens (else sized from free memory)
                cb.num_blocks = cache_blocks(cb, kv_tokens)
        except (ImportError, TypeError):
            pass
        kwargs = {"generation_config": gen}
        if cb is not None:
            kwargs["continuous_batching_config"] = cb
        self.manager = model.init_continuous_batching(**kwargs)
        if getattr(model.device, "type", "cpu") == "cuda" and hasattr(self.manager, "warmup"):
            self.manager.warmup()
        self.manager.start()
        self._tokens = 0

    def close(self) -> None:
        self.manager.stop(block=True, timeout=30)

    def stats(self) -> dict:
        return {
            "process_cpu_s": _cpu_s(),
            "process_rss_bytes": process_rss_bytes(),
            "output_tokens": self._tokens,
            "backend": {
                "device": str(self.model.device.type),
                "scheduler": "transformers-cb",
                "dtype": str(self.model.dtype).replace("torch.", ""),
            },
        }

    def measure(
        self, specs: list[RequestSpec], load: Load, warmup: list[RequestSpec] | None = None
    ) -> RunResult:
        warmup_failed = 0
        if warmup:
            recs = self.run(
                warmup, Load(concurrency=max(1, min(len(warmup), load.concurrency or len(warmup))))
            )
            warmup_failed = sum(1 for r in recs if not r.ok)
        before = self.stats()
        t0 = time.perf_counter()
        records = self.run(specs, load)
        wall = time.perf_counter() - t0
        return RunResult(
            records, before, self.stats(), loadgen_cpu_s=None, wall_s=wall, warmup_failed=warmup_failed
        )

    def run(self, specs: list[RequestSpec], load: Load) -> list[RequestRecord]:
        mgr, o = self.manager, self.options
        records = [RequestRecord(i, len(s.prompt_ids), s.max_tokens) for i, s in enumerate(specs)]
        by_id: dict[str, RequestRecord] = {}
        stamp = f"b{time.monotonic_ns()}-"
        sent = 0
        start = time.perf_counter()
        deadline = start + self.timeout_s

        def send(i: int) -> None:
            rec, spec = records[i], specs[i]
            rec.send_t = time.perf_counter()
            rid = mgr.add_request(
                spec.prompt_ids,
                request_id=f"{stamp}{i}",
                max_new_tokens=spec.max_tokens,
                record_timestamps=True,
                eos_token_id=-1 if o.ignore_eos else self._eos,
            )
            if rid is None:
                rec.finish_reason, rec.error_code, rec.done_t = "error", "rejected", time.perf_counter()
            else:
                by_id[rid] = rec

        def due() -> bool:
            if sent >= len(specs):
                return False
            if load.concurrency is not None:
                return len(by_id) < load.concurrency
            return time.perf_counter() >= start + load.arrival_s[sent]

        while (sent < len(specs) or by_id) and time.perf_counter() < deadline:
            while due():
                send(sent)
                sent += 1
            wait = 0.5
            if load.concurrency is None and sent < len(specs):
                wait = max(0.0, min(wait, start + load.arrival_s[sent] - time.perf_counter()))
            result = mgr.get_result(timeout=wait) if by_id else (time.sleep(wait) or None)
            if result is None or not result.is_finished():
                if result is None and by_id and not mgr.is_running():
                    break
                continue
            rec = by_id.pop(result.request_id, None)
            if rec is None:
                continue
            rec.done_t = time.perf_counter()
            tokens = list(result.generated_tokens)
            rec.chunk_t = list(result.timestamps or [])[: len(tokens)]
            rec.chunk_n = [1] * len(rec.chunk_t)
            rec.completion_tokens = len(tokens)
            self._tokens += len(tokens)
            if result.error:
                rec.finish_reason, rec.error_code, rec.error_message = "error", "hf_error", str(result.error)
            else:
                rec.finish_reason = "length" if len(tokens) >= rec.max_tokens else "stop"
        for rid, rec in by_id.items():
            mgr.cancel_request(rid)
            rec.finish_reason, rec.error_code = "error", "timeout"
        return records
