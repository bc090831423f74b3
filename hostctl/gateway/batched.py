"""A batch of prompts in one /v1/completions request (prompts.py), answered as OpenAI's legacy API
and vLLM answer it: each prompt is a request of its own upstream, all sent at once, and the
answer is one: prompt i's choice j is choice `i * n + j`, the usage is the prompts' sum, and a
stream interleaves their chunks as they come, each with that index, ending with one usage chunk
(when asked) and one [DONE].

A prompt that fails before its first token fails the whole request, as vLLM's does: the others
are aborted and the answer is that prompt's error, told with its place (`prompt[2]: ...`, param
`prompt`).  A stream starts once every prompt has its first token; a prompt's error after that
is the stream's last event, as a single prompt's is.  Prompt i's upstream request is
`<response id>-<i>`, so the server's log lines name the response they belong to."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from ringleader.hostctl.gateway.metrics import GatewayMetrics
from ringleader.hostctl.gateway.openai_api import APIError, GenerationRequest
from ringleader.hostctl.gateway.request_answer import (
    AnswerSummary,
    RequestAnswer,
    StreamedAnswer,
    open_answer,
)
from ringleader.hostctl.gateway.responses import SSE_DONE, ResponseWriter, new_response_id
from ringleader.ipc.client import AsyncClient, Done, TokenChunk

T = TypeVar("T")
# the upstream's names of the prompt, whose refusals are the prompt's own fault
_PROMPT_FIELDS = ("prompt", "prompt_ids")


async def answer_batch(
    client: AsyncClient,
    metrics: GatewayMetrics,
    req: GenerationRequest,
    model_name: str,
    arrived: float,
    summary: AnswerSummary,
) -> dict[str, Any] | StreamedAnswer:
    """answer.answer_request's answer to a request whose `batch` holds several prompts."""
    assert req.batch is not None
    response_id = new_response_id(req.chat)
    summary.id = response_id
    n = req.sampling.n
    opening: list[Awaitable[tuple[RequestAnswer, TokenChunk | Done]]] = []
    parts: list[AnswerSummary] = []
    for i, (prompt, prompt_ids) in enumerate(req.batch):
        one = dataclasses.replace(req, prompt=prompt, prompt_ids=prompt_ids, batch=None)
        writer = ResponseWriter(one, model_name, response_id=response_id, index_base=i * n)
        upstream_id = f"{response_id}-{i}"
        part = AnswerSummary(id=upstream_id)
        parts.append(part)
        opening.append(open_answer(client, metrics, one, writer, arrived, part, upstream_id))
    opened = await _every(opening, lambda got: got[0].stream.aclose())
    for answer, _first in opened:
        answer.part = True
    if req.stream:
        writer = ResponseWriter(req, model_name, response_id=response_id)
        return BatchStream(opened, writer, metrics, summary, parts, arrived)
    bodies = await _every([_collect(answer, first) for answer, first in opened], _nothing)
    _summarize(summary, parts)
    choices = [choice for body in bodies for choice in body["choices"]]
    usage = {key: sum(body["usage"][key] for body in bodies) for key in bodies[0]["usage"]}
    return {**bodies[0], "choices": choices, "usage": usage}


async def _collect(answer: RequestAnswer, first: TokenChunk | Done) -> dict[str, Any]:
    async with answer.stream:  # cancelled (a sibling failed): aborts upstream
        return await answer.collect(first)


async def _nothing(_: Any) -> None:
    return None


async def _every(awaitables: list[Awaitable[T]], release: Callable[[T], Awaitable[None]]) -> list[T]:
    """Every result, run together; once one fails (or the caller is cancelled) the others are
    cancelled, the results that came are released, and the first failure by prompt is raised,
    told with the prompt's place."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for i, task in enumerate(tasks):
            error = task.exception() if task.done() else None
            if isinstance(error, APIError):
                raise in_batch(i, error) from None
            if error is not None:
                raise error
        return [task.result() for task in tasks]
    except BaseException:
        for task in tasks:
            task.cancel()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if not isinstance(result, BaseException):
                await release(result)
        raise


def in_batch(i: int, error: APIError) -> APIError:
    """Prompt i's error as the batch's answer tells it: a refusal of the prompt itself names it
    (`prompt[i]: ...`, param `prompt`); any other error keeps its field, with the prompt's place."""
    head, sep, rest = error.message.partition(": ")
    param: str | None = "prompt"
    if sep and head in _PROMPT_FIELDS:
        message = f"prompt[{i}]: {rest}"
    else:
        message, param = f"{error.message} (prompt[{i}] of the batch)", error.param
    return APIError(error.status, message, type=error.type, param=param, code=error.code)


def _summarize(summary: AnswerSummary, parts: list[AnswerSummary]) -> None:
    """The batch's log line: its choices in index order, the prompts' tokens summed."""
    summary.finish_reasons = [reason for part in parts for reason in part.finish_reasons]
    summary.prompt_tokens = sum(part.prompt_tokens for part in parts)
    summary.completion_tokens = sum(part.completion_tokens for part in parts)
    summary.error = next((part.error for part in parts if part.error), None)
    ttfts = [part.ttft_s for part in parts if part.ttft_s is not None]
    summary.ttft_s = min(ttfts) if ttfts else None


class BatchStream(StreamedAnswer):
    """The SSE events of a batch: its prompts' streams (each a RequestAnswer in part mode: no
    usage, no [DONE], its error kept) merged as their chunks come."""

    def __init__(
        self,
        opened: list[tuple[RequestAnswer, TokenChunk | Done]],
        writer: ResponseWriter,
        metrics: GatewayMetrics,
        summary: AnswerSummary,
        parts: list[AnswerSummary],
        arrived: float,
    ):
        self._answers = [answer for answer, _first in opened]
        self._streams = [StreamedAnswer(answer, first) for answer, first in opened]
        self._writer, self._metrics, self._summary, self._parts = writer, metrics, summary, parts
        self._arrived = arrived
        self._chunks = self._merged()

    async def _merged(self) -> AsyncGenerator[bytes, None]:
        pending: dict[asyncio.Future[bytes], int] = {}

        def ask(i: int) -> None:
            pending[asyncio.ensure_future(self._streams[i].__aiter__().__anext__())] = i

        for i in range(len(self._streams)):
            ask(i)
        counted = False  # the batch's first token, counted once
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=pending.__getitem__):
                    i = pending.pop(future)
                    try:
                        chunk = future.result()
                    except StopAsyncIteration:
                        error = self._answers[i].error
                        if error is not None:  # the stream's last event; the others are aborted
                            _summarize(self._summary, self._parts)
                            yield ResponseWriter.error_event(in_batch(i, error))
                            yield SSE_DONE
                            return
                        continue
                    yield chunk
                    if not counted and self._parts[i].ttft_s is not None:
                        counted = True
                        self._metrics.first_token_written(time.perf_counter() - self._arrived)
                    ask(i)
            _summarize(self._summary, self._parts)
            summary = self._summary
            if self._writer.req.include_usage:
                yield self._writer.usage_chunk(summary.prompt_tokens, summary.completion_tokens)
            yield SSE_DONE
        finally:
            for future in pending:
                future.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def aclose(self) -> None:
        await self._chunks.aclose()
        for stream in self._streams:
            await stream.aclose()
