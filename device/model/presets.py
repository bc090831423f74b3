"""Model presets: real Llama-3 shapes (and a tiny one) with seeded random weights and the
byte-level tokenizer, so the runtime can be exercised and benchmarked without downloads."""

from __future__ import annotations

from pathlib import Path

from ringleader.device.model.config import ModelConfig
from ringleader.device.null.null_options import NULL_MODEL
from ringleader.device.text.tokenizer import ByteTokenizer, load_tokenizer
from ringleader.device.weights.gguf_checkpoint import gguf_metadata, is_gguf

_BYTE = ByteTokenizer

PRESETS: dict[str, ModelConfig] = {
    # Answers in seconds on a 2-core CPU.
    "tiny": ModelConfig(
        vocab_size=_BYTE.vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=_BYTE.BOS,
        eos_token_ids=[_BYTE.EOS],
        name="tiny",
    ),
    # Shapes of meta-llama/Llama-3.2-1B.
    "llama-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling={
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        bos_token_id=_BYTE.BOS,
        eos_token_ids=[_BYTE.EOS],
        name="llama-1b",
    ),
    # Shapes of meta-llama/Llama-3.1-8B.
    "llama-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        bos_token_id=_BYTE.BOS,
        eos_token_ids=[_BYTE.EOS],
        name="llama-8b",
    ),
}

# Random-init scales. Linear weights get std = 1/sqrt(fan_in) (~0.02 at hidden 2048-4096) so
# attention and MLP outputs are O(1) and the prompt matters; the embedding/lm_head std is set
# so that logits after the final RMSNorm have std ~LOGIT_STD, i.e. greedy picks are not flat.
LOGIT_STD = 4.0


def preset_config(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; have {sorted(PRESETS)}") from None


def tokenizer_for(spec: str | Path):
    """Tokenizer for a model spec as the server gets it: a ByteTokenizer for a preset name and
    the null model; the file's own for a .gguf file; for a checkpoint directory an HFTokenizer
    when it has tokenizer.json, else None (the server then serves token ids only)."""
    if isinstance(spec, str) and (spec in PRESETS or spec == NULL_MODEL):
        return load_tokenizer(None)
    if is_gguf(spec):
        from ringleader.device.text.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(gguf_metadata(spec))
    return load_tokenizer(spec)
