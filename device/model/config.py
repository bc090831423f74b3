"""Shape and hyper-parameters of a Llama-family decoder (Llama, Qwen2, Mistral)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # None, or llama3-style scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}.
    rope_scaling: dict | None = None
    # None, or one divisor per rotary frequency [head_dim/2] (how GGUF files store Llama-3's scaling)
    rope_freq_factors: list[float] | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama with attention_bias)
    attention_out_bias: bool = False  # bias on o_proj (only Llama with attention_bias=True)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} entries, want head_dim/2 = {self.head_dim // 2}"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str | None = None) -> ModelConfig:
        """Build from a Hugging Face config.json dict (Llama, Qwen2 or Mistral).

        Mistral's `sliding_window` (and Qwen2's `use_sliding_window`) is ignored: attention is
        always full, which is exact as long as contexts stay within the window (Mistral-7B
        v0.2+ ships `sliding_window: null` anyway).
        """
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; want one of {SUPPORTED_MODEL_TYPES}")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // heads
        # transformers >= 5 stores theta/scaling in "rope_parameters"; older files use
        # "rope_theta" + "rope_scaling".
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None
        if rope_type == "llama3":
            rope_scaling = {
                "factor": float(rope["factor"]),
                "low_freq_factor": float(rope["low_freq_factor"]),
                "high_freq_factor": float(rope["high_freq_factor"]),
                "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            }
        elif rope_type != "default":
            raise ValueError(f"unsupported rope type {rope_type!r} (only default and llama3)")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=o_bias,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name or cfg.get("_name_or_path") or model_type,
        )

    @classmethod
    def from_json_file(cls, path: str | Path, name: str | None = None) -> ModelConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_hf(json.load(f), name=name)
