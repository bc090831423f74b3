"""The model step: its layout, the eager (CPU) and static (CUDA graph) forms, the paged KV cache and the Triton kernels of the step."""
