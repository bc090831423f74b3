"""Tokenizers: a byte-level one for presets, a wrapper over HF `tokenizers` for checkpoints
(and for GGUF files, via ringleader.device.text.gguf_tokenizer), chat-template encoding (encode_chat, templates
in ringleader.device.text.chat_template), and an incremental detokenizer for streaming output.

Which tokenizer goes with a model spec is ringleader.device.model.presets.tokenizer_for (presets know
their names; this module knows no model).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ringleader.device.text.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from ringleader.ipc.backend import TextEncoder
from ringleader.ipc.install_hint import install_hint


class Tokenizer(TextEncoder, Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    chat_template: ChatTemplate | None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]: ...

    def special_token_ids(self) -> set[int]: ...


def _no_template() -> ChatTemplateError:
    return ChatTemplateError("this model has no chat template: send a plain prompt instead of messages")


class ByteTokenizer:
    """Token i < 256 is byte i; 256 = BOS, 257 = EOS, 258 = PAD.

    vocab_size is 264, i.e. 259 rounded up to a multiple of 8 (friendlier matmul shapes);
    ids 259..263 are unused and decode to nothing.
    """

    BOS = 256
    EOS = 257
    PAD = 258
    vocab_size = 264

    def __init__(self) -> None:
        self.bos_token_id: int | None = self.BOS
        self.eos_token_ids: list[int] = [self.EOS]
        self.pad_token_id = self.PAD
        self.chat_template: ChatTemplate | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS] + ids if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The bytes of the rendered chat (ChatTemplate.render's options), after BOS (presets
        have a template only from `serve --chat-template`)."""
        if self.chat_template is None:
            raise _no_template()
        text = self.chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        # no text spells BOS in a byte vocabulary (bos_token renders as nothing): it is added as
        # a plain prompt gets it
        return self.encode(text)

    def special_token_ids(self) -> set[int]:
        return {self.BOS, self.EOS, self.PAD}


def _token_content(tok) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _read_chat_template(model_dir: Path, tcfg: Mapping[str, Any]) -> str | None:
    """The default chat template of a checkpoint, as transformers finds it: chat_template.jinja
    beside tokenizer_config.json wins; else tokenizer_config.json's `chat_template`, a string or a
    list of {name, template} of which "default" is taken."""
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    tmpl = tcfg.get("chat_template")
    if isinstance(tmpl, list):
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
    return tmpl if isinstance(tmpl, str) and tmpl.strip() else None


