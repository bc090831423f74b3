"""Loading HF-format checkpoints (config.json + *.safetensors) without the safetensors package.

safetensors layout: 8-byte little-endian u64 header length N, N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the raw
little-endian tensor bytes; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from ringleader.device.model.config import ModelConfig
from ringleader.device.weights.quant_weights import Weight, cat_rows

_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

if sys.byteorder != "little":  # tensors are stored little-endian and read without byte swaps
    raise ImportError("checkpoint loading assumes a little-endian host")


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """Returns (header without __metadata__, byte offset where tensor data starts)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def iter_safetensors(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor in one .safetensors file, each copied out of the
    memory map onto `device` (and cast to `dtype` when given, floating tensors only)."""
    header, data_start = read_safetensors_header(path)
    with open(path, "rb") as f:
        # ACCESS_COPY gives a writable (copy-on-write) map, so torch.frombuffer does not warn
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        for name, info in header.items():
            src_dtype = _DTYPES.get(info["dtype"])
            if src_dtype is None:
                raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            shape = list(info["shape"])
            begin, end = info["data_offsets"]
            count = 1
            for d in shape:
                count *= d
            elem = torch.empty((), dtype=src_dtype).element_size()
            if end - begin != count * elem:
                raise ValueError(f"{path}: tensor {name} byte size does not match its shape")
            want = dtype if (dtype is not None and src_dtype.is_floating_point) else src_dtype
            if count == 0:
                yield name, torch.empty(shape, dtype=want, device=device)
                continue
            raw = torch.frombuffer(mm, dtype=src_dtype, count=count, offset=data_start + begin)
            # copy=True so nothing keeps a reference into the map once we move on
            t = raw.reshape(shape).to(device=device, dtype=want, copy=True)
            del raw
            yield name, t
    finally:
        try:
            mm.close()
        except BufferError:  # a caller still holds a frombuffer view; the GC closes it later
            pass


def load_state_dict(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir: model.safetensors, or the shards listed in
    model.safetensors.index.json, or failing both every *.safetensors file."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted(set(weight_map.values()))
        paths = [model_dir / f for f in files]
    elif (model_dir / "model.safetensors").exists():
        paths = [model_dir / "model.safetensors"]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for p in paths:
        for name, t in iter_safetensors(p, dtype=dtype, device=device):
            state[name] = t
    return state


def load_config(model_dir: str | Path) -> ModelConfig:
    """The checkpoint's config, named after its directory (the served name): made absolute
    first, so "." or "ckpt/" name the directory too, with symlinks kept as given."""
    model_dir = Path(model_dir)
    name = Path(os.path.abspath(model_dir)).name or None  # None for "/": config.json's own name
    return ModelConfig.from_json_file(model_dir / "config.json", name=name)


def hf_to_internal(state: dict[str, Weight], config: ModelConfig) -> dict[str, Weight]:
    """Maps HF parameter names onto LlamaModel's, fusing q/k/v and gate/up projections (by
    stacking rows; quantized matrices by their bytes, see quant_weights.cat_rows).

    Consumes `state` (pops entries) so peak memory stays near one copy of the weights.
    """

    def take(name: str) -> Weight:
        try:
            return state.pop(name)
        except KeyError:
            raise KeyError(f"checkpoint is missing {name}") from None

    out: dict[str, Weight] = {"embed.weight": take("model.embed_tokens.weight")}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        q = f"layers.{i}."
        out[q + "attn_norm.weight"] = take(p + "input_layernorm.weight")
        out[q + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
        a = p + "self_attn."
        out[q + "qkv.weight"] = cat_rows([take(a + f"{x}_proj.weight") for x in "qkv"])
        if config.attention_bias:
            out[q + "qkv.bias"] = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"], 0)
        out[q + "o.weight"] = take(a + "o_proj.weight")
        if config.attention_out_bias:
            out[q + "o.bias"] = take(a + "o_proj.bias")
        m = p + "mlp."
        out[q + "gate_up.weight"] = cat_rows([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        out[q + "down.weight"] = take(m + "down_proj.weight")
    out["norm.weight"] = take("model.norm.weight")
    lm_head = state.pop("lm_head.weight", None)
    if lm_head is not None and not config.tie_word_embeddings:
        out["lm_head.weight"] = lm_head
    leftover = [k for k in state if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"unexpected tensors in checkpoint: {leftover[:8]}")
    return out
