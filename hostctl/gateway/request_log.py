"""The gateway's log: one line per HTTP request, at INFO (GET /health and /metrics, which probes
and scrapers poll, at DEBUG), that can be matched with the client's and the server's:

- the response's id (`chatcmpl-...`, `cmpl-...`), which is also the id of the request the
  gateway sends upstream, so the server's line for it (`request 'cmpl-...' of client ...`,
  hostctl/serving/finisher.py) names it too;
- the request's `X-Request-Id` (one is made when it sent none, or one that is not 1..128
  printable ASCII characters), which every response carries back in its own `X-Request-Id`;
- how each choice ended, by index, when there are several; the usage; TTFT for a stream;
- a refusal's status and reason, a client that went away mid-answer.

    POST /v1/completions 200 cmpl-9f...e1 (X-Request-Id 4a2c): length, 20 prompt + 12 completion tokens, total 41.3 ms
    POST /v1/chat/completions 200 chatcmpl-03...7d (X-Request-Id job-7): choice 0 stop, choice 1 length; 31 prompt + 40 completion tokens, TTFT 12.0 ms, total 88.2 ms
    POST /v1/completions 400 (X-Request-Id 51b0): max_tokens: must be an int in [1, 512], got 10000, total 0.6 ms
"""

from __future__ import annotations

import logging
import re
import uuid

from ringleader.hostctl.gateway.answer import AnswerSummary

log = logging.getLogger("ringleader.gateway")

REQUEST_ID_HEADER = "X-Request-Id"
QUIET_ROUTES = ("/health", "/metrics")  # logged at DEBUG
_GIVEN_ID = re.compile(r"[\x21-\x7e]{1,128}")
MAX_PATH_CHARS = 200


def request_id_of(header: str | None) -> str:
    """The request's X-Request-Id: the client's, or a new one."""
    if header is not None and _GIVEN_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


def request_line(
    method: str,
    raw_path: str,
    status: int | None,
    request_id: str,
    reason: str | None,
    summary: AnswerSummary | None,
    seconds: float,
) -> str:
    """The log line of one request (status None: the client went away before its answer ended)."""
    path = raw_path if len(raw_path) <= MAX_PATH_CHARS else raw_path[: MAX_PATH_CHARS - 3] + "..."
    head = f"{method} {path} {status if status is not None else '-'}"
    if summary is not None and summary.id is not None:
        head += " " + summary.id
    parts = []
    if status is None:
        parts.append("the client went away")
    if reason is not None:
        parts.append(reason)
    elif summary is not None and summary.error is not None:
        parts.append("error " + summary.error)
    elif summary is not None and summary.finish_reasons:
        finishes = summary.finish_reasons
        if len(finishes) == 1:
            told = f"{finishes[0]},"
        else:
            told = ", ".join(f"choice {i} {finish}" for i, finish in enumerate(finishes)) + ";"
        parts.append(f"{told} {summary.prompt_tokens} prompt + {summary.completion_tokens} completion tokens")
    if summary is not None and summary.ttft_s is not None:
        parts.append(f"TTFT {summary.ttft_s * 1000:.1f} ms")
    parts.append(f"total {seconds * 1000:.1f} ms")
    return f"{head} ({REQUEST_ID_HEADER} {request_id}): " + ", ".join(parts)


def log_request(
    route: str,
    method: str,
    raw_path: str,
    status: int | None,
    request_id: str,
    reason: str | None,
    summary: AnswerSummary | None,
    seconds: float,
) -> None:
    """Logs the request's line at INFO, or at DEBUG for the routes probes poll."""
    level = logging.DEBUG if route in QUIET_ROUTES else logging.INFO
    if log.isEnabledFor(level):
        log.log(level, request_line(method, raw_path, status, request_id, reason, summary, seconds))
