"""A GGUF file's tokenizer, rebuilt in memory as a `tokenizers.Tokenizer` from its metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary, token types, merges (or scores) and
special ids under llama.cpp's `tokenizer.ggml.*` keys, plus a name for the pre-tokenizer
(`tokenizer.ggml.pre`) whose regexes live in llama.cpp's source. This module maps those onto
`tokenizers` components:

- "gpt2" (byte-level BPE: GPT-2, SmolLM2, StarCoder, Llama-3, Qwen2...): BPE over the byte-level
  alphabet, no unk, a pre-tokenizer chosen by `tokenizer.ggml.pre` (PRE_TOKENIZERS), ByteLevel
  decoder.
- "llama" (SentencePiece BPE: Llama-2, Mistral, TinyLlama...): BPE with byte fallback over "▁"
  pieces, merges from the file or recovered from the scores, Metaspace pre-tokenizer, the
  sentencepiece decoder; as transformers' GGUF converter builds it.

Control tokens (type 3, and the unknown token) become special added tokens, user-defined ones
(type 4) plain added tokens, so both are matched whole in text (as llama.cpp does) and
decode(skip_special_tokens=True) drops exactly the control ones.

Usage: tokenizer_from_gguf({name: field.contents() for name, field in GGUFReader(p).fields.items()}).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from ringleader.device.text.chat_template import load_chat_template
from ringleader.device.text.tokenizer import HFTokenizer
from ringleader.ipc.install_hint import install_hint

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's LLAMA3 pre-tokenizer regex (also Llama-3's tokenizer.json)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: as Llama-3's but one digit per piece
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> pre-tokenizer family (names as llama.cpp's convert_hf_to_gguf writes them)
PRE_TOKENIZERS: dict[str, str] = {
    # GPT-2's regex alone (ByteLevel's use_regex)
    "default": "gpt2",
    "gpt2": "gpt2",
    # llama.cpp splits off every \p{N} first, then applies GPT-2's regex
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"], "digits"
    ),
    # Llama-3's regex (llama.cpp's LLAMA3 group, and DBRX/Smaug which use the same regex)
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"], "llama3"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen"], "qwen2"),
}

SUPPORTED_MODELS = ("gpt2", "llama")


def _key(name: str) -> str:
    return f"tokenizer.ggml.{name}"


@functools.cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's printable spelling of bytes: printable Latin-1 bytes stand for themselves, the
    others (controls, space, 0x7F-0xA0, 0xAD) for chr(256 + k) in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _seq(md: Mapping[str, Any], name: str) -> list | None:
    """An array field as a list (contents() gives lists; numpy arrays work too)."""
    v = md.get(_key(name))
    return None if v is None else list(v)


def _opt_int(md: Mapping[str, Any], name: str, n_tokens: int) -> int | None:
    v = md.get(_key(name))
    if v is None:
        return None
    v = int(v)
    if not 0 <= v < n_tokens:
        raise ValueError(f"GGUF {_key(name)} = {v} is outside the vocabulary (0..{n_tokens - 1})")
    return v


def _split_merge(merge: str) -> tuple[str, str]:
    # like llama.cpp: the separator is the first space after the first character, so a piece
    # that is itself " " (possible in non-byte-level vocabularies) still parses
    pos = merge.find(" ", 1)
    if pos < 0:
        raise ValueError(f"GGUF merge {merge!r} is not 'left right'")
    return merge[:pos], merge[pos + 1 :]


def _merges_from_scores(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float]) -> list:
    """SentencePiece BPE has no merge list: a pair merges when the joined piece is in the vocabulary,
    best-scored first. Recover an equivalent ranked list: every split (left, right) of a mergeable
    token whose halves are both tokens, ranked by the joined token's score (high first), then longer
    left, longer right, then vocabulary order."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, tok in enumerate(tokens):
        if ids[tok] != i or types[i] in (UNKNOWN, CONTROL, BYTE):
            continue  # control/byte tokens are never the result of merging text
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in ids and right in ids:
                ranked.append(
                    (-float(scores[i]), -len(left), -len(right), i, ids[left], ids[right], left, right)
                )
    ranked.sort()
    return [(r[-2], r[-1]) for r in ranked]


