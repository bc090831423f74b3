"""Loading Llama-family GGUF files (the llama.cpp format) into HF-named tensors.

The file is read with the `gguf` package (the `gguf` extra). Every tensor is dequantized to the
serving dtype at load (device/weights/gguf_quants.py), so the step runs on the same dense weights
as a safetensors checkpoint; or, with keep_quantized (`--weights quantized`), the quantized
matrices stay as their bytes (device/weights/quant_weights.py) for the int4 kernels. Two things differ from HF's layout and are undone here:
- names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`, and so on;
- llama.cpp's converter interleaves the two RoPE halves of every Q and K head (it permutes rows
  so that its rotate-adjacent-pairs kernel computes HF's rotate-half); `_unpermute` restores HF's
  row order, since our step rotates halves as HF does.
Shapes in GGUF list the fastest-varying dimension first; torch's shape is that list reversed.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ringleader.device.model.config import ModelConfig
from ringleader.device.weights.gguf_quants import dequantize
from ringleader.device.weights.load_phase import load_phase
from ringleader.device.weights.quant_weights import DIGIT_FORMS, GGUFMatrix
from ringleader.ipc.install_hint import install_hint

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name (after `blk.N.`) -> HF name (after `model.layers.N.`)
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Not weights: Llama-3's RoPE scaling, stored as per-frequency divisors (read into the config).
_ROPE_FREQS = "rope_freqs.weight"


class GGUFError(ValueError):
    """A GGUF file this loader cannot serve; the message names the file and what is wrong."""


def is_gguf(spec: str | Path) -> bool:
    """A model spec that names a GGUF file (by suffix, so a missing file still gets a clear error)."""
    return str(spec).lower().endswith(".gguf")


def _reader(path: str | Path):
    try:
        import gguf
    except ImportError as e:  # optional dependency
        raise ImportError(f"loading a .gguf model needs the `gguf` package: {install_hint('gguf')}") from e
    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF model file not found: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, struct.error, OSError) as exc:  # gguf's own words are vague
        size = Path(path).stat().st_size
        raise GGUFError(
            f"{path} is not a readable GGUF file ({size} bytes; truncated or corrupt?): "
            f"the gguf reader says: {exc}"
        ) from None


@dataclass
class GGUFFile:
    """One parsed GGUF file: its metadata as plain Python values, and its tensor records."""

    path: Path
    metadata: dict[str, Any]
    tensors: list  # gguf.ReaderTensor

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        reader = _reader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items()}
        return cls(Path(path), metadata, list(reader.tensors))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key} is missing")
        return self.metadata[key]


# The metadata of the last file parsed, keyed by (path, size, mtime): the backend loads the
# weights and then asks for the tokenizer, and parsing a 50k-token vocabulary twice costs
# seconds. Only the metadata is kept: tensor records would keep the whole file mapped.
_last_metadata: tuple[tuple, dict[str, Any]] | None = None


def _file_key(path: str | Path) -> tuple:
    st = os.stat(path)
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def open_gguf(path: str | Path) -> GGUFFile:
    """Parses the file (metadata and tensor records) and remembers its metadata."""
    global _last_metadata
    file = GGUFFile.open(path)
    _last_metadata = (_file_key(path), file.metadata)
    return file


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The file's metadata, parsed once for a load followed by a tokenizer."""
    if _last_metadata is not None and Path(path).is_file() and _last_metadata[0] == _file_key(path):
        return _last_metadata[1]
    return open_gguf(path).metadata


