"""The OpenAI-compatible HTTP gateway: a client of a ringleader server, over the wire protocol."""
