"""The constraint compiler (hostctl/serving/constraint_compiler.py) and the token bytes it reads
(device/text/token_bytes.py), over the real SmolLM2 vocabulary and the byte vocabulary.

Every automaton is read back through ipc/automaton.py's Walker, the device's rules: valid
documents, tokenized as the model's tokenizer would, walk through allowed tokens to an accepting
state whose EOS leads to END; invalid ones meet a disallowed token; random walks over allowed
tokens only produce documents that parse and satisfy the constraint."""

from __future__ import annotations

import functools
import json
import re
import sys

import numpy as np
import pytest

from ringleader.device.text.token_bytes import token_bytes
from ringleader.device.text.tokenizer import ByteTokenizer, HFTokenizer
from ringleader.hostctl.serving import constraint_compiler as cc
from ringleader.hostctl.serving.constraint_compiler import ConstraintCompiler
from ringleader.ipc.automaton import ACCEPTING, END, TERMINAL, Walker
from ringleader.ipc.install_hint import install_hint
from ringleader.ipc.structured import StructuredError, StructuredSpec, structured_from_wire

MIB = 1 << 18  # int32 words


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    from ringleader.device.model.presets import tokenizer_for

    return tokenizer_for(str(smollm2_gguf))


@pytest.fixture(scope="module")
def smol_compiler(smol):
    pytest.importorskip("outlines_core")
    return ConstraintCompiler(
        functools.cache(lambda: token_bytes(smol)), smol.eos_token_ids, smol.vocab_size, max_words=64 * MIB
    )


@pytest.fixture(scope="module")
def byte_compiler():
    pytest.importorskip("outlines_core")
    tok = ByteTokenizer()
    return ConstraintCompiler(lambda: token_bytes(tok), tok.eos_token_ids, tok.vocab_size, max_words=64 * MIB)


class Model:
    """A tokenizer with its compiler: what a walk needs."""

    def __init__(self, tok, compiler: ConstraintCompiler):
        self.tok, self.compiler = tok, compiler
        self.spelled = token_bytes(tok)
        self.eos = tok.eos_token_ids[0]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def text(self, ids) -> str:
        return b"".join(self.spelled[i] for i in ids).decode("utf-8")


@pytest.fixture(scope="module", params=["smollm2", "bytes"])
def model(request):
    if request.param == "bytes":
        return Model(ByteTokenizer(), request.getfixturevalue("byte_compiler"))
    return Model(request.getfixturevalue("smol"), request.getfixturevalue("smol_compiler"))


# ---------------------------------------------------------------- walking


def walk(w: Walker, m: Model, ids: list[int]) -> int | None:
    """The state after `ids`, None when one of them is not allowed where it comes."""
    s = w.initial
    vocab = m.compiler.vocab_size
    for t in ids:
        if t not in set(w.allowed(s, vocab).tolist()):
            return None
        s = w.next(s, t)
        assert s != END
    return s


def assert_accepts(w: Walker, m: Model, text: str) -> None:
    s = walk(w, m, m.encode(text))
    assert s is not None, f"refused: {text!r}"
    assert w.state(s)["flags"] & ACCEPTING, f"not complete: {text!r}"
    assert m.eos in w.allowed(s, m.compiler.vocab_size) and w.next(s, m.eos) == END


def assert_refuses(w: Walker, m: Model, text: str) -> None:
    assert walk(w, m, m.encode(text)) is None, f"allowed: {text!r}"


def random_walks(w: Walker, m: Model, n: int, seed: int = 0, max_steps: int = 400) -> list[str]:
    """Texts of `n` random walks over allowed tokens only, each to END or a TERMINAL state (a
    walk that runs out of steps is dropped).  Where most tokens loop (inside a string), the
    tokens that leave are picked most of the time, so walks end."""
    rng = np.random.default_rng(seed)
    vocab = m.compiler.vocab_size
    out = []
    for _ in range(n):
        s, ids = w.initial, []
        for _ in range(max_steps):
            st = w.state(s)
            if st["flags"] & TERMINAL:
                break
            allowed = w.allowed(s, vocab)
            stays = w.next_all(s)[allowed] == s
            if stays.mean() > 0.5 and not stays.all() and rng.random() < 0.8:
                t = int(rng.choice(allowed[~stays]))
            else:
                t = int(rng.choice(allowed))
            if t == m.eos:
                assert st["flags"] & ACCEPTING
                break
            ids.append(t)
            s = w.next(s, t)
            assert s != END
        else:
            continue
        out.append(m.text(ids))
    assert len(out) >= n // 2, f"only {len(out)} of {n} walks ended"
    return out


