"""The model's weights: checkpoints (HF, GGUF), their quantized forms and the matmul kernels that read them."""
