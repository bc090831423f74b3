"""ringleader: an LLM serving runtime whose continuous-batching scheduler runs on the GPU.

One namespace over the repository's top-level folders: ringleader.ipc is ipc/ (what both sides
share: the ring contract, the wire protocol, the client library, CURVE), ringleader.hostctl is
hostctl/ (the server, its HTTP gateway, the command line), ringleader.device is device/ (backends,
model, step, sampling, scheduler, tokenizers) and ringleader.bench is bench/ (the load test; its
lab, bench/lab/, is not shipped).  pyproject.toml declares that mapping (package-dir), so a wheel
installs those folders under ringleader/; a checkout gets the same names from the two lines below,
which put the repository root on this package's path when this file sits in a source tree.
"""

from pathlib import Path as _Path

_ROOT = _Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "ipc" / "layout.py").is_file():  # a checkout
    __path__.append(str(_ROOT))