# ---------------------------------------------------------------- a tiny JSON schema validator


def valid(doc, schema: dict) -> bool:
    """doc against the schema features the tests use (type, properties, required, items,
    enum, const, pattern, maxLength, minItems, maxItems)."""
    if "enum" in schema and doc not in schema["enum"]:
        return False
    if "const" in schema and doc != schema["const"]:
        return False
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        checks = {
            "object": lambda d: isinstance(d, dict),
            "array": lambda d: isinstance(d, list),
            "string": lambda d: isinstance(d, str),
            "integer": lambda d: isinstance(d, int) and not isinstance(d, bool),
            "number": lambda d: isinstance(d, (int, float)) and not isinstance(d, bool),
            "boolean": lambda d: isinstance(d, bool),
            "null": lambda d: d is None,
        }
        if not any(checks[t](doc) for t in types):
            return False
    if isinstance(doc, dict):
        props = schema.get("properties", {})
        if not set(schema.get("required", ())) <= doc.keys() or not doc.keys() <= props.keys():
            return False
        return all(valid(v, props[k]) for k, v in doc.items())
    if isinstance(doc, list):
        if not schema.get("minItems", 0) <= len(doc) <= schema.get("maxItems", len(doc)):
            return False
        return all(valid(v, schema.get("items", {})) for v in doc)
    if isinstance(doc, str):
        if len(doc) > schema.get("maxLength", len(doc)):
            return False
        return "pattern" not in schema or re.fullmatch(schema["pattern"], doc) is not None
    return True


# Property order: outlines-core writes an object's properties in the schema's order, which the
# spec keeps (ipc/structured.py), so every document below lists them in that order.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y", "z"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city"],
        },
        "active": {"type": "boolean"},
        "note": {"type": ["string", "null"]},
    },
    "required": ["name", "age"],
}
SCHEMAS = {
    "person": (
        PERSON,
        [
            '{"name": "Ada", "age": 42}',
            '{"name": "Bob \\"B\\"", "age": -3, "score": 1.5e+3, "tags": ["x", "z"], '
            '"address": {"city": "Zürich", "zip": "80331"}, "active": true, "note": null}',
            '{"name": "", "age": 0, "tags": [], "address": {"city": "Oslo"}, "note": "hi"}',
        ],
        [
            '{"name": 5, "age": 42}',  # a number for a string
            '{"age": 42, "name": "Ada"}',  # not in the schema's order
            '{"name": "Ada", "age": 1, "tags": ["w"]}',  # outside the enum
            '{"name": "A", "age": 1, "address": {"city": "Oslo", "zip": "1234a"}}',  # the pattern
            '{"name": "thirteen chars", "age": 1}',  # maxLength
            '{"name": "A", "age": 1.5}',  # a number for an integer
            '{"name": "A",\n"age": 1}',  # a newline: whitespace is [ ]?
        ],
    ),
    "numbers": (
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
        ["[1]", "[1, -2, 30, 0]", "[7,8]"],
        ["[]", "[1, 2, 3, 4, 5]", "[01]", '["1"]'],
    ),
    "enum": (
        {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"const": 3}}},
        ['{"color": "green", "n": 3}', '{"n": 3}', "{}"],
        ['{"color": "pink"}', '{"n": 4}'],
    ),
}
REGEXES = {
    r"[0-9]{3}-[a-z]+( [A-Z][a-z]*)?": (
        ["123-abc", "000-x Yz", "999-hello World"],
        ["12-abc", "123-", "123-a b"],
    ),
    r"(0|[1-9][0-9]*)\.[0-9]{2}": (["0.50", "1234.99"], ["01.50", "1.5", "1.500"]),
    r"[a-z]+@[a-z]+\.(com|org)": (["ada@example.com", "x@y.org"], ["ada@example.net", "@x.com"]),
}
CHOICES = ("red", "green", "blue", 'dark "purple"', "wörld", "a.b|c*", "redder")


