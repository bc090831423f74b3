"""The paged KV cache: one pool of fixed-size pages, preallocated once for the engine's lifetime."""

from __future__ import annotations

import math

import numpy as np
import torch

from ringleader.device.model.config import ModelConfig


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """Zeroed storage. On the CPU it comes from calloc (numpy), whose fresh pages the OS maps
    only when first written: resident memory follows the tokens cached, not the pool's size
    (torch.zeros would write every byte at start)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVCache:
    """k and v are each one tensor [num_layers, n_pages, page_size, num_kv_heads, head_dim].

    A request's positions live in pages named by its slot's row of a block table (int32
    [n_slots, pages_per_slot], written by the scheduler): position p of slot s is at
    (block_table[s, p // page_size], p % page_size). Entries past a slot's context are
    arbitrary, so readers use only the entries of positions that exist (or clamp them).
    `for_slots` builds a cache with a fixed table, `slot_table`, for callers without a scheduler.
    Zero-initialised: masked-out positions must hold finite values, since attention weights
    of 0 times a NaN left by torch.empty would still be NaN.
    """

    def __init__(
        self,
        num_layers: int,
        n_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, n_pages, page_size, num_kv_heads, head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self.slot_table: torch.Tensor | None = None  # set by for_slots

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        n_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVCache:
        return cls(config.num_layers, n_pages, page_size, config.num_kv_heads, config.head_dim, dtype, device)

    @classmethod
    def for_slots(
        cls,
        config: ModelConfig,
        n_slots: int,
        max_ctx: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVCache:
        """n_slots * ceil(max_ctx / page_size) pages, slot s owning pages [s * M, (s + 1) * M):
        `slot_table` is that block table, int32 [n_slots, M]."""
        pages_per_slot = -(-max_ctx // page_size)
        kv = cls.for_model(config, n_slots * pages_per_slot, page_size, dtype, device)
        pages = torch.arange(n_slots * pages_per_slot, dtype=torch.int32, device=device)
        kv.slot_table = pages.view(n_slots, pages_per_slot)
        return kv

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes one cached position takes: k and v of every layer."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * elem

    @property
    def n_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

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
        """Views [n_pages, page_size, num_kv_heads, head_dim] of layer i."""
        return self.k[i], self.v[i]
