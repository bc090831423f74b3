"""The KV page pool's size: how many pages the memory given to the KV cache holds, and what
that means for requests (both backends plan with it; the CUDA backend first works out the
memory from the device's free memory, cuda_preflight.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvPool:
    """n_pages pages of page_size token positions of every layer's K and V."""

    n_pages: int
    page_size: int
    bytes_per_token: int  # K and V of every layer
    max_ctx: int  # the longest context of one request

    @property
    def nbytes(self) -> int:
        return self.n_pages * self.page_size * self.bytes_per_token

    @property
    def pages_per_request(self) -> int:
        """Pages one request of max_ctx holds (a slot's block-table entries)."""
        return -(-self.max_ctx // self.page_size)

    @property
    def full_requests(self) -> int:
        """How many requests of max_ctx tokens fit at once (shorter ones: more)."""
        return self.n_pages // self.pages_per_request

    def describe(self) -> str:
        return (
            f"KV cache: {self.n_pages} pages of {self.page_size} tokens "
            f"({self.nbytes / 2**20:.1f} MiB, {self.n_pages * self.page_size} tokens); "
            f"{self.full_requests} requests of max_ctx {self.max_ctx} fit at once, more when shorter"
        )

    def as_description(self) -> dict:
        """The fields a backend's description (and so `serve`'s start-up line and stats) shows."""
        return {
            "kv_pages": self.n_pages,
            "page_size": self.page_size,
            "kv_cache_mib": round(self.nbytes / 2**20, 1),
            "max_ctx_requests_fit": self.full_requests,
        }


def plan_pool(*, pool_bytes: int, bytes_per_token: int, page_size: int, max_ctx: int, n_slots: int) -> KvPool:
    """The pages `pool_bytes` holds, capped at what n_slots requests of max_ctx could ever use.
    Raises MemoryError, saying what would fit, when not even one request of max_ctx does (it
    could never finish)."""
    per_request = -(-max_ctx // page_size)
    if bytes_per_token == 0:  # a model without a KV cache (the null model): pages are ids only
        return KvPool(n_slots * per_request, page_size, 0, max_ctx)
    n_pages = min(pool_bytes // (page_size * bytes_per_token), n_slots * per_request)
    if n_pages < per_request:
        fits = n_pages * page_size
        shorter = f" or lower --max-ctx to {fits} or less" if fits >= 2 else ""
        raise MemoryError(
            f"the KV cache of {_size(pool_bytes)} holds {n_pages} pages of {page_size} "
            f"tokens ({bytes_per_token / 1024:.1f} KiB per token), and one request of --max-ctx "
            f"{max_ctx} needs {per_request}: raise --kv-cache-memory to at least "
            f"{_size(per_request * page_size * bytes_per_token)}{shorter}"
        )
    return KvPool(n_pages, page_size, bytes_per_token, max_ctx)


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes >= 2**20 else f"{n_bytes / 1024:.1f} KiB"
