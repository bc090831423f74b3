"""Build C++ source text into a shared library with the host compiler, cached by content hash.

Used for the ring atomics here and for the CPU build of the scheduler in device/.  The cache key
is the source text plus the flags, so an edit to the source (or to ipc/layout.py, whose header is
part of the text) rebuilds on the next load and never loads a stale library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

DEFAULT_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-Wall", "-Wextra", "-Wno-unused-parameter")


class NativeBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("RINGLEADER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ringleader"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def find_compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise NativeBuildError("no C++ compiler found (set CXX or install g++)")


def build_library(name: str, source: str, flags: tuple[str, ...] = DEFAULT_FLAGS) -> Path:
    """Compile `source` into lib<name>-<hash>.so in the cache unless that file already exists."""
    cxx = find_compiler()
    key = hashlib.sha256((cxx + "\0" + " ".join(flags) + "\0" + source).encode()).hexdigest()[:16]
    out = cache_dir() / f"lib{name}-{key}.so"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        src = Path(tmp) / f"{name}.cpp"
        src.write_text(source)
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run([cxx, *flags, str(src), "-o", str(tmp_out)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise NativeBuildError(f"{cxx} failed building {name}:\n{proc.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders never see a half-written file
    return out


def load_library(name: str, source: str, *, hold_gil: bool = False) -> ctypes.CDLL:
    """hold_gil=True (PyDLL) for calls of a few instructions, where dropping the GIL costs more."""
    path = build_library(name, source)
    return (ctypes.PyDLL if hold_gil else ctypes.CDLL)(str(path))
