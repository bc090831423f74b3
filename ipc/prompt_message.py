"""The prompt message (protocol 1.10, docs/protocol.md): what a request with prompt_logprobs gets
first, its prompt as the server tokenized it and the prompt's logprobs as columns (a prompt of
any length costs a handful of maps and lists in a frame); and those columns back as one entry
per prompt token, the shape of a `logprobs` entry, for a client that wants them so.
ringleader.ipc.protocol re-exports both."""

from __future__ import annotations

from typing import Any

OP_TOKEN = "token"  # protocol.OP_TOKEN (protocol imports this module: no import back)
RequestId = str | int  # protocol.RequestId


def prompt_msg(
    id: RequestId,
    token_ids: list[int],
    logprobs: dict,
    tokens: list[str] | None = None,
    text: str | None = None,
    index: int | None = None,
) -> dict:
    """(1.10) The first message of a request with prompt_logprobs: a `token` message with no
    token ids carrying its prompt as the server tokenized it, the prompt's logprobs as columns
    (prompt_logprob_columns), and with a tokenizer each prompt token's text and the prompt's."""
    msg: dict[str, Any] = {
        "op": OP_TOKEN, "id": id, "token_ids": [], "prompt_token_ids": list(token_ids), "prompt_logprobs": logprobs,
    }  # fmt: skip
    if tokens is not None:
        msg["prompt_tokens"] = tokens
    if text is not None:
        msg["prompt_text"] = text
    if index is not None:
        msg["index"] = index
    return msg


def prompt_logprob_entries(msg: dict) -> list[dict | None]:
    """A prompt message's `prompt_logprobs` columns as one entry per prompt token, the shape of
    a `logprobs` entry (nil for the first token, which nothing before it predicts)."""
    cols = msg["prompt_logprobs"]
    k, lps = int(cols["n_top"]), cols["logprob"]
    out: list[dict | None] = [None]
    for i in range(1, len(lps)):
        at = slice((i - 1) * k, i * k)
        entry = {"logprob": lps[i], "top_ids": cols["top_ids"][at], "top_logprobs": cols["top_logprobs"][at]}
        if "top_tokens" in cols:
            entry["token"] = msg["prompt_tokens"][i]
            entry["top_tokens"] = cols["top_tokens"][at]
        out.append(entry)
    return out
