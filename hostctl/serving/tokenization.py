"""Tokenization: a generate's prompt as token ids, and the detokenizer that turns its output back
into text.

Used by the frontend thread only, while it accepts a request.  The detokenizers it makes belong
to their requests from then on, and only the completion thread pushes tokens through them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringleader.ipc import protocol
from ringleader.ipc.backend import Detokenizer, ModelInfo


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    max_tokens: int  # the request's, or the rest of the context when it gave none


class Tokenization:
    """The model's tokenizer and chat template as a request sees them; limits: the server's
    protocol.Limits, which bound the prompt and its max_tokens by the context."""

    def __init__(self, model: ModelInfo, limits: protocol.Limits):
        self._model = model
        self._limits = limits

    def prompt(self, r: protocol.GenerateRequest) -> Prompt:
        """The request's prompt ids and its max_tokens; protocol.BadRequest naming the field the
        prompt came from when the model cannot turn it into tokens or it does not fit the context."""
        ids, field = self.prompt_ids(r)
        # None (the rest of the context) becomes an int here: the ring holds one
        max_tokens = protocol.resolve_max_tokens(
            len(ids), r.sampling.max_tokens, self._limits, request_id=r.id, field=field
        )
        return Prompt(ids, max_tokens)

    def new_detokenizer(self, r: protocol.GenerateRequest | None = None) -> Detokenizer | None:
        """A request's own detokenizer, decoding as it asked (skip_special_tokens,
        spaces_between_special_tokens; None: the defaults), or None when the model has no
        tokenizer.  Only a request that asked for other than the defaults passes them on."""
        if self._model.new_detokenizer is None:
            return None
        factory = self._model.new_detokenizer
        if r is None or (r.skip_special_tokens and r.spaces_between_special_tokens):
            return factory()
        return factory(
            skip_special_tokens=r.skip_special_tokens,
            spaces_between_special_tokens=r.spaces_between_special_tokens,
        )

    def prompt_ids(self, r: protocol.GenerateRequest) -> tuple[list[int], str]:
        """(prompt token ids, the field they came from)."""
        model = self._model
        if r.prompt_ids is not None:
            return r.prompt_ids, "prompt_ids"
        if r.messages is not None:
            if model.encode_chat is None:
                raise protocol.BadRequest(
                    r.id, "messages", "this model has no chat template; send prompt or prompt_ids"
                )
            try:
                return self._encode_chat(r), "messages"
            except ValueError as exc:  # the template refused the conversation, or an option
                field = getattr(exc, "field", "messages")  # a ChatTemplateError names its field
                raise protocol.BadRequest(r.id, field, str(exc)) from None
        if model.tokenizer is None:
            raise protocol.BadRequest(r.id, "prompt", "this model has no tokenizer; send prompt_ids")
        assert r.prompt is not None  # the protocol accepts a generate with exactly one of the three
        return model.tokenizer.encode(r.prompt), "prompt"

    def _encode_chat(self, r: protocol.GenerateRequest) -> list[int]:
        """The chat turns' prompt ids, rendered with the request's options (1.9); only those that
        differ from the defaults are passed on."""
        assert r.messages is not None and self._model.encode_chat is not None
        options: dict[str, Any] = {}
        if not r.add_generation_prompt:
            options["add_generation_prompt"] = False
        if r.continue_final_message:
            options["continue_final_message"] = True
        if r.chat_template_kwargs:
            options["template_kwargs"] = r.chat_template_kwargs
        return self._model.encode_chat(r.messages, **options)
