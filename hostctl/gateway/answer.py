"""One generation request answered, without a web framework: the upstream stream of a request
that openai_api.check_request passed, collected into one JSON body or turned into SSE events
(responses.ResponseWriter's bytes) that a transport writes as they come: the aiohttp gateway
(app.py) and the Ray Serve replica (hostctl/ray_serve/) are two such transports.

A request with `n` choices is one upstream stream whose chunks carry their choice's index; each
choice has its own stop strings, and one that matches aborts that choice alone (protocol 1.5)
while the others go on.  An upstream error is the usual APIError before anything was written;
after a stream has started, it is one `data: {"error": ...}` event before `[DONE]`.  A batch of
prompts is one upstream request each, answered together (batched.py).  An echoed prompt
(echo.py) comes first in each choice: its tokens with the request's first message, its text
the request's own (or, for token ids, the server's decoding of them).
"""

from __future__ import annotations

from typing import Any

from ringleader.hostctl.gateway.batched import answer_batch
from ringleader.hostctl.gateway.metrics import GatewayMetrics
from ringleader.hostctl.gateway.openai_api import GenerationRequest
from ringleader.hostctl.gateway.request_answer import AnswerSummary, StreamedAnswer, open_answer
from ringleader.hostctl.gateway.responses import ResponseWriter
from ringleader.ipc.client import AsyncClient

__all__ = ["SSE_HEADERS", "AnswerSummary", "StreamedAnswer", "answer_request"]

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def answer_request(
    client: AsyncClient,
    metrics: GatewayMetrics,
    req: GenerationRequest,
    model_name: str,
    arrived: float,
    summary: AnswerSummary | None = None,
) -> dict[str, Any] | StreamedAnswer:
    """Sends `req` upstream and answers it: the JSON body of a whole answer, or the stream's SSE
    events (a StreamedAnswer the caller iterates and then closes).  An error before the first
    token is an APIError: the transport answers it with its status.  The upstream request's id
    is the response's (`chatcmpl-...`, `cmpl-...`), so the server's log line for it names the
    id the HTTP client got; `summary` is filled in with how the answer went."""
    summary = summary if summary is not None else AnswerSummary()
    if req.batch is not None:
        return await answer_batch(client, metrics, req, model_name, arrived, summary)
    writer = ResponseWriter(req, model_name)
    summary.id = writer.id
    answer, first = await open_answer(client, metrics, req, writer, arrived, summary, writer.id)
    if req.stream:
        return StreamedAnswer(answer, first)
    async with answer.stream:  # leaving it early (an error, a cancelled handler) aborts upstream
        return await answer.collect(first)
