"""IncrementalDetokenizer over a real byte-level vocabulary (SmolLM2-135M-Instruct's, rebuilt from
its GGUF: conftest's smollm2_gguf).

The rule under test: the stream's text equals decoding the whole output; a pushed chunk never ends
in half a character (so never holds U+FFFD for one); an output that ends inside a character ends
with U+FFFD, which only flush() emits.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

from ringleader.device.text.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402
from ringleader.device.text.tokenizer import HFTokenizer, IncrementalDetokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok(smollm2_gguf) -> HFTokenizer:
    md = {name: field.contents() for name, field in gguf.GGUFReader(str(smollm2_gguf)).fields.items()}
    return tokenizer_from_gguf(md)


MULTIBYTE_TEXTS = [
    "héllo wörld, café crème brûlée, naïve façade, Ångström",
    "日本語のテキストと中文混合",
    "한국어 텍스트입니다",
    "emoji 🎉🚀 party 👩‍💻 time 🇫🇷 flag ❤️ 🫠",
    "mixed: a→b ≤ c ∑ ∫ ∞ ™ © 日本 ñ 🎉 x² Ελληνικά русский",
    "𝄞 musical, 𓀀 hieroglyph, 🀄 mahjong",
    "<|im_start|>assistant\n日本語 🎉<|im_end|>",
]


def stream(tok, ids, chunk_sizes=(1,), skip_special_tokens=True, rng=None):
    """Pushes ids in chunks; returns (pushed chunks, flushed text)."""
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    chunks, i = [], 0
    while i < len(ids):
        k = rng.choice(chunk_sizes) if rng else chunk_sizes[0]
        chunks.append(det.push(ids[i : i + k]))
        i += k
    return chunks, det.flush()


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_multibyte_text_one_token_at_a_time(tok, text, skip):
    ids = tok.encode(text)
    # the vocabulary really does split some of these characters across tokens
    full = tok.decode(ids, skip_special_tokens=skip)
    chunks, tail = stream(tok, ids, skip_special_tokens=skip)
    assert all("\ufffd" not in c for c in chunks), chunks
    assert "".join(chunks) + tail == full
    assert tail == ""  # a complete text leaves nothing for flush
    if not skip:
        assert full == text


def test_some_characters_span_several_tokens(tok):
    split = [c for t in MULTIBYTE_TEXTS for c in t if len(tok.encode(c)) > 1]
    assert len(split) >= 5  # otherwise the tests above test little


def test_random_id_sequences(tok):
    """Random ids mixing whole tokens, tokens that are a fragment of a character (lone lead or
    continuation bytes) and control tokens: the concatenation equals the full decode however the
    ids are chunked."""
    n = tok.vocab_size
    fragments = [i for i in range(n) if "\ufffd" in tok.decode([i])]
    control = list(range(17))
    assert len(fragments) > 100
    rng = random.Random(20240607)
    for trial in range(400):
        length = rng.randrange(1, 40)
        ids = [
            rng.choice([rng.randrange(n), rng.choice(fragments), rng.choice(fragments), rng.choice(control)])
            for _ in range(length)
        ]
        for skip in (True, False):
            full = tok.decode(ids, skip_special_tokens=skip)
            chunks, tail = stream(tok, ids, (1, 1, 2, 3, 5), skip, rng)
            assert "".join(chunks) + tail == full, (trial, ids, skip, chunks, tail)


def test_random_ids_from_real_text_fragments(tok):
    """Valid text cut into pieces at random token boundaries and glued back in another order:
    characters split across tokens get reassembled or left broken; concatenation still equals
    the full decode, and a chunk only holds U+FFFD where the full decode has one."""
    rng = random.Random(7)
    pool = [tok.encode(t) for t in MULTIBYTE_TEXTS]
    for _ in range(300):
        ids: list[int] = []
        for _ in range(rng.randrange(1, 5)):
            src = rng.choice(pool)
            a = rng.randrange(len(src))
            ids += src[a : a + rng.randrange(1, 8)]
        full = tok.decode(ids)
        chunks, tail = stream(tok, ids, (1, 2, 3), True, rng)
        assert "".join(chunks) + tail == full
        if "\ufffd" not in full:
            assert all("\ufffd" not in c for c in chunks) and tail == ""


def test_output_ending_inside_a_character(tok):
    """Find characters the vocabulary spells with several tokens; stop one token short: push
    yields nothing for the unfinished character, flush yields U+FFFD, equal to decode."""
    candidates = "日本語中文한국어🎉🚀👩🫠𝄞𓀀🀄ñéß∑∫≤→€"
    cases = []
    for ch in candidates:
        ids = tok.encode(ch)
        if len(ids) > 1 and tok.decode(ids[:-1]).endswith("\ufffd"):
            cases.append((ch, ids))
    assert len(cases) >= 3, cases
    for ch, ids in cases:
        cut = ids[:-1]
        det = IncrementalDetokenizer(tok)
        assert [det.push(i) for i in cut] == [""] * len(cut)
        tail = det.flush()
        assert tail == tok.decode(cut) and tail.endswith("\ufffd"), (ch, tail)
        # and after a complete prefix: the prefix comes out, the broken character only at flush
        prefix = tok.encode("ok ")
        det = IncrementalDetokenizer(tok)
        chunks = [det.push(i) for i in prefix + cut]
        assert "".join(chunks) == "ok "
        assert "".join(chunks) + det.flush() == tok.decode(prefix + cut)
        # pushing the last token completes it
        det = IncrementalDetokenizer(tok)
        out = "".join(det.push(i) for i in ids)
        assert out == ch and det.flush() == ""
