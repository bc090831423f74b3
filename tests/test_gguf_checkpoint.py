"""The GGUF loader on files written here with the gguf package's own writer, laid out as llama.cpp's
converter lays out a Llama checkpoint (Q/K rows permuted, shapes fastest-first), so the loader is
checked against a known HF state dict without any download."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from ringleader.device.model import LlamaModel  # noqa: E402
from ringleader.device.model.ops import rope_inv_freq  # noqa: E402
from ringleader.device.weights.gguf_checkpoint import (  # noqa: E402
    GGUFError,
    config_from_gguf,
    gguf_metadata,
    load_gguf,
    open_gguf,
)
from ringleader.device.weights.gguf_quants import UnsupportedQuantization  # noqa: E402

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _converter_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows (interleave each head's two RoPE halves)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def write_gguf(path, hf, *, qtype="F32", arch="llama", extra_tensors=(), drop=(), rope_freqs=None):
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    w.add_float32(f"{arch}.rope.freq_base", 50000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{arch}.vocab_size", c.vocab_size)
    w.add_uint32("tokenizer.ggml.eos_token_id", 5)
    for name, t in hf.state_dict().items():
        a = t.numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{HF_TO_GGUF[rest]}"
            if rest.startswith("self_attn.q_proj"):
                a = _converter_permute(a, c.num_attention_heads)
            elif rest.startswith("self_attn.k_proj"):
                a = _converter_permute(a, c.num_key_value_heads)
        if gname in drop:
            continue
        if a.ndim == 2 and qtype != "F32":
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, gguf.quants.quantize(a.astype(np.float32), q), raw_dtype=q)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for gname, a in extra_tensors:
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_f32_file_loads_to_exactly_the_hf_state_dict(hf_model, tmp_path):
    config, state = load_gguf(write_gguf(tmp_path / "m.gguf", hf_model))
    want = hf_model.state_dict()
    assert set(state) == set(want)
    for name, t in state.items():
        assert torch.equal(t, want[name]), name
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.rope_theta == 50000.0 and not config.tie_word_embeddings and config.eos_token_ids == [5]


def test_f32_file_gives_transformers_logits(hf_model, tmp_path):
    model = LlamaModel.from_gguf(write_gguf(tmp_path / "m.gguf", hf_model))
    ids = [3, 17, 42, 8, 60, 1]
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0, -1]
    assert (model.prompt_logits(ids) - theirs).abs().max() < 1e-4


def test_q8_0_file_dequantizes_close_to_the_weights(hf_model, tmp_path):
    _, state = load_gguf(write_gguf(tmp_path / "q8.gguf", hf_model, qtype="Q8_0"))
    for name, t in hf_model.state_dict().items():
        scale = t.abs().max()
        assert (state[name] - t).abs().max() <= scale / 100, name  # 8-bit blocks: within ~1/127 of the range


def test_missing_output_tensor_means_tied_embeddings(hf_model, tmp_path):
    config, state = load_gguf(write_gguf(tmp_path / "tied.gguf", hf_model, drop={"output.weight"}))
    assert config.tie_word_embeddings and "lm_head.weight" not in state


def test_rope_freqs_tensor_scales_the_frequencies(hf_model, tmp_path):
    factors = np.linspace(1.0, 8.0, 8)
    path = write_gguf(tmp_path / "rf.gguf", hf_model, rope_freqs=factors)
    config = config_from_gguf(open_gguf(path))
    plain = 1.0 / (50000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.allclose(rope_inv_freq(config), plain / torch.tensor(factors, dtype=torch.float32))


def test_unsupported_architecture_is_named(hf_model, tmp_path):
    with pytest.raises(GGUFError, match="architecture 'falcon' is not supported"):
        load_gguf(write_gguf(tmp_path / "f.gguf", hf_model, arch="falcon"))


def test_unexpected_tensor_is_named(hf_model, tmp_path):
    extra = [("blk.0.attn_q.bias", np.zeros(64, np.float32))]
    with pytest.raises(GGUFError, match="unexpected tensor blk.0.attn_q.bias"):
        load_gguf(write_gguf(tmp_path / "b.gguf", hf_model, extra_tensors=extra))


def test_unsupported_quantization_is_named(hf_model, tmp_path):
    path = write_gguf(tmp_path / "iq.gguf", hf_model, qtype="F16")
    with open(path, "r+b") as f:  # relabel one tensor's type as IQ2_XS in the header
        data = f.read()
        name = b"token_embd.weight"
        at = data.index(name) + len(name)
        n_dims = int.from_bytes(data[at : at + 4], "little")
        type_at = at + 4 + 8 * n_dims
        f.seek(type_at)
        f.write(int(gguf.GGMLQuantizationType.IQ2_XS).to_bytes(4, "little"))
    with pytest.raises((UnsupportedQuantization, ValueError), match="IQ2_XS"):
        load_gguf(path)


def test_metadata_is_parsed_once_for_a_load_then_a_tokenizer(hf_model, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_model)
    file = open_gguf(path)
    assert gguf_metadata(path) is file.metadata  # no second parse
    write_gguf(path, hf_model, drop={"output.weight"})  # a changed file is parsed anew
    assert gguf_metadata(path) is not file.metadata


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


def test_the_model_is_named_after_the_file_stem(hf_model, tmp_path):
    """The served name (stats, /v1/models, the `serving` line): the stem, as llama-server shows it."""
    path = write_gguf(tmp_path / "Tiny-Llama-2L.Q8_0.gguf", hf_model)
    assert config_from_gguf(open_gguf(path)).name == "Tiny-Llama-2L.Q8_0"
    assert LlamaModel.from_gguf(path).config.name == "Tiny-Llama-2L.Q8_0"
    assert config_from_gguf(open_gguf(path), name="chosen").name == "chosen"
