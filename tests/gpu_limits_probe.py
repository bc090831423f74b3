"""What the gpu_limits tests share: the probe's modules (bench/lab/gpu_limits/), its kernel count,
and whether this machine has a CUDA driver."""

from __future__ import annotations

import ctypes
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
N_KERNELS = 15


def load(name: str):
    """A module of the package: "__main__" (the CLI), "common", "kernels", ..."""
    return importlib.import_module(f"ringleader.bench.lab.gpu_limits.{name}")


def cuda_driver():
    return importlib.import_module("ringleader.device.backends.cuda_driver")


def libcuda_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False