def _gpt2_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    family = PRE_TOKENIZERS.get(pre)
    if family is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "gpt2":
        return gpt2
    if family == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    split = {"llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}[family]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _build_gpt2(md: Mapping[str, Any], tokens: list[str], types: list[int]):
    from tokenizers import Tokenizer, decoders, models

    pre = str(md.get(_key("pre")) or "default")
    pre_tokenizer = _gpt2_pre_tokenizer(pre)  # first: an unknown pre fails before the heavy work
    spelling = _byte_spelling()
    alphabet = frozenset(spelling.values())
    vocab: dict[str, int] = {}
    for i, (tok, typ) in enumerate(zip(tokens, types)):
        if typ not in (CONTROL, USER_DEFINED, UNKNOWN) and not alphabet.issuperset(tok):
            # a normal token not written in the byte alphabet: spell its UTF-8 bytes
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        # control/user-defined tokens keep their raw text: they are matched as added tokens,
        # and the ByteLevel decoder gives back a token that is not byte-spelled as its raw bytes
        vocab[tok] = i
    merges = [_split_merge(str(m)) for m in _seq(md, "merges") or ()]
    model = models.BPE(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        fuse_unk=False,
        byte_fallback=False,
        # llama.cpp uses a pre-token that is itself a token whole for Llama-3 (its tokenizer.json too)
        ignore_merges=PRE_TOKENIZERS[pre] == "llama3",
    )
    tk = Tokenizer(model)
    tk.pre_tokenizer = pre_tokenizer
    tk.decoder = decoders.ByteLevel()
    return tk


def _build_spm(md: Mapping[str, Any], tokens: list[str], types: list[int]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(tokens)}
    listed = _seq(md, "merges")
    if listed:
        merges = [_split_merge(str(m)) for m in listed]
    else:
        scores = _seq(md, "scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError("GGUF SentencePiece tokenizer has neither tokenizer.ggml.merges nor scores")
        merges = _merges_from_scores(tokens, types, scores)
    unk_id = md.get(_key("unknown_token_id"))
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    tk = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    add_space_prefix = bool(md.get(_key("add_space_prefix"), True))
    # "first": a "▁" before the text's first piece only, not after each special token (transformers'
    # non-legacy Llama tokenizer; llama.cpp prefixes every text fragment after a special token)
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(steps)
    return tk


def tokenizer_from_gguf(md: Mapping[str, Any]) -> HFTokenizer:
    """An HFTokenizer from a GGUF's metadata (field name -> field.contents()).

    bos from tokenizer.ggml.bos_token_id; eos_token_ids = eos, then eot and eom when present
    (deduplicated); add_bos from tokenizer.ggml.add_bos_token (default True for "llama", False for
    "gpt2"); add_eos from tokenizer.ggml.add_eos_token; the chat template from
    tokenizer.chat_template. Raises ValueError for a tokenizer model or pre-tokenizer it does not
    know, naming it and the supported ones.
    """
    try:
        from tokenizers import AddedToken
    except ImportError as e:
        raise ImportError(f"GGUF tokenizers need the `tokenizers` package: {install_hint('hf')}") from e

    kind = md.get(_key("model"))
    if kind not in SUPPORTED_MODELS:
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r} (tokenizer.ggml.model); supported: "
            "'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
        )
    tokens = [str(t) for t in _seq(md, "tokens") or ()]
    if not tokens:
        raise ValueError("GGUF has no tokenizer.ggml.tokens")
    types = [int(t) for t in _seq(md, "token_type") or [NORMAL] * len(tokens)]
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")

    tk = _build_gpt2(md, tokens, types) if kind == "gpt2" else _build_spm(md, tokens, types)

    special = [
        AddedToken(t, special=True, normalized=False)
        for t, typ in zip(tokens, types)
        if typ in (CONTROL, UNKNOWN)
    ]
    user = [
        AddedToken(t, special=False, normalized=False) for t, typ in zip(tokens, types) if typ == USER_DEFINED
    ]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)

    n = len(tokens)
    eos_ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = _opt_int(md, name, n)
        if v is not None and v not in eos_ids:
            eos_ids.append(v)
    add_bos = md.get(_key("add_bos_token"))
    source = md.get("tokenizer.chat_template")
    return HFTokenizer(
        tk,
        bos_token_id=_opt_int(md, "bos_token_id", n),
        eos_token_ids=eos_ids,
        add_bos=(kind == "llama") if add_bos is None else bool(add_bos),
        add_eos=bool(md.get(_key("add_eos_token"), False)),
        chat_template=load_chat_template(source, "tokenizer.chat_template"),
    )
