"""Release stores and acquire loads on shared ring indices, callable from Python.

numpy stores carry no ordering on weakly ordered CPUs (Arm edge boxes), so publishing an index
goes through these few instructions of C++ instead.
"""

from __future__ import annotations

import ctypes

from ringleader.ipc.native import load_library

_SOURCE = r"""
#include <stdint.h>
extern "C" {
uint32_t rl_load_acquire_u32(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void rl_store_release_u32(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
uint64_t rl_load_acquire_u64(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
}
"""

_lib = None


def _library():
    global _lib
    if _lib is None:
        lib = load_library("rlatomics", _SOURCE, hold_gil=True)
        lib.rl_load_acquire_u32.argtypes = [ctypes.c_void_p]
        lib.rl_load_acquire_u32.restype = ctypes.c_uint32
        lib.rl_store_release_u32.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        lib.rl_store_release_u32.restype = None
        lib.rl_load_acquire_u64.argtypes = [ctypes.c_void_p]
        lib.rl_load_acquire_u64.restype = ctypes.c_uint64
        _lib = lib
    return _lib


class AtomicU32:
    """One 32-bit shared word at a fixed address."""

    __slots__ = ("_addr", "_load", "_store")

    def __init__(self, address: int):
        lib = _library()
        self._addr = address
        self._load = lib.rl_load_acquire_u32
        self._store = lib.rl_store_release_u32

    def load_acquire(self) -> int:
        return self._load(self._addr)

    def store_release(self, value: int) -> None:
        self._store(self._addr, value & 0xFFFFFFFF)
