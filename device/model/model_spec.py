"""What `--model` may name, checked before anything loads: a preset, a GGUF file, or a Hugging
Face checkpoint directory.  Reads at most four bytes of a file, so `serve` can refuse a wrong
path in a second with a line that says what it found and what it takes."""

from __future__ import annotations

from pathlib import Path

from ringleader.device.model.presets import PRESETS
from ringleader.device.null.null_options import NULL_MODEL
from ringleader.device.weights.gguf_checkpoint import is_gguf

GGUF_MAGIC = b"GGUF"


def what_model_takes() -> str:
    return (
        f"--model takes a preset ({', '.join(PRESETS)}), null (no weights), a .gguf file, or a Hugging Face "
        "checkpoint directory (with config.json)"
    )


def check_model_spec(spec: str) -> None:
    """ValueError naming what is wrong with `spec`, unless it can name a model."""
    if spec in PRESETS or spec == NULL_MODEL:
        return
    path = Path(spec).expanduser()
    if not path.exists():
        kind = "GGUF file" if is_gguf(spec) else "preset, file or directory"
        raise ValueError(f"no {kind} named {spec!r}; {what_model_takes()}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{spec} is a directory without config.json, not a checkpoint; {what_model_takes()}"
            )
        return
    try:
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ValueError(f"cannot read {spec}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ValueError(f"{spec} is not a GGUF file (it does not begin with 'GGUF'); {what_model_takes()}")
    if not is_gguf(spec):
        raise ValueError(f"{spec} is a GGUF file without the .gguf suffix: name it *.gguf to serve it")
