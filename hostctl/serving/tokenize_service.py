"""The server's half of protocol 1.10's tokenizer ops (ipc/tokenize_ops.py): each answered at once,
on the frontend thread, with the reply op that carries its id.

`tokenize` makes the ids a generate of the same input runs on: a prompt through the model's
tokenizer, chat turns through its chat template with the same options, both by
Tokenization's own path (tokenization.py), so a count here is the `usage.prompt_tokens` of a
generate; unlike a generate, a prompt longer than the context is counted, not refused (vLLM's
/tokenize does the same), and the reply's `max_context` tells the client where the limit is.
`add_special_tokens: false` encodes a prompt's text alone.  `detokenize` decodes ids with a fresh
detokenizer of the model (special tokens spelled out unless asked), `tokenizer_info` reads the
tokenizer's special tokens and the chat template's source.

Used by the frontend thread only (as Tokenization is)."""

from __future__ import annotations

from typing import Any

from ringleader.hostctl.serving.tokenization import Tokenization
from ringleader.ipc import protocol
from ringleader.ipc import tokenize_ops as ops
from ringleader.ipc.backend import ModelInfo
from ringleader.ipc.sampling_params import SamplingParams


class TokenizeService:
    def __init__(self, model: ModelInfo, tokenization: Tokenization, limits: protocol.Limits):
        self._model = model
        self._tokenization = tokenization
        self._limits = limits

    def answer(self, request: ops.TokenizeOp) -> bytes:
        """The encoded reply to one tokenizer op: its answer, or its refusal naming the field."""
        if isinstance(request, ops.RefusedOp):
            return self._refused(request.op, request.id, request.message)
        try:
            if isinstance(request, ops.TokenizeRequest):
                return protocol.encode(self._tokenize(request))
            if isinstance(request, ops.DetokenizeRequest):
                return protocol.encode(self._detokenize(request))
            return protocol.encode(ops.info_reply(request.id, self.info()))
        except protocol.BadRequest as exc:
            op = ops.OP_TOKENIZE if isinstance(request, ops.TokenizeRequest) else ops.OP_DETOKENIZE
            return self._refused(op, request.id, exc.message)

    @staticmethod
    def _refused(op: str, rid: Any, message: str) -> bytes:
        return protocol.encode(ops.refusal_reply(op, rid, protocol.ERR_BAD_REQUEST, message))

    def _tokenize(self, r: ops.TokenizeRequest) -> dict:
        tokenizer = self._model.tokenizer
        if r.prompt is not None and r.add_special_tokens is False:
            if tokenizer is None:
                raise protocol.BadRequest(r.id, "prompt", "this model has no tokenizer")
            ids = tokenizer.encode(r.prompt, add_special_tokens=False)
        else:
            ids = self._as_generate(r)
        token_strs = None
        if r.return_token_strs:
            token_text = self._model.token_text
            if token_text is None:
                raise protocol.BadRequest(r.id, "return_token_strs", "this model has no tokenizer")
            token_strs = [token_text(i) for i in ids]
        return ops.tokens_reply(r.id, list(ids), self._model.max_context, token_strs)

    def _as_generate(self, r: ops.TokenizeRequest) -> list[int]:
        """The ids a generate of r's input would run on, by the very path a generate takes
        (Tokenization.prompt_ids: the tokenizer for a prompt, the chat template for messages);
        an empty prompt, which a generate refuses, encodes as the tokenizer makes it."""
        generate = protocol.GenerateRequest(
            r.id,
            r.prompt,
            None,
            SamplingParams(),
            messages=r.messages,
            chat_template_kwargs=r.chat_template_kwargs,
            add_generation_prompt=r.add_generation_prompt,
            continue_final_message=r.continue_final_message,
        )
        ids, _field = self._tokenization.prompt_ids(generate)
        return ids

    def _detokenize(self, r: ops.DetokenizeRequest) -> dict:
        factory = self._model.new_detokenizer
        if factory is None:
            raise protocol.BadRequest(r.id, "token_ids", "this model has no tokenizer to decode them with")
        detokenizer = factory(skip_special_tokens=r.skip_special_tokens)
        return ops.text_reply(r.id, detokenizer.push(r.token_ids) + detokenizer.flush())

    def info(self) -> dict[str, Any]:
        """What a client needs to know of the tokenizer: its special tokens (ids and texts, nil
        where the model has none), the chat template's source, the context and the vocabulary."""
        model = self._model
        tokenizer, token_text = model.tokenizer, model.token_text
        bos = getattr(tokenizer, "bos_token_id", None)
        pad = getattr(tokenizer, "pad_token_id", None)
        template = getattr(tokenizer, "chat_template", None) if model.encode_chat is not None else None

        def text(token_id: int | None) -> str | None:
            return None if token_id is None or token_text is None else token_text(token_id)

        return {
            "tokenizer": tokenizer is not None,
            "max_context": model.max_context,
            "vocab_size": model.vocab_size,
            "bos_token_id": bos,
            "bos_token": text(bos),
            "eos_token_ids": list(model.eos_token_ids),
            "eos_token": text(model.eos_token_ids[0]) if model.eos_token_ids else None,
            "pad_token_id": pad,
            "pad_token": text(pad),
            "chat_template": getattr(template, "source", None),
        }