# ---------------------------------------------------------------- (a) (b) (c): the walks


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schemas(model, name):
    schema, good, bad = SCHEMAS[name]
    automaton = model.compiler.compile(structured_from_wire({"json": schema}))
    w = Walker(automaton.words)
    for text in good:
        assert valid(json.loads(text), schema), text  # the test's own documents are right
        assert_accepts(w, model, text)
    for text in bad:
        assert_refuses(w, model, text)
    for text in random_walks(w, model, 60, seed=len(name)):
        assert valid(json.loads(text), schema), text


def test_a_closed_json_object_is_terminal(model):
    w = Walker(model.compiler.compile(structured_from_wire({"json": PERSON})).words)
    s = walk(w, model, model.encode('{"name": "Ada", "age": 42}'))
    assert w.state(s)["flags"] == ACCEPTING | TERMINAL
    assert w.allowed(s, model.compiler.vocab_size).tolist() == [model.eos]


@pytest.mark.parametrize("pattern", sorted(REGEXES))
def test_regexes(model, pattern):
    good, bad = REGEXES[pattern]
    w = Walker(model.compiler.compile(StructuredSpec("regex", pattern)).words)
    for text in good:
        assert_accepts(w, model, text)
    for text in bad:  # refused on the way, or a prefix left incomplete
        s = walk(w, model, model.encode(text))
        assert s is None or not w.state(s)["flags"] & ACCEPTING, text
    for text in random_walks(w, model, 60):
        assert re.fullmatch(pattern, text), text


def test_choices(model):
    w = Walker(model.compiler.compile(StructuredSpec("choice", CHOICES)).words)
    for text in CHOICES:
        assert_accepts(w, model, text)
    for text in ("Red", "gree", "a.b|c", "dark purple", "blue "):
        s = walk(w, model, model.encode(text))
        assert s is None or not w.state(s)["flags"] & ACCEPTING, text
    # "red" may end or go on to "redder"; "redder" and "blue" end at once
    red = walk(w, model, model.encode("red"))
    assert w.state(red)["flags"] == ACCEPTING
    assert w.state(walk(w, model, model.encode("redder")))["flags"] == ACCEPTING | TERMINAL
    assert set(random_walks(w, model, 80)) == set(CHOICES)


def test_json_object(model):
    automaton = model.compiler.compile(StructuredSpec("json_object"))
    w = Walker(automaton.words)
    assert cc.MAX_JSON_OBJECT_DEPTH == 2  # the documents below nest to it
    for text in (
        "{}",
        '{"a": 1}',
        '{"a": {"b": 1, "x": null}, "c": [true, "x", -0.5e3], "d": []}',
        '{"": ""}',
    ):
        assert_accepts(w, model, text)
    for text in ('{"a": [{"b": 1}]}', '{"a": {"b": {}}}', "[1]", '"x"', '{"a": 1,}', "{'a': 1}", '{"a": 01}'):
        assert_refuses(w, model, text)

    def depth(doc) -> int:
        children = doc.values() if isinstance(doc, dict) else doc if isinstance(doc, list) else ()
        return 1 + max(map(depth, children), default=0) if isinstance(doc, (dict, list)) else 0

    for text in random_walks(w, model, 60):
        doc = json.loads(text)
        assert isinstance(doc, dict) and depth(doc) <= cc.MAX_JSON_OBJECT_DEPTH, text


def test_json_object_regex_depth():
    """The documented constant bounds the regex itself: depth 1 is a flat object."""
    flat = re.compile(cc.json_object_regex(1))
    assert flat.fullmatch('{"a": 1, "b": "x"}') and not flat.fullmatch('{"a": []}')
    nested = re.compile(cc.json_object_regex(3))
    assert nested.fullmatch('{"a": [{"b": 1}], "c": {"d": []}}') and not nested.fullmatch(
        '{"a": [{"b": [1]}]}'
    )


