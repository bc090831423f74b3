"""What generate() takes, judged in the caller's process before anything is sent: the request id,
the sampling settings, the output's constraint and the 1.9 request extensions (a bad one is the
caller's mistake, answered at once, rather than a `bad_request` done a round trip later)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ringleader.ipc import protocol as P
from ringleader.ipc.request_extensions import ExtensionError, check_extensions, wire_fields
from ringleader.ipc.sampling_params import WIRE_FIELDS, SamplingParams
from ringleader.ipc.structured import StructuredSpec, structured_from_wire


def check_request_id(request_id: Any) -> None:
    """Ids are checked locally: the server answers a bad id with an id-less error we could not route."""
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise TypeError(f"request_id must be a str or an int, got {type(request_id).__name__}")
    if isinstance(request_id, str) and not 1 <= len(request_id) <= P.Limits().max_id_len:
        raise ValueError(f"request_id must be 1..{P.Limits().max_id_len} characters")
    if isinstance(request_id, int) and not P.INT64_MIN <= request_id <= P.INT64_MAX:
        raise ValueError("request_id int must fit in int64")


def resolve_sampling(sampling: SamplingParams | None, fields: Mapping[str, Any]) -> SamplingParams:
    """generate()'s `sampling=` or its sampling fields as keywords (WIRE_FIELDS) -> one
    SamplingParams, which judges every value against its declaration (SamplingError, a ValueError
    naming the field); what depends on the model and the server (the vocabulary, the max_tokens
    cap) the server judges.  Without max_tokens the request runs to the end of the context (at
    most the server's --default-max-tokens)."""
    unknown = [name for name in fields if name not in WIRE_FIELDS]
    if unknown:
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}")
    if sampling is not None:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if fields:
            raise TypeError(
                f"generate() takes sampling= or sampling fields, not both (got sampling= and {', '.join(fields)})"
            )
        return sampling
    return SamplingParams(**fields)


def resolve_structured(structured: StructuredSpec | Mapping[str, Any] | None) -> StructuredSpec | None:
    """generate()'s `structured=`: a StructuredSpec, or the wire's map ({"json": schema},
    {"regex": pattern}, {"choice": [...]}, {"json_object": True}), judged as the server's decoder
    judges it; a refused one raises StructuredError, a ValueError naming the field
    ("structured.regex: ...")."""
    if structured is None:
        return None
    if isinstance(structured, StructuredSpec):
        # a spec built by hand is judged too, and its schema text made canonical (the cache key)
        structured = structured.wire()
    elif not isinstance(structured, Mapping):
        raise TypeError(
            "structured must be a StructuredSpec or a map such as {'json': schema}, "
            f"got {type(structured).__name__}"
        )
    return structured_from_wire(dict(structured))


def resolve_extensions(messages: Sequence[Mapping[str, Any]] | None, **given: Any) -> dict[str, Any]:
    """generate()'s 1.9 keywords (chat_template_kwargs, add_generation_prompt,
    continue_final_message, skip_special_tokens, spaces_between_special_tokens): those that
    differ from their defaults, which alone go on the wire (an older server reads the rest of
    the frame as before), judged as the server's decoder judges them: an ExtensionError (a
    ValueError naming the field) for a bad value, a chat option without `messages`, or
    continue_final_message with add_generation_prompt true or a final turn not the assistant's."""
    wanted = wire_fields(given)
    for name, value in wanted.items():
        if value is None:  # nil is the default on the wire: a flag given as None is a mistake
            raise ExtensionError(name, "must be true or false, got None")
    if wanted:
        check_extensions(wanted, None if messages is None else list(messages))
    return wanted
