"""Byte tokenizer, HF tokenizer wrapper and incremental detokenization."""

from __future__ import annotations

import json

import pytest

from ringleader.device.model.presets import tokenizer_for
from ringleader.device.text.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    load_tokenizer,
)

TEXTS = [
    "Hello, world! héllo wörld",
    "日本語のテキスト and 中文 mixed in",
    "emoji 🎉🚀 party 👩‍💻 time",
    "  leading spaces and\nnewlines\ttabs  ",
]


def test_byte_round_trip_and_specials():
    tok = ByteTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.BOS and all(0 <= i < 256 for i in ids[1:])
        assert tok.decode(ids) == text
        assert tok.decode(ids + [tok.EOS, tok.PAD]) == text
    assert tok.encode("ab", add_special_tokens=False) == [97, 98]
    assert tok.vocab_size % 8 == 0 and tok.vocab_size > tok.PAD


def test_byte_incremental_holds_back_split_utf8():
    tok = ByteTokenizer()
    text = "añ世🎉!"
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok)
    chunks = [det.push(i) for i in ids]  # one byte per push
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) + det.flush() == text
    # "世" is 3 bytes: nothing comes out until its last byte
    b = "世".encode()
    det = IncrementalDetokenizer(tok)
    assert det.push([b[0]]) == "" and det.push([b[1]]) == "" and det.push([b[2]]) == "世"
    # an unfinished character is flushed as U+FFFD
    det = IncrementalDetokenizer(tok)
    assert det.push(list("x🎉".encode())[:3]) == "x"
    assert det.flush() == "\ufffd"


def _build_hf_tokenizer(dirpath, style: str, tokenizer_config: dict | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<s>", "</s>", "<unk>"]
    if style == "bytelevel":  # GPT-2 / Llama-3 style
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    else:  # sentencepiece-like metaspace with byte fallback (Llama-2 / Mistral style)
        tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tk.pre_tokenizer = pre_tokenizers.Metaspace()
        tk.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=specials + byte_tokens,
            initial_alphabet=list("abcdefghijklmnopqrstuvwxyz "),
        )
    tk.train_from_iterator(TEXTS * 3 + ["the cat sat on the mat", "hello there"], trainer=trainer)
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tk.token_to_id("<s>"))]
    )
    tk.save(str(dirpath / "tokenizer.json"))
    if style != "bytelevel":
        # like Llama-2's tokenizer.json: <0xNN> byte tokens live in the model vocab only,
        # not among the (skippable) added special tokens
        data = json.loads((dirpath / "tokenizer.json").read_text(encoding="utf-8"))
        data["added_tokens"] = [t for t in data["added_tokens"] if not t["content"].startswith("<0x")]
        (dirpath / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    if tokenizer_config is not None:
        (dirpath / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return tk


@pytest.mark.parametrize("style", ["bytelevel", "metaspace"])
def test_hf_incremental_matches_full_decode(tmp_path, style):
    pytest.importorskip("tokenizers")
    _build_hf_tokenizer(tmp_path, style, {"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_ids == [tok._tok.token_to_id("</s>")]
    eos = tok.eos_token_ids[0]
    mid_special = tok.encode("hello there") + [eos] + tok.encode(" the cat sat", add_special_tokens=False)
    for ids in [tok.encode(t) for t in TEXTS + ["unseen: ÿ ж ✓ 𝄞 zzz"]] + [mid_special]:
        assert ids[0] == tok.bos_token_id  # post-processor adds BOS
        full = tok.decode(ids)
        for step in (1, 2, 3):
            det = IncrementalDetokenizer(tok)
            chunks = [det.push(ids[i : i + step]) for i in range(0, len(ids), step)]
            chunks.append(det.flush())
            assert "".join(chunks) == full, (style, step, chunks)
            if "\ufffd" not in full:
                assert all("\ufffd" not in c for c in chunks)


def test_hf_add_bos_token_flag(tmp_path):
    pytest.importorskip("tokenizers")
    _build_hf_tokenizer(tmp_path, "bytelevel", {"bos_token": "<s>", "add_bos_token": False})
    tok = HFTokenizer.from_dir(tmp_path)
    ids = tok.encode("hello there")
    assert tok.bos_token_id not in ids and tok.decode(ids) == "hello there"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": True}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.encode("hello")[0] == tok.bos_token_id
    assert tok.bos_token_id not in tok.encode("hello", add_special_tokens=False)


def test_tokenizer_for_specs(tmp_path):
    assert isinstance(tokenizer_for("tiny"), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert tokenizer_for(str(tmp_path)) is None  # checkpoint without tokenizer.json
    pytest.importorskip("tokenizers")
    _build_hf_tokenizer(tmp_path, "bytelevel")
    assert isinstance(tokenizer_for(str(tmp_path)), HFTokenizer)
