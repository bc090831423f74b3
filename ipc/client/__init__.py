"""The client library: the sync `Client` and the asyncio `AsyncClient`, I/O shells around one
sans-I/O core (core.ClientCore), with the DEALER socket set up in one place (connection)."""

from ringleader.ipc.client.async_client import AsyncClient, AsyncStream
from ringleader.ipc.client.core import (
    DEFAULT_ADDRESS,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_REPLY_TIMEOUT_S,
    ERR_BAD_REPLY,
    ERR_CLIENT_CLOSED,
    ERR_DISCONNECTED,
    Choice,
    ChoiceEnd,
    Done,
    TokenChunk,
    TokenLogprob,
)
from ringleader.ipc.client.prompt_tokens import PromptTokens
from ringleader.ipc.client.sync_client import Client, Stream
from ringleader.ipc.structured import StructuredError, StructuredSpec
from ringleader.ipc.tokenize_ops import Tokenized, TokenizeError

__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_REPLY_TIMEOUT_S",
    "ERR_BAD_REPLY",
    "ERR_CLIENT_CLOSED",
    "ERR_DISCONNECTED",
    "AsyncClient",
    "AsyncStream",
    "Choice",
    "ChoiceEnd",
    "Client",
    "Done",
    "PromptTokens",
    "Stream",
    "StructuredError",
    "StructuredSpec",
    "TokenChunk",
    "TokenLogprob",
    "TokenizeError",
    "Tokenized",
]
