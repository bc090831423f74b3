"""Each token's exact output bytes, for compiling output constraints over the vocabulary.

A constraint (a JSON schema, a regex) is a language of byte strings; to turn it into a token
automaton (hostctl/serving/constraint_compiler.py) the compiler needs what each token id adds to
the output text, as raw bytes: a byte-level BPE token may be half a UTF-8 character, so text
would not do.  How a piece spells its bytes depends on the tokenizer's decoder:

- byte-level (GPT-2, SmolLM2, Llama-3, Qwen2): each character of the piece stands for one byte
  (gguf_tokenizer._byte_spelling); a piece not written in that alphabet (an added token) is its
  own UTF-8 text, as the ByteLevel decoder gives it back;
- SentencePiece (Llama-2, Mistral): "▁" is a space and "<0xAB>" (byte fallback) is byte 0xAB.
  The raw piece is taken: the decoder's strip of the sequence's first space is not applied;
- ByteTokenizer: id i < 256 is byte i.

Other decoders fall back to decoding each id alone.  Special tokens, and tokens whose bytes are
empty, get None: a constraint never allows them (EOS is allowed apart, by the automaton)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from ringleader.device.text.gguf_tokenizer import _byte_spelling
from ringleader.device.text.tokenizer import ByteTokenizer

log = logging.getLogger("ringleader.text")

SPM_SPACE = "▁"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """Per token id 0..tokenizer.vocab_size-1: the bytes it adds to the output, None for special
    tokens and tokens that add nothing."""
    if isinstance(tokenizer, ByteTokenizer):
        return [bytes([i]) if i < 256 else None for i in range(tokenizer.vocab_size)]
    hf = getattr(tokenizer, "_tok", None)
    if hf is None:
        raise TypeError(
            f"no token bytes for a {type(tokenizer).__name__}: not a ByteTokenizer or HFTokenizer"
        )
    n = int(tokenizer.vocab_size)
    pieces: list[str | None] = [None] * n
    for piece, i in hf.get_vocab(with_added_tokens=True).items():
        if 0 <= i < n:
            pieces[i] = piece
    decoder = _decoder_steps(hf)
    kinds = {step.get("type") for step in decoder}
    if "ByteLevel" in kinds:
        out = _byte_level(pieces)
    elif kinds & {"ByteFallback", "Metaspace"} or _spm_replacement(decoder):
        out = _sentencepiece(pieces, decoder)
    else:
        log.warning("token bytes: decoder %s unknown, decoding each token alone", sorted(map(str, kinds)))
        out = _decoded_alone(hf, n)
    for i in tokenizer.special_token_ids():
        if 0 <= i < n:
            out[i] = None
    return [b or None for b in out]


def _decoder_steps(hf: Any) -> list[dict]:
    """The decoder's steps as JSON maps (a Sequence flattened); [] without a decoder."""
    if hf.decoder is None:
        return []
    steps, todo = [], [json.loads(hf.decoder.__getstate__())]
    while todo:
        step = todo.pop(0)
        if step.get("type") == "Sequence":
            todo[:0] = step.get("decoders", [])
        else:
            steps.append(step)
    return steps


def _byte_level(pieces: list[str | None]) -> list[bytes | None]:
    spelling = _byte_spelling()
    # one translate + latin-1 encode per piece: the byte alphabet's chars to the bytes they spell
    to_latin1 = {ord(ch): b for b, ch in spelling.items()}
    outside = re.compile("[^" + re.escape("".join(spelling.values())) + "]")
    out: list[bytes | None] = []
    for piece in pieces:
        if piece is None:
            out.append(None)
        elif outside.search(piece):
            out.append(piece.encode("utf-8"))  # not byte-spelled: the decoder gives it back as is
        else:
            out.append(piece.translate(to_latin1).encode("latin-1"))
    return out


def _spm_replacement(decoder: list[dict]) -> dict[str, str]:
    """The decoder's literal replacements (Replace "▁" -> " ", Metaspace's replacement)."""
    replace = {}
    for step in decoder:
        if step.get("type") == "Replace" and isinstance(step.get("pattern"), dict):
            literal = step["pattern"].get("String")
            if literal:
                replace[literal] = str(step.get("content", ""))
        elif step.get("type") == "Metaspace":
            replace[str(step.get("replacement", SPM_SPACE))] = " "
    return replace


def _sentencepiece(pieces: list[str | None], decoder: list[dict]) -> list[bytes | None]:
    replace = _spm_replacement(decoder) or {SPM_SPACE: " "}
    byte_fallback = any(step.get("type") == "ByteFallback" for step in decoder)
    out: list[bytes | None] = []
    for piece in pieces:
        if piece is None:
            out.append(None)
            continue
        if byte_fallback and len(piece) == 6 and (m := _BYTE_FALLBACK.fullmatch(piece)):
            out.append(bytes([int(m.group(1), 16)]))
            continue
        for old, new in replace.items():
            piece = piece.replace(old, new)
        out.append(piece.encode("utf-8"))
    return out


def _decoded_alone(hf: Any, n: int) -> list[bytes | None]:
    texts = hf.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    return [t.encode("utf-8") for t in texts]