# ---------------------------------------------------------------- tokens the automaton drops


def byte_compiler_without(*missing: str, **kwargs) -> ConstraintCompiler:
    pytest.importorskip("outlines_core")
    tok = ByteTokenizer()
    spelled = token_bytes(tok)
    for ch in missing:
        spelled[ord(ch)] = None
    return ConstraintCompiler(lambda: spelled, tok.eos_token_ids, tok.vocab_size, max_words=MIB, **kwargs)


def test_tokens_that_cannot_finish_are_dropped():
    """With no "b" in the vocabulary, "a*b|c" can only be "c": the "a" loop that can never end
    is not allowed at all."""
    compiler = byte_compiler_without("b")
    w = Walker(compiler.compile(StructuredSpec("regex", "a*b|c")).words)
    assert w.allowed(w.initial, compiler.vocab_size).tolist() == [ord("c")]
    assert w.n_states == 2


def test_eos_never_appears_but_at_accepting_states(byte_compiler):
    automaton = byte_compiler.compile(StructuredSpec("regex", "[a-c]+"))
    w = Walker(automaton.words)
    for s in range(w.n_states):
        allowed = set(w.allowed(s, 264).tolist())
        assert (ByteTokenizer.EOS in allowed) == bool(w.state(s)["flags"] & ACCEPTING)
        assert not allowed & {ByteTokenizer.BOS, ByteTokenizer.PAD}


# ---------------------------------------------------------------- (d) errors


@pytest.mark.parametrize(
    "spec, field, words",
    [
        (StructuredSpec("json", json.dumps({"type": "foo"})), "structured.json", "foo"),
        (StructuredSpec("json", '{"type": "string", "pattern": "(("}'), "structured.json", "pattern"),
        (StructuredSpec("json", '{"type": "string", "maxLength": 5000}'), "structured.json", "5000"),
        (StructuredSpec("regex", "(("), "structured.regex", "not a valid regular expression"),
        (StructuredSpec("regex", "(?=a)b"), "structured.regex", "look-around"),
        (StructuredSpec("regex", "^ab"), "structured.regex", "^"),
        (StructuredSpec("regex", "a{99999}"), "structured.regex", "at most 1000"),
    ],
)
def test_refusals_name_the_field(byte_compiler, spec, field, words):
    with pytest.raises(StructuredError) as err:
        byte_compiler.compile(spec)
    assert err.value.field == field and words in err.value.reason
    assert byte_compiler.cached(spec) is None


def test_no_output_possible():
    with pytest.raises(StructuredError, match="no output satisfies it") as err:
        byte_compiler_without("b").compile(StructuredSpec("regex", "ab"))
    assert err.value.field == "structured.regex"


def test_too_large_for_the_arena():
    pytest.importorskip("outlines_core")
    tok = ByteTokenizer()
    compiler = ConstraintCompiler(lambda: token_bytes(tok), tok.eos_token_ids, tok.vocab_size, max_words=100)
    with pytest.raises(StructuredError) as err:
        compiler.compile(StructuredSpec("choice", CHOICES))
    assert err.value.field == "structured.choice"
    assert "MiB" in err.value.reason and "--structured-memory-mib" in err.value.reason


def test_outlines_core_missing(monkeypatch):
    for name in [n for n in sys.modules if n.startswith("outlines_core")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "outlines_core", None)  # import outlines_core: ImportError
    tok = ByteTokenizer()
    compiler = ConstraintCompiler(lambda: token_bytes(tok), tok.eos_token_ids, tok.vocab_size, max_words=MIB)
    with pytest.raises(StructuredError) as err:
        compiler.compile(StructuredSpec("regex", "a+"))
    assert err.value.field == "structured" and install_hint("structured") in err.value.reason


# ---------------------------------------------------------------- (e) the cache


