"""The host-side text layer: tokenizers (byte-level, HF, GGUF) and chat templates."""
