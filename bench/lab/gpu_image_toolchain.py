"""The GPU machines' compilers, fetched once into this environment, so CI compiles with them too.

The GPU image ships torch 2.11+cu130, whose NVRTC is 13.0.88 (its driver is CUDA 13.0, R580),
and Triton 3.6.0. What this environment installs is newer (`cuda-toolkit[nvrtc]==13.*` resolves
to the newest 13.x; `triton>=3.4` to the newest Triton, whose interpreter the CPU tests use), and
older compilers reject what newer ones accept: NVRTC before 13.4 refused `__builtin_offsetof` in
a static_assert (GPU-REVIEW-2 §1a), and two Triton releases give the same kernel different
register counts. So CI also compiles
- the scheduler kernel with the image's libnvrtc, chosen by $RINGLEADER_NVRTC
  (device/sched/build.py; tests/test_nvrtc.py), and
- every Triton kernel of the step with the image's Triton, put first on PYTHONPATH of a child
  process (bench/lab/triton_aot.py; tests/test_triton_aot.py).

Each comes from its PyPI wheel, without dependencies, kept in a cache under this Python
environment (`share/ringleader/gpu-image/`); a folder is complete once its marker file exists.

    python -m ringleader.bench.lab.gpu_image_toolchain       # prints where each is, fetching it first
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NVRTC = "13.0.88"  # nvidia-cuda-nvrtc, as torch 2.11+cu130 pins it
TRITON = "3.6.0"
LIBNVRTC = "libnvrtc.so.13"
_COMPLETE = ".complete"


def cache_dir(what: str, version: str) -> Path:
    return Path(sys.prefix) / "share" / "ringleader" / "gpu-image" / what / version


def _cached(folder: Path) -> Path | None:
    return folder if (folder / _COMPLETE).is_file() else None


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--no-deps", "--only-binary=:all:"], check=True)


def _fetch_into(folder: Path, fill) -> Path:
    """fill(tmp) writes the folder's content into tmp; then tmp becomes `folder` at once."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    tmp.chmod(0o755)
    try:
        fill(tmp)
        (tmp / _COMPLETE).write_text("")
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# ---- NVRTC ---------------------------------------------------------------------------------------
def cached_nvrtc(version: str = NVRTC) -> Path | None:
    """The release's libnvrtc when it is in the cache, else None."""
    folder = _cached(cache_dir("nvrtc", version))
    return folder / LIBNVRTC if folder else None


def fetch_nvrtc(version: str = NVRTC) -> Path:
    """Downloads nvidia-cuda-nvrtc==version and keeps libnvrtc and its builtins; returns libnvrtc."""

    def fill(tmp: Path) -> None:
        with tempfile.TemporaryDirectory() as wheels:
            _pip("download", "-d", wheels, f"nvidia-cuda-nvrtc=={version}")
            (wheel,) = Path(wheels).glob("*.whl")
            with zipfile.ZipFile(wheel) as zf:
                libs = [n for n in zf.namelist() if "/lib/libnvrtc" in n and ".alt." not in n]
                if not any(Path(n).name == LIBNVRTC for n in libs):
                    raise RuntimeError(f"nvidia-cuda-nvrtc=={version}: no {LIBNVRTC} in {wheel.name}")
                for name in libs:
                    with zf.open(name) as src, open(tmp / Path(name).name, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)

    return _fetch_into(cache_dir("nvrtc", version), fill) / LIBNVRTC


def nvrtc_library(version: str = NVRTC) -> Path:
    return cached_nvrtc(version) or fetch_nvrtc(version)


# ---- Triton --------------------------------------------------------------------------------------
def cached_triton(version: str = TRITON) -> Path | None:
    """A folder holding only that Triton, for the front of PYTHONPATH, when cached; else None."""
    return _cached(cache_dir("triton", version))


def fetch_triton(version: str = TRITON) -> Path:
    return _fetch_into(
        cache_dir("triton", version), lambda tmp: _pip("install", "--target", str(tmp), f"triton=={version}")
    )


def triton_site(version: str = TRITON) -> Path:
    return cached_triton(version) or fetch_triton(version)


if __name__ == "__main__":
    print(f"NVRTC {NVRTC}: {nvrtc_library()}")
    print(f"Triton {TRITON}: {triton_site()} (put it first on PYTHONPATH)")
