"""A generate's chat turns (`messages`, protocol 1.2), judged as the protocol decoder needs:
a non-empty array of {role, content} maps, each with an optional name, within the server's
bounds.  The model's template, on the server, judges their order.  A refusal is a
ChatTurnsError naming the field (`messages`, `messages[2].role`, ...), which the decoder turns
into its `bad_request` (as ringleader.ipc.sampling_params does for the sampling fields)."""

from __future__ import annotations

from typing import Any

from ringleader.ipc.sampling_params import clipped_repr

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class ChatTurnsError(ValueError):
    """A turn refused: `field` as the request names it, and why."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def chat_turns(value: Any, max_messages: int, max_chars: int) -> list[dict[str, str]]:
    """The turns of `value`, each {role, content} and its name if given; ChatTurnsError unless
    it is an array of 1..max_messages turns holding at most max_chars characters of content."""
    if not isinstance(value, list) or not 1 <= len(value) <= max_messages:
        raise ChatTurnsError(
            "messages", f"must be an array of 1..{max_messages} maps, got {clipped_repr(value)}"
        )
    out: list[dict[str, str]] = []
    chars = 0
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatTurnsError(where, f"must be a map with role and content, got {clipped_repr(m)}")
        unknown = sorted(str(k) for k in m if k not in ("role", "content", "name"))
        if unknown:
            raise ChatTurnsError(where, f"unknown field {unknown[0]!r} (allowed: role, content, name)")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise ChatTurnsError(
                f"{where}.role", f"must be one of {sorted(CHAT_ROLES)}, got {clipped_repr(role)}"
            )
        if not isinstance(content, str):
            raise ChatTurnsError(f"{where}.content", f"must be a str, got {clipped_repr(content)}")
        turn = {"role": role, "content": content}
        if "name" in m:
            if not isinstance(m["name"], str) or not 1 <= len(m["name"]) <= 256:
                raise ChatTurnsError(
                    f"{where}.name", f"must be a str of 1..256 characters, got {clipped_repr(m['name'])}"
                )
            turn["name"] = m["name"]
        chars += len(content)
        out.append(turn)
    if chars > max_chars:
        raise ChatTurnsError("messages", f"hold {chars} characters of content, limit is {max_chars}")
    return out