def test_cache_hits_and_eviction():
    compiler = byte_compiler_without(cache_size=2)
    a, b, c = (StructuredSpec("choice", (x,)) for x in ("a", "b", "c"))
    first = compiler.compile(a)
    assert compiler.compile(a) is first and compiler.cached(StructuredSpec("choice", ("a",))) is first
    stats = compiler.stats
    assert stats["compiles"] == 1 and stats["cache_hits"] == 2 and stats["last_compile_s"] > 0
    compiler.compile(b)
    compiler.cached(a)  # a used last: b goes first
    compiler.compile(c)
    assert compiler.cached(b) is None and compiler.cached(a) is first and compiler.cached(c) is not None
    assert compiler.stats["compiles"] == 3 and compiler.stats["cached"] == 2


def test_the_vocabulary_is_read_once():
    pytest.importorskip("outlines_core")
    calls = []
    tok = ByteTokenizer()

    def spelled():
        calls.append(1)
        return token_bytes(tok)

    compiler = ConstraintCompiler(spelled, tok.eos_token_ids, tok.vocab_size, max_words=MIB)
    assert not calls  # nothing until something is compiled
    compiler.compile(StructuredSpec("regex", "a+"))
    compiler.compile(StructuredSpec("regex", "b+"))
    assert len(calls) == 1


# ---------------------------------------------------------------- token bytes

TEXT = 'Hello, wörld! {"a": 1}'


def test_token_bytes_smollm2(smol):
    spelled = token_bytes(smol)
    assert len(spelled) == smol.vocab_size
    assert all(spelled[i] is None for i in smol.special_token_ids())
    ids = smol.encode(TEXT, add_special_tokens=False)
    assert b"".join(spelled[i] for i in ids).decode("utf-8") == TEXT
    # a token may be part of a character: bytes, not text
    assert any(b and not _is_utf8(b) for b in spelled)
    rng = np.random.default_rng(1)
    ordinary = sorted(set(range(smol.vocab_size)) - smol.special_token_ids())
    for _ in range(200):
        ids = rng.choice(ordinary, size=6).tolist()
        joined = b"".join(spelled[i] for i in ids).decode("utf-8", errors="replace")
        assert joined == smol.decode(ids), ids


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_token_bytes_byte_tokenizer():
    tok = ByteTokenizer()
    spelled = token_bytes(tok)
    assert len(spelled) == tok.vocab_size and spelled[65] == b"A" and spelled[255] == b"\xff"
    assert spelled[256:] == [None] * (tok.vocab_size - 256)
    assert b"".join(spelled[i] for i in tok.encode(TEXT, add_special_tokens=False)).decode() == TEXT


@pytest.mark.parametrize("decoder", ["sequence", "metaspace"])
def test_token_bytes_sentencepiece(decoder):
    """A SentencePiece "▁" is a space, <0xNN> a byte where the decoder has ByteFallback; the
    decoder's strip of the first space is not applied."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    if decoder == "sequence":  # Llama-2's tokenizer.json, and gguf_tokenizer's
        tk.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tk.decoder = decoders.Metaspace()
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials + [f"<0x{b:02X}>" for b in range(256)],
        initial_alphabet=list("abcdefghijklmnopqrstuvwxyz"),
    )
    tk.train_from_iterator(["hello world, the cat sat on the mat", "wörld of Hello"] * 5, trainer=trainer)
    # as in Llama-2's tokenizer.json: the <0xNN> byte tokens are in the model's vocabulary only,
    # not among the special added tokens
    data = json.loads(tk.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if not t["content"].startswith("<0x")]
    tk = Tokenizer.from_str(json.dumps(data))
    tok = HFTokenizer(tk, bos_token_id=1, eos_token_ids=[2])
    spelled = token_bytes(tok)
    assert spelled[0] is None and spelled[1] is None and spelled[2] is None  # specials
    text = "Hello, wörld! 日本 {}"  # 日本 and the punctuation only as <0xNN> bytes
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tk.id_to_token(i).startswith("<0x") for i in ids)
    # what the decoder makes of the pieces, but for the strip of the first space
    assert b"".join(spelled[i] for i in ids).decode("utf-8") == " " + tok.decode(ids)
    if decoder == "sequence":  # with ByteFallback: <0xNN> is a byte (Metaspace alone spells it)
        assert tok.decode(ids) == text
