"""The gateway's errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: a
refusal of the gateway's own (`bad`, a 400 naming the field) or a ringleader `done`'s error
turned into its HTTP status (APIError.from_upstream).  openai_api re-exports them."""

from __future__ import annotations

from typing import Any

from ringleader.ipc import protocol as P
from ringleader.ipc.structured import WIRE_FIELD as STRUCTURED_WIRE_FIELD

# protocol error code -> (HTTP status, OpenAI error type)
STATUS_OF_CODE: dict[str, tuple[int, str]] = {
    P.ERR_BAD_REQUEST: (400, "invalid_request_error"),
    P.ERR_OVERLOADED: (429, "rate_limit_error"),
    P.ERR_ENGINE_DEAD: (503, "service_unavailable"),
    P.ERR_SHUTDOWN: (503, "service_unavailable"),
    "disconnected": (503, "service_unavailable"),  # the gateway lost its upstream server
    P.ERR_TIMEOUT: (504, "timeout"),
}
# the server's field names where the OpenAI request used another
PARAM_OF_FIELD = {"prompt_ids": "prompt"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_upstream(
        cls, code: str | None, message: str | None, structured_param: str | None = None
    ) -> APIError:
        """The error of a ringleader `done`: its code picks the status; a bad_request names its
        field first ("field: ..."), which becomes `param`.  structured_param: the request's field
        that gave the constraint, which replaces the wire's name ("structured.json") in both."""
        status, kind = STATUS_OF_CODE.get(code or "", (500, "server_error"))
        text = message or code or "unknown error"
        param = None
        if code == P.ERR_BAD_REQUEST and ":" in text:
            head = text.split(":", 1)[0]
            if structured_param and head.split(".", 1)[0] == STRUCTURED_WIRE_FIELD:
                param = structured_param_of(head, structured_param)
                text = param + text[len(head) :]
            elif head.isidentifier():
                param = PARAM_OF_FIELD.get(head, head)
        return cls(status, text, type=kind, param=param, code=code)


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def unavailable(message: str, code: str) -> APIError:
    """A 503: the model is loading (code `loading`), or the upstream cannot be reached."""
    return APIError(503, message, type="service_unavailable", code=code)


def structured_param_of(wire_field: str, source: str) -> str:
    """The request's name of a field the wire's `structured` names ("structured.regex"): the same
    key under structured_outputs, else the field that gave the constraint."""
    if source == "structured_outputs":
        return source + wire_field[len(STRUCTURED_WIRE_FIELD) :]
    return source
