"""Per-slot KV cache, preallocated once for the lifetime of the engine."""

from __future__ import annotations

import torch

from ringleader.device.model.config import ModelConfig


class KVCache:
    """k and v are each one tensor [num_layers, n_slots, max_ctx, num_kv_heads, head_dim].

    Row (slot, pos) holds the rotated key / the value of the token at position `pos` of the
    request occupying `slot`. A slot is reused by simply overwriting from position 0.
    Zero-initialised: masked-out positions must hold finite values, since attention weights
    of 0 times a NaN left by torch.empty would still be NaN.
    """

    def __init__(
        self,
        num_layers: int,
        n_slots: int,
        max_ctx: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.n_slots = n_slots
        self.max_ctx = max_ctx
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, n_slots, max_ctx, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        n_slots: int,
        max_ctx: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVCache:
        return cls(config.num_layers, n_slots, max_ctx, config.num_kv_heads, config.head_dim, dtype, device)

    @staticmethod
    def bytes_needed(config: ModelConfig, n_slots: int, max_ctx: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * n_slots * max_ctx * config.num_kv_heads * config.head_dim * elem

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [n_slots, max_ctx, num_kv_heads, head_dim] of layer i."""
        return self.k[i], self.v[i]
