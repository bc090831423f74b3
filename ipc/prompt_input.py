"""A generate's input, judged as the protocol decoder needs: exactly one of `prompt` (text),
`prompt_ids` (token ids) and `messages` (chat turns, ringleader.ipc.chat_turns), within the
server's bounds (its protocol.Limits).  A refusal is an InputError or a ChatTurnsError, each
naming the field, which the decoder turns into its `bad_request`."""

from __future__ import annotations

from typing import Any

from ringleader.ipc.chat_turns import chat_turns
from ringleader.ipc.sampling_params import clipped_repr


class InputError(ValueError):
    """The input refused: `field` (prompt, prompt_ids, messages) and why."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_ids(value: Any, limits: Any) -> list[int]:
    name = "prompt_ids"
    # at most max_context - 1 ids, so a request without max_tokens has room for one token
    max_len = max(1, limits.max_context - 1)
    if not isinstance(value, list):
        raise InputError(name, f"must be an array of ints, got {type(value).__name__}")
    if not 1 <= len(value) <= max_len:
        raise InputError(name, f"must hold 1..{max_len} token ids, got {len(value)}")
    vocab = limits.vocab_size
    for index, token in enumerate(value):
        if not _is_int(token) or not 0 <= token < vocab:
            raise InputError(
                name, f"element {index} must be an int in [0, {vocab}), got {clipped_repr(token)}"
            )
    return value


def prompt_input(obj: dict, limits: Any) -> tuple[str | None, list[int] | None, list[dict[str, str]] | None]:
    """(prompt, prompt_ids, messages) of a generate map, exactly one of them set (nil counts as
    absent); `limits`: the server's protocol.Limits (max_prompt_chars, max_messages,
    max_context, vocab_size)."""
    prompt, prompt_ids, messages = obj.get("prompt"), obj.get("prompt_ids"), obj.get("messages")
    given = [
        name
        for name, v in (("prompt", prompt), ("prompt_ids", prompt_ids), ("messages", messages))
        if v is not None
    ]
    if len(given) > 1:
        raise InputError(
            given[0], f"give exactly one of prompt, prompt_ids and messages, not {' and '.join(given)}"
        )
    if not given:
        raise InputError(
            "prompt",
            "one of prompt (str), prompt_ids (array of ints) or messages (array of maps) is required",
        )
    if messages is not None:
        return None, None, chat_turns(messages, limits.max_messages, limits.max_prompt_chars)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InputError("prompt", f"must be a str, got {type(prompt).__name__}")
        if not 1 <= len(prompt) <= limits.max_prompt_chars:
            raise InputError(
                "prompt", f"must be a str of 1..{limits.max_prompt_chars} characters, got {len(prompt)}"
            )
        return prompt, None, None
    return None, _prompt_ids(prompt_ids, limits), None
