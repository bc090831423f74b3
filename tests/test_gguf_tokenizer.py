"""The tokenizer rebuilt from a GGUF's metadata (ringleader.device.text.gguf_tokenizer) against transformers' GGUF
tokenizer on a real file (SmolLM2-135M-Instruct: conftest's smollm2_gguf), plus
synthetic vocabularies for the other pre-tokenizers, SentencePiece, and the errors."""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

from ringleader.device.text.gguf_tokenizer import PRE_TOKENIZERS, tokenizer_from_gguf  # noqa: E402
from ringleader.device.text.tokenizer import HFTokenizer  # noqa: E402


def read_metadata(path) -> dict:
    return {name: field.contents() for name, field in gguf.GGUFReader(str(path)).fields.items()}


@pytest.fixture(scope="module")
def md(smollm2_gguf):
    return read_metadata(smollm2_gguf)


@pytest.fixture(scope="module")
def tok(md) -> HFTokenizer:
    return tokenizer_from_gguf(md)


@pytest.fixture(scope="module")
def hf(md, smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


TEXTS = [
    "Hello world",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "It's, we're, they'll, I'd, you've, she's, I'm, don't.",
    "IT'S WE'RE THEY'LL",
    "   leading spaces",
    "trailing spaces   ",
    "a  b   c    d     e",
    "line one\nline two\n\nline four\r\nwindows\rmac",
    "\n\n\n",
    "\ttab\t\tseparated\tvalues",
    " ",
    "",
    "!!! ??? ... --- *** ### @@@ $$$ %%% ^^^ &&&",
    "(parens) [brackets] {braces} <angles> 'quotes' \"double\" `back`",
    "def f(x):\n    return x * x  # square\n\nclass A:\n    pass\n",
    "for (int i = j; i < n; ++i) { sum += a[i]; }",
    '{"key": "value", "list": [true, false, null]}',
    "<html><body><p>Hi &amp; bye</p></body></html>",
    "héllo wörld, café crème brûlée, naïve façade, Ångström",
    "Ελληνικά, русский текст, עברית, العربية",
    "日本語のテキストと中文混合 and English",
    "한국어 텍스트입니다",
    "emoji 🎉🚀 party 👩‍💻 time 🇫🇷 flag ❤️",
    "mixed: a→b ≤ c ∑ ∫ ∞ ™ © ® °",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|im_start|>",
    "<|endoftext|> and <repo_name> and <file_sep>",
    "almost special: <|im_start| and im_end|> and <|im_start |>",
    "https://example.com/path?query=value&other=thing#anchor",
    "CamelCaseIdentifier snake_case_name kebab-case-name",
    "Zwischenraum\u00a0non-breaking\u2003em space\u200bzero width",
]

DIGIT_TEXTS = [
    "12345",
    "The year 2024 had 366 days, pi is 3.14159.",
    "x1 y22 z333 w4444",
    " 1 22  333\n4444",
    "0x1F 0b1010 1e-9 1,000,000",
    "Arabic-Indic ٣٤٥ and full-width １２３ and superscript x² ① ½ Ⅻ",
    "<|im_start|>42<|im_end|>",
]


def _has_number(text: str) -> bool:
    """Has a \\p{N} character: what llama.cpp's smollm pre-tokenizer (and Digits) split off."""
    return any(unicodedata.category(c)[0] == "N" for c in text)


def test_texts_have_no_digits():
    assert not [t for t in TEXTS if _has_number(t)]
    assert all(_has_number(t) for t in DIGIT_TEXTS)


def test_metadata_fields(tok, md):
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "smollm"
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"]) == 49152  # added tokens reuse their ids
    assert tok.eos_token_ids == [2]
    assert tok.bos_token_id == 1
    assert tok.chat_template is not None and tok.chat_template.source == md["tokenizer.chat_template"]
    # tokenizer.ggml.add_bos_token is False: no BOS added
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_in_text(tok):
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nHi"  # control tokens skipped
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_digits_split_one_per_token(tok, text):
    """smollm's pre-tokenizer (llama.cpp's, and the model's own tokenizer.json) splits every digit
    off on its own; transformers' GGUF converter does not, so it is not the reference here."""
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    for i in ids:
        piece = tok.decode([i], skip_special_tokens=False)
        if _has_number(piece):
            assert len(piece) == 1, (text, piece)
    ascii_digits = sum(c.isdigit() and c.isascii() for c in text)
    assert sum(tok.decode([i]) in "0123456789" and tok.decode([i]) != "" for i in ids) == ascii_digits


def test_decode_matches_transformers(tok, hf):
    id_lists = [tok.encode(t) for t in TEXTS + DIGIT_TEXTS]
    rng = random.Random(1234)
    n = tok.vocab_size
    for _ in range(300):
        k = rng.randrange(1, 24)
        # random ids, biased towards control tokens (0..16) and single-byte tokens
        id_lists.append(
            [rng.choice([rng.randrange(n), rng.randrange(17), rng.randrange(17, 300)]) for _ in range(k)]
        )
    for ids in id_lists:
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (
                ids,
                skip,
            )


CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What's up?"}],
    [
        {"role": "user", "content": "Write a haiku about tokenizers."},
        {
            "role": "assistant",
            "content": "Bytes merge into words,\nsplit by rules no one reads—\nspace before the dog.",
        },
        {"role": "user", "content": "Now in 日本語, with emoji 🎉 and <|im_end|> inside."},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaced\n\n  out  "}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_encode_chat_matches_apply_chat_template(tok, hf, messages):
    ref = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref_ids = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert tok.encode_chat(messages) == list(ref_ids)
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.decode(tok.encode_chat(messages), skip_special_tokens=False) == text
    assert text.endswith("<|im_start|>assistant\n")


# --- synthetic metadata: no file needed ------------------------------------------------------


def _byte_spelling() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def _synthetic_gpt2_md(pre: str, extra_tokens=(), merges=()) -> dict:
    """A byte-level vocabulary: 2 control tokens, the 256 byte pieces, then extra_tokens (each
    given in plain text; its byte-level spelling goes in the vocabulary) built by `merges`."""
    pytest.importorskip("transformers")
    spell = _byte_spelling()

    def s(text: str) -> str:
        return "".join(spell[b] for b in text.encode("utf-8"))

    tokens = ["<|begin|>", "<|end|>"] + [spell[b] for b in range(256)] + [s(t) for t in extra_tokens]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.merges": [f"{s(a)} {s(b)}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.eot_token_id": 1,
    }


def _pieces(tok: HFTokenizer, text: str) -> list[str]:
    return [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]


# merges that would glue digits and words together if the pre-tokenizer let them
DIGIT_MERGES = [("1", "2"), ("12", "3"), ("123", "4"), ("1234", "5"), ("4", "5"), (" ", "1"), ("2", "3")]
WORD_MERGES = [("'", "s"), (" ", "w"), (" w", "o"), (" wo", "r"), (" wor", "l"), (" worl", "d"), ("d", "'")]


def _merged_tokens(merges):
    return [a + b for a, b in merges]


def test_llama3_pre_tokenizer_splits():
    merges = DIGIT_MERGES + WORD_MERGES
    md = _synthetic_gpt2_md("llama-bpe", _merged_tokens(merges), merges)
    tok = tokenizer_from_gguf(md)
    assert tok.eos_token_ids == [1] and tok.bos_token_id == 0
    # digits come in groups of up to three, apart from words and spaces
    assert _pieces(tok, "12345") == ["123", "45"]
    assert _pieces(tok, " 12345") == [" ", "123", "45"]
    # contractions (case-insensitive) split off; a letter run takes one leading non-letter
    assert _pieces(tok, "world's") == ["w", "o", "r", "l", "d", "'s"]
    assert _pieces(tok, " world'S") == [" world", "'", "S"]
    # newlines: punctuation keeps trailing newlines; whitespace before a newline stays with it
    pre = tok._tok.pre_tokenizer
    assert [p for p, _ in pre.pre_tokenize_str("ok!!\n\nx")] == ["ok", "!!ĊĊ", "x"]
    assert [p for p, _ in pre.pre_tokenize_str("a  \n  b")] == ["a", "ĠĠĊ", "Ġ", "Ġb"]
    # a llama3 GGUF says add_bos_token=True when it wants BOS
    md["tokenizer.ggml.add_bos_token"] = True
    assert tokenizer_from_gguf(md).encode("1")[0] == 0


def test_qwen2_pre_tokenizer_splits():
    merges = DIGIT_MERGES + WORD_MERGES
    tok = tokenizer_from_gguf(_synthetic_gpt2_md("qwen2", _merged_tokens(merges), merges))
    assert _pieces(tok, "12345") == ["1", "2", "3", "4", "5"]  # one digit per piece
    assert _pieces(tok, " world's") == [" world", "'s"]
    assert [p for p, _ in tok._tok.pre_tokenizer.pre_tokenize_str("ok!!\n\nx")] == ["ok", "!!ĊĊ", "x"]


def test_gpt2_and_smollm_pre_tokenizers_split():
    merges = DIGIT_MERGES + WORD_MERGES
    gpt2 = tokenizer_from_gguf(_synthetic_gpt2_md("gpt2", _merged_tokens(merges), merges))
    assert _pieces(gpt2, "12345") == ["12345"]  # GPT-2: a digit run is one piece
    assert _pieces(gpt2, " 12") == [" ", "12"]  # " 12" is one pre-token; merge rank decides
    for pre in ("smollm", "starcoder", "refact"):
        tok = tokenizer_from_gguf(_synthetic_gpt2_md(pre, _merged_tokens(merges), merges))
        assert _pieces(tok, "12345") == ["1", "2", "3", "4", "5"]
        assert _pieces(tok, " 12 world") == [" ", "1", "2", " world"]


def test_control_and_user_defined_tokens():
    md = _synthetic_gpt2_md("gpt2", ["<think>", "ab"], [("a", "b")])
    md["tokenizer.ggml.tokens"][-2] = "<think>"  # user-defined tokens keep their raw text
    md["tokenizer.ggml.token_type"][-2] = 4
    tok = tokenizer_from_gguf(md)
    think = len(md["tokenizer.ggml.tokens"]) - 2
    ids = tok.encode("<|begin|>ab<think>x<|end|>")
    assert ids[0] == 0 and ids[-1] == 1 and think in ids
    assert tok.decode(ids) == "ab<think>x"  # control tokens dropped, user-defined kept
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin|>ab<think>x<|end|>"
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"])
    # a control token written outside the byte alphabet (DeepSeek style) keeps its raw text and
    # id: matched whole in text, decoded back raw (transformers leaves such tokens out)
    md["tokenizer.ggml.tokens"][0] = "<｜begin▁of▁sentence｜>"
    tok = tokenizer_from_gguf(md)
    ids = tok.encode("<｜begin▁of▁sentence｜>ab")
    assert ids[0] == 0 and len(ids) == 2
    assert tok.decode(ids, skip_special_tokens=False) == "<｜begin▁of▁sentence｜>ab"
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"])


def test_unsupported_model_and_pre_raise():
    md = _synthetic_gpt2_md("gpt2")
    with pytest.raises(ValueError, match=r"tokenizer model 'bert'.*'gpt2'.*'llama'"):
        tokenizer_from_gguf({**md, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match=r"tokenizer model None"):
        tokenizer_from_gguf({k: v for k, v in md.items() if k != "tokenizer.ggml.model"})
    with pytest.raises(ValueError, match=r"pre-tokenizer 'mystery-pre'.*llama-bpe.*smollm"):
        tokenizer_from_gguf({**md, "tokenizer.ggml.pre": "mystery-pre"})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer_from_gguf({**md, "tokenizer.ggml.eos_token_id": 10**6})
    assert {"gpt2", "default", "smollm", "llama-bpe", "llama3", "qwen2"} <= set(PRE_TOKENIZERS)


def test_missing_pre_means_default():
    md = _synthetic_gpt2_md("gpt2", ["ab"], [("a", "b")])
    del md["tokenizer.ggml.pre"]
    assert _pieces(tokenizer_from_gguf(md), "ab ab") == ["ab", " ", "ab"]


# --- SentencePiece ("llama") against transformers' GGUF converter on a written file ----------

SPM_TRAIN = [
    "the cat sat on the mat",
    "hello there, general kenobi",
    "Hello world héllo wörld",
    "  leading spaces and\nnewlines\ttabs  ",
    "the theory of the thermal thing",
] * 5


def _write_spm_gguf(path: Path, add_space_prefix: bool | None = None) -> dict:
    """A Llama-2-style GGUF holding only a tokenizer: <unk>, <s>, </s>, 256 <0xNN> byte tokens and
    pieces with sentencepiece-like scores (no merges: they are recovered from the scores)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, initial_alphabet=list("abcdefghij▁")
    )
    tk.train_from_iterator(SPM_TRAIN, trainer=trainer)
    model = json.loads(tk.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    rank = {"".join(m if isinstance(m, list) else m.split(" ")): r for r, m in enumerate(model["merges"])}
    scores = [-1.0 - rank[t] if t in rank else 0.0 for t in tokens]  # earlier merge: higher score
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.add_chat_template(
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_metadata(path)


SPM_TEXTS = [
    "the cat sat",
    " the theory",
    "Hello world héllo",
    "日本語 ZQX?!",
    "  two\n\tx ",
    "<s>the</s> cat",
    "a<s> b",
    "",
]


def test_sentencepiece_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    md = _write_spm_gguf(tmp_path / "spm.gguf")
    tok = tokenizer_from_gguf(md)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert (
        tok.bos_token_id == 1
        and tok.eos_token_ids == [2]
        and tok.vocab_size == len(md["tokenizer.ggml.tokens"])
    )
    for text in SPM_TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 1  # SentencePiece GGUFs add BOS unless they say otherwise
        assert ids == hf(text)["input_ids"], text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert 3 + 0xE6 in tok.encode("日")  # byte fallback: <0xE6> for a character not in the vocabulary
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), ids
    msgs = [{"role": "user", "content": "hello there"}]
    ref = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert tok.encode_chat(msgs) == list(ref["input_ids"] if hasattr(ref, "keys") else ref)


def test_sentencepiece_without_space_prefix(tmp_path):
    md = _write_spm_gguf(tmp_path / "spm.gguf", add_space_prefix=False)
    tok = tokenizer_from_gguf(md)
    with_prefix = tokenizer_from_gguf({**md, "tokenizer.ggml.add_space_prefix": True})
    assert tok.decode(tok.encode("the cat")) == "the cat"
    assert tok.encode("the", add_special_tokens=False) != with_prefix.encode("the", add_special_tokens=False)
    assert tok.decode(tok.encode(" the cat")) == " the cat"  # no prefix added, none stripped
    no_bos = tokenizer_from_gguf({**md, "tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode("the")[0] != 1