class HFTokenizer:
    """Wraps an in-memory `tokenizers.Tokenizer` plus what the checkpoint says around it.

    Built by from_dir (a checkpoint's tokenizer.json + tokenizer_config.json) or by
    ringleader.device.text.gguf_tokenizer.tokenizer_from_gguf (a GGUF's metadata).

    BOS handling follows transformers: `add_bos` True/False (tokenizer_config.json's
    `add_bos_token`, Llama-2 / Mistral style, or a GGUF's flag) decides; None leaves it to the
    tokenizer's post-processor (Llama-3's tokenizer.json adds <|begin_of_text|>, Qwen2's nothing).
    `add_eos` is only applied when `add_bos` is not None (as before).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos: bool | None = None,
        add_eos: bool = False,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: list[int] = [int(i) for i in eos_token_ids]
        self._add_bos: bool | None = add_bos
        self._add_eos: bool = bool(add_eos)
        self.chat_template: ChatTemplate | None = chat_template

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> HFTokenizer:
        """model_dir/tokenizer.json, with bos/eos, add_bos_token/add_eos_token and the chat
        template from tokenizer_config.json (or chat_template.jinja) when present."""
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError as e:  # optional dependency (the hf extra)
            raise ImportError(f"HFTokenizer needs the `tokenizers` package: {install_hint('hf')}") from e
        model_dir = Path(model_dir)
        tok = _HFTok.from_file(str(model_dir / "tokenizer.json"))
        tcfg: dict = {}
        tcfg_path = model_dir / "tokenizer_config.json"
        if tcfg_path.exists():
            tcfg = json.loads(tcfg_path.read_text(encoding="utf-8"))

        def lookup(token: str | None) -> int | None:
            return None if token is None else tok.token_to_id(token)

        eos = lookup(_token_content(tcfg.get("eos_token")))
        source = _read_chat_template(model_dir, tcfg)
        return cls(
            tok,
            bos_token_id=lookup(_token_content(tcfg.get("bos_token"))),
            eos_token_ids=[] if eos is None else [eos],
            add_bos=tcfg.get("add_bos_token"),
            add_eos=bool(tcfg.get("add_eos_token", False)),
            chat_template=load_chat_template(source, str(model_dir)),
        )

    def _lookup(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not add_special_tokens:
            return self._tok.encode(text, add_special_tokens=False).ids
        if self._add_bos is None:
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self._add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if self._add_eos and self.eos_token_ids:
            ids = ids + [self.eos_token_ids[0]]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text the chat template makes of `messages`: by default ending with the
        assistant's turn opener (add_generation_prompt); with continue_final_message (and
        add_generation_prompt False) ending inside the final message, which the model continues;
        template_kwargs: extra template variables (ChatTemplate.render)."""
        if self.chat_template is None:
            raise _no_template()
        return self.chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            template_kwargs=template_kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of render_chat(messages, ...), encoded without adding special tokens (the
        template writes BOS and the turn markers itself), as transformers' apply_chat_template."""
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        return self.encode(text, add_special_tokens=False)

    def special_token_ids(self) -> set[int]:
        """BOS, the EOS ids and every special added token (a GGUF's control tokens, the `special`
        added tokens of a tokenizer.json): the ids a prompt of random ordinary tokens avoids."""
        ids = {self.bos_token_id, *self.eos_token_ids}
        ids |= {i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special}
        return {int(i) for i in ids if i is not None}


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, never emitting half a character.

    push(ids) returns only newly completed text; flush() returns whatever was held back
    (an incomplete UTF-8 tail becomes U+FFFD).

    skip_special_tokens (vLLM's, default True): special tokens leave no text; False spells them
    out.  spaces_between_special_tokens (vLLM's, default True) is kept and changes nothing: both
    tokenizers here decode with the `tokenizers` library (or bytes), which, like transformers'
    fast tokenizers and vLLM's fast detokenizer, has no such option (only transformers' slow
    tokenizers join special tokens with spaces); the byte vocabulary's special ids have no text
    either way.

    The rule: the stream's text ("".join(pushes) + flush()) equals decoding the whole output
    (tokenizer.decode(all ids, skip_special_tokens)); an output that ends inside a character
    ends with U+FFFD, and only flush() emits it. While the decoded text ends in U+FFFD (the last
    token may have left a character unfinished), push() returns "" and waits for more, so a pushed
    chunk never carries a U+FFFD standing for half a character. Tested over a real byte-level
    vocabulary with random ids in tests/test_detokenizer_real_vocab.py.
    """

    def __init__(
        self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._bytes = None
        if isinstance(tokenizer, ByteTokenizer):
            # bytes map 1:1 to tokens, so a streaming UTF-8 codec is exact and O(new tokens)
            self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = 0  # decode window start: a few tokens of context before the unread ones
        self._read = 0  # tokens whose text has been emitted
        self._prev_text = ""  # decode of ids[_prefix:_read]

    def push(self, token_ids: int | Iterable[int]) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if self._bytes is not None:
            data = bytes(int(i) for i in token_ids if 0 <= int(i) < 256)
            return self._bytes.decode(data)
        self._ids.extend(int(i) for i in token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        if self._bytes is not None:
            return self._bytes.decode(b"", final=True)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        dec = lambda ids: self.tokenizer.decode(ids, self.skip_special_tokens)  # noqa: E731
        # Decoding from a window start (not token 0) keeps cost bounded; the window's
        # already-emitted part (_prev_text) is decoded the same way, so leading-space rules
        # (e.g. sentencepiece's strip of the first space) cancel out.
        text = dec(self._ids[self._prefix :])
        if not final and text.endswith("\ufffd"):
            return ""  # last token ends mid-character: wait for the rest of its bytes
        # prev is a prefix of text for all sane decoders; if not, emitted text cannot be
        # taken back, so we still skip len(prev) characters.
        new = text[len(self._prev_text) :]
        just_read = dec(self._ids[self._read :])
        if just_read:
            self._prefix, self._prev_text = self._read, just_read
        else:
            # tokens with no text of their own (skipped specials, a stripped lone space)
            # make a bad window start: keep the old one
            self._prev_text = text
        self._read = len(self._ids)
        return new


def load_tokenizer(model_dir: str | Path | None):
    """ByteTokenizer for None (presets); for a checkpoint directory an HFTokenizer when it
    has tokenizer.json, else None."""
    if model_dir is None:
        return ByteTokenizer()
    if (Path(model_dir) / "tokenizer.json").exists():
        return HFTokenizer.from_dir(model_dir)
    return None
