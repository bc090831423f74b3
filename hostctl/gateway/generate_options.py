"""vLLM's request extensions that are no sampling field: how the messages become the prompt
(`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`: chat only), how
tokens become text (`skip_special_tokens`, `spaces_between_special_tokens`), and whether a
matched stop string stays in the text (`include_stop_str_in_output`, honoured by the gateway
itself: stop strings are matched here, stop_strings.py).  vLLM's `min_tokens` is a sampling
field, declared with the others (ringleader.ipc.sampling_params) and read with them.

The first five are AsyncClient.generate's keywords of the same names.  A request carries only
those that differ from their defaults, so one that leaves them alone asks nothing new of the
server (an older one reads the frame as before)."""

from __future__ import annotations

from typing import Any

from ringleader.hostctl.gateway.errors import bad
from ringleader.ipc.request_extensions import CHAT_FIELDS, DEFAULTS
from ringleader.ipc.sampling_params import clipped_repr

INCLUDE_STOP = "include_stop_str_in_output"
CHAT_OPTIONS = (*DEFAULTS, INCLUDE_STOP)
COMPLETIONS_OPTIONS = tuple(name for name in CHAT_OPTIONS if name not in CHAT_FIELDS)


def _flag(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {clipped_repr(value)}")
    return value


def generate_options(body: dict, *, chat: bool) -> tuple[dict[str, Any], bool]:
    """(generate()'s keywords the body sets to other than their defaults, whether a matched stop
    string stays in the text); a 400 naming the field for a value of the wrong type, a chat
    option on /v1/completions, or continue_final_message with add_generation_prompt."""
    if not chat:
        for name in CHAT_FIELDS:
            if body.get(name) is not None:
                raise bad(
                    name,
                    "shapes how chat messages become the prompt: /v1/chat/completions takes it, "
                    "/v1/completions does not",
                )
    options: dict[str, Any] = {}
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise bad(
                "chat_template_kwargs",
                f"must be an object of the chat template's variables, got {clipped_repr(kwargs)}",
            )
        if kwargs:
            options["chat_template_kwargs"] = kwargs
    for name, default in DEFAULTS.items():  # generate()'s keywords, vLLM's defaults
        if name == "chat_template_kwargs":
            continue
        value = _flag(body, name)
        if value is not None and value != default:
            options[name] = value
    if options.get("continue_final_message") and options.get("add_generation_prompt", True):
        raise bad(
            "continue_final_message",
            "cannot be true while add_generation_prompt is true (its default): the final message "
            "is continued, not answered; send add_generation_prompt: false with it",
        )
    return options, bool(_flag(body, INCLUDE_STOP))
