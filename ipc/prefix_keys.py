"""The prefix cache's page keys, on the host: the same function as rl_page_key in the scheduler
(device/sched/sched_prefix.h), which keys the pages of generated tokens; tests prove them equal.

A full page's key chains its parent's key and its own tokens, so equal keys mean equal prefixes:

    content_j = SipHash-1-3 under the secret (k0, k1) of page j's page_size int32 tokens,
                packed two per 64-bit word, low token first (a zero word pads an odd page)
    key_j     = mix64(key_{j-1} ^ content_j), key_{-1} = 0     (mix64: splitmix64's finalizer)

The secret is drawn per process (RingConfig.prefix_seed), so no client can craft two prefixes
with one key and be served the other's KV.  The host computes a request's keys once, when it
writes the prompt (ringleader.ipc.rings.HostRings.write_prompt): a property of the request, not a
batch decision; matching, reference counts and eviction stay on the device.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_SIP_INIT = (0x736F6D6570736575, 0x646F72616E646F6D, 0x6C7967656E657261, 0x7465646279746573)


def _rotl(x: np.ndarray, b: int) -> np.ndarray:
    return (x << np.uint64(b)) | (x >> np.uint64(64 - b))


def _sip_round(v0, v1, v2, v3):
    v0 = v0 + v1
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 = v2 + v3
    v3 = _rotl(v3, 16) ^ v2
    v0 = v0 + v3
    v3 = _rotl(v3, 21) ^ v0
    v2 = v2 + v1
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


def content_hashes(pages: np.ndarray, k0: int, k1: int) -> np.ndarray:
    """SipHash-1-3 of each row of `pages` (int32 [n, page_size]), all rows at once."""
    n, page_size = pages.shape
    u = pages.astype(np.int64).astype(np.uint64) & np.uint64(0xFFFFFFFF)
    if page_size % 2:
        u = np.concatenate([u, np.zeros((n, 1), np.uint64)], axis=1)
    words = u[:, 0::2] | (u[:, 1::2] << np.uint64(32))
    v0, v1, v2, v3 = (
        np.full(n, np.uint64((k ^ init) & _MASK)) for k, init in zip((k0, k1, k0, k1), _SIP_INIT)
    )
    for i in range(words.shape[1]):
        m = words[:, i]
        v3 = v3 ^ m
        v0, v1, v2, v3 = _sip_round(v0, v1, v2, v3)
        v0 = v0 ^ m
    last = np.uint64(((4 * page_size) & 0xFF) << 56)  # the message length in bytes, as SipHash ends
    v3 = v3 ^ last
    v0, v1, v2, v3 = _sip_round(v0, v1, v2, v3)
    v0 = v0 ^ last
    v2 = v2 ^ np.uint64(0xFF)
    for _ in range(3):
        v0, v1, v2, v3 = _sip_round(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


def mix64(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def page_keys(tokens: np.ndarray, page_size: int, k0: int, k1: int) -> np.ndarray:
    """The keys (uint64) of every full page of `tokens`: len(tokens) // page_size of them."""
    n = len(tokens) // page_size
    if n == 0:
        return np.zeros(0, np.uint64)
    contents = content_hashes(np.asarray(tokens[: n * page_size], np.int32).reshape(n, page_size), k0, k1)
    keys = np.empty(n, np.uint64)
    key = 0
    for j, content in enumerate(contents.tolist()):
        key = mix64(key ^ content)
        keys[j] = key
    return keys