def config_from_gguf(file: GGUFFile, name: str | None = None) -> ModelConfig:
    arch = file.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{file.path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def key(suffix: str, default: Any = None) -> Any:
        value = file.get(f"{arch}.{suffix}", default)
        if value is None:
            raise GGUFError(f"{file.path}: metadata key {arch}.{suffix} is missing")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(file.get(f"{arch}.attention.key_length") or hidden // heads)
    rot_dim = int(file.get(f"{arch}.rope.dimension_count") or head_dim)
    if rot_dim != head_dim:
        raise GGUFError(f"{file.path}: partial RoPE ({rot_dim} of {head_dim} dims) is not supported")
    scaling = file.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"{file.path}: RoPE scaling {scaling!r} is not supported")
    tokens = file.get("tokenizer.ggml.tokens")
    vocab = int(file.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
    if not vocab:
        raise GGUFError(f"{file.path}: no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)")
    eos = [file.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
    names = {t.name for t in file.tensors}
    freq_factors = _rope_freq_factors(file) if _ROPE_FREQS in names else None
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(file.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rope_theta=float(file.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_freq_factors=freq_factors,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(file.get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=file.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        name=name or file.path.stem,  # the served name: SmolLM2-135M-Instruct.Q4_1, not the path
    )


def _rope_freq_factors(file: GGUFFile) -> list[float]:
    tensor = next(t for t in file.tensors if t.name == _ROPE_FREQS)
    return _dequantize(tensor, torch.float32, "cpu").flatten().tolist()


def _torch_shape(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _raw_bytes(tensor) -> torch.Tensor:
    """The tensor's bytes as uint8, copied once: the memory map is read-only, torch wants a
    writable buffer."""
    return torch.from_numpy(np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8).copy())


def _dequantize(tensor, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    qtype = tensor.tensor_type.name
    return dequantize(
        _raw_bytes(tensor),
        qtype,
        _torch_shape(tensor),
        dtype=dtype,
        device=device,
        name=tensor.name,
    )


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row permutation: per head, rows (pair i, half h) go back to
    (half h, pair i)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[rest]}"
    return None


class LoadProgress:
    """Progress of a long load on stderr: a line redrawn in place on a terminal, otherwise a line
    per tenth; silent for loads that finish within `quiet_s`."""

    def __init__(self, label: str, total_bytes: int, quiet_s: float = 1.0, stream=None) -> None:
        self.label, self.total = label, max(1, total_bytes)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.quiet_s, self.start = quiet_s, time.monotonic()
        self.done, self.shown_tenth, self.shown = 0, -1, False

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        elapsed = time.monotonic() - self.start
        if elapsed < self.quiet_s:
            return
        tenth = 10 * self.done // self.total
        if self.tty or tenth > self.shown_tenth:
            self.shown_tenth, self.shown = tenth, True
            line = f"loading {self.label}: {100 * self.done // self.total}% ({self.done >> 20}/{self.total >> 20} MiB, {elapsed:.1f} s)"
            self.stream.write(("\r" + line) if self.tty else line + "\n")
            self.stream.flush()

    def finish(self) -> None:
        if self.shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _kept_quantized(tensor, device: str | torch.device) -> GGUFMatrix:
    """A quantized matrix as its bytes, one row of blocks per output row."""
    n, k = _torch_shape(tensor)
    rows = _raw_bytes(tensor).to(device).view(n, -1)
    return GGUFMatrix(rows, tensor.tensor_type.name, (n, k), tensor.name)


def _keeps(tensor, name: str) -> bool:
    """Kept quantized under keep_quantized: matrices with an int4 digit form (the kernels'), and
    the embedding table of any quantized type (a lookup decodes only the rows it reads)."""
    qtype = tensor.tensor_type.name
    if qtype in ("F32", "F16", "BF16") or len(tensor.shape) != 2:
        return False
    return qtype in DIGIT_FORMS or name == "model.embed_tokens.weight"


def iter_hf_tensors(
    file: GGUFFile,
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    on_bytes: Callable[[int], None] | None = None,
    keep_quantized: bool = False,
) -> Iterator[tuple[str, torch.Tensor | GGUFMatrix]]:
    """(HF name, tensor) for every weight in the file, Q and K rows in HF order: dense in
    `dtype`, or with keep_quantized the matrices _keeps() names as GGUFMatrix (their bytes)."""
    for tensor in file.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        name = _hf_name(tensor.name)
        if name is None:
            raise GGUFError(f"{file.path}: unexpected tensor {tensor.name}")
        t: torch.Tensor | GGUFMatrix
        if keep_quantized and _keeps(tensor, name):
            t = _kept_quantized(tensor, device)
        else:
            t = _dequantize(tensor, dtype, device)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if name.endswith("q_proj.weight") else config.num_kv_heads
            if isinstance(t, GGUFMatrix):  # rows are whole: the permutation moves their bytes
                t = GGUFMatrix(_unpermute(t.raw, heads), t.qtype, t.shape, t.name)
            else:
                t = _unpermute(t, heads)
        if on_bytes is not None:
            on_bytes(int(tensor.n_bytes))
        yield name, t


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    keep_quantized: bool = False,
) -> tuple[ModelConfig, dict[str, torch.Tensor | GGUFMatrix]]:
    """(config, HF-named state dict) of a Llama-family GGUF file on `device`: dequantized to
    `dtype`, or with keep_quantized its quantized matrices as GGUFMatrix (iter_hf_tensors)."""
    with load_phase(f"reading the GGUF metadata of {Path(path).name}"):
        file = open_gguf(path)
        config = config_from_gguf(file)
    total = sum(int(t.n_bytes) for t in file.tensors)
    how = (
        "keeping the quantized matrices"
        if keep_quantized
        else f"dequantizing to {str(dtype).removeprefix('torch.')}"
    )
    progress = LoadProgress(file.path.name, total)
    try:
        with load_phase(f"reading {len(file.tensors)} tensors ({total / (1 << 20):.1f} MiB), {how}"):
            state = dict(iter_hf_tensors(file, config, dtype, device, progress.advance, keep_quantized))
    finally:
        progress.finish()
    return config, state
