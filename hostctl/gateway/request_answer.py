"""One upstream request's answer (answer.py's, or one prompt's of a batch, batched.py): its stream
opened (open_answer), then collected into one JSON body or turned into SSE events.  Each choice
has its own stop strings; an echoed prompt comes first in each choice (echo.py)."""

from __future__ import annotations

import collections
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ringleader.hostctl.gateway.echo import PromptEcho, add_prompt_logprobs, echo_refusal
from ringleader.hostctl.gateway.metrics import GatewayMetrics
from ringleader.hostctl.gateway.openai_api import APIError, GenerationRequest, bad
from ringleader.hostctl.gateway.responses import SSE_DONE, ChoiceAnswer, ResponseWriter
from ringleader.hostctl.gateway.stop_strings import StopMatcher
from ringleader.ipc import protocol as P
from ringleader.ipc.client import AsyncClient, AsyncStream, Done, TokenChunk, TokenizeError
from ringleader.ipc.client.core import ChoiceEnd

END_EARLY_WAIT_S = 5.0  # a stop string aborts upstream; its `done` (the usage) is awaited this long
DECODE_WAIT_S = 30.0  # the echo of a prompt of token ids: its text is asked of the server, this long


@dataclass
class AnswerSummary:
    """What a log line tells of one answer, filled in as it goes (the gateway logs it)."""

    id: str | None = None  # the response's id, which is also the upstream request's id
    finish_reasons: list[str | None] = field(default_factory=list)  # by choice index
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # streams: arrival to the first token's bytes
    error: str | None = None  # the upstream's code and message, when it ended in error

    def ended(self, finish_reasons: list[str | None], prompt_tokens: int, completion_tokens: int) -> None:
        self.finish_reasons = finish_reasons
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens


async def open_answer(
    client: AsyncClient,
    metrics: GatewayMetrics,
    req: GenerationRequest,
    writer: ResponseWriter,
    arrived: float,
    summary: AnswerSummary,
    request_id: str,
) -> tuple[RequestAnswer, TokenChunk | Done]:
    """Sends `req` upstream as `request_id`: its answer and the stream's first event, the
    prompt's echo learnt; an APIError for an error before the first token (the stream aborted)."""
    try:
        stream = await client.generate(
            req.prompt,
            prompt_ids=req.prompt_ids,
            messages=req.messages,
            sampling=req.sampling,
            priority=req.priority,
            structured=req.structured,
            request_id=request_id,
            **req.generate_options,
        )
    except (ValueError, TypeError) as exc:  # the request does not fit one frame, say
        raise _refused_by_client(exc, req) from None
    answer = RequestAnswer(metrics, req, writer, stream, arrived, summary)
    try:
        first = await _next_event(stream)
        if isinstance(first, Done) and not first.ok:
            raise answer.upstream_error(first)
        await answer.learn_prompt(first, client)
    except BaseException:  # an error, a cancelled handler: abort upstream
        await stream.aclose()
        raise
    return answer, first


def _refused_by_client(exc: Exception, req: GenerationRequest) -> APIError:
    """A 400 for what the client refused before sending (a value, the frame's size), told as the
    server would tell it, and naming the field (`exc.field` where it has one) as the request did."""
    told = APIError.from_upstream(P.ERR_BAD_REQUEST, str(exc), req.structured_param)
    field = getattr(exc, "field", None)
    param = told.param if told.param is not None or not isinstance(field, str) else field
    return APIError(400, told.message, param=param)


class StreamedAnswer:
    """The SSE events of a streamed answer, as bytes: `async for chunk in answer`, then
    `await answer.aclose()` whatever happened (leaving early aborts the request upstream)."""

    def __init__(self, answer: RequestAnswer, first: TokenChunk | Done):
        self._answer = answer
        sampling = answer.req.sampling
        self._chunks: AsyncGenerator[bytes, None]
        if sampling.n == 1 and sampling.logprobs is None:
            self._chunks = answer.stream_one(first)
        else:
            self._chunks = answer.stream_choices(first)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks

    async def aclose(self) -> None:
        await self._chunks.aclose()
        await self._answer.stream.aclose()


async def _next_event(stream: AsyncStream) -> TokenChunk | Done:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        assert stream.done is not None
        return stream.done


class RequestAnswer:
    """The answer to one request from its open upstream stream, in one of three shapes: whole
    (collect), the common request's stream (stream_one) or a stream of choices (stream_choices);
    each takes the stream's first event."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        req: GenerationRequest,
        writer: ResponseWriter,
        stream: AsyncStream,
        arrived: float,
        summary: AnswerSummary,
    ):
        self.metrics = metrics
        self.summary = summary
        self.req = req
        self.writer = writer
        self.stream = stream
        self.arrived = arrived
        self.done: Done | None = None  # the upstream `done`, once _live_chunks ended
        self.failed = False  # that `done` is an error to answer with
        self.echo: PromptEcho | None = None  # the prompt as the answer shows it (echo, prompt_logprobs)
        self._held: collections.deque[TokenChunk | Done] = collections.deque()  # read ahead for it
        self.part = False  # one prompt of a batch: batched.py ends the stream, and tells its error
        self.error: APIError | None = None  # a part's upstream error, for batched.py to tell

    def upstream_error(self, done: Done) -> APIError:
        self.metrics.upstream_error(done.error_code or "unknown")
        self.summary.error = f"{done.error_code or 'unknown'}: {done.error_message or ''}"
        error = APIError.from_upstream(done.error_code, done.error_message, self.req.structured_param)
        return error if self.req.prompt_logprobs_asked else echo_refusal(error)

    async def learn_prompt(self, first: TokenChunk | Done, client: AsyncClient) -> None:
        """The prompt as the answer shows it, from its first event on: the server sends its
        tokens with choice 0's first message, so the events of other choices that came before it
        are held for _next; a prompt of token ids is echoed as the server decodes them."""
        req = self.req
        if not (req.echo or req.prompt_logprobs_asked):
            return
        event = first
        while req.sampling.prompt_logprobs is not None and self.stream.prompt is None:
            if not isinstance(event, TokenChunk):
                break  # the `done` without them: an older server's, say
            event = await _next_event(self.stream)
            self._held.append(event)
        prompt = self.stream.prompt
        text = req.prompt
        if text is None and prompt is not None and prompt.text is not None:
            text = prompt.text
        elif text is None and req.echo:
            try:
                text = await client.detokenize(req.prompt_ids or [], timeout=DECODE_WAIT_S)
            except TokenizeError as exc:
                raise bad("echo", f"the prompt's token ids could not be decoded: {exc}") from None
            except (TimeoutError, ConnectionError) as exc:
                raise APIError(503, f"echo: the prompt's text: {exc}", type="service_unavailable") from None
        self.echo = PromptEcho(text or "", prompt)

    def _choice_answers(self, keep: bool) -> list[ChoiceAnswer]:
        """The choices' answers, each starting with the echoed prompt (its text, and its tokens'
        logprobs with logprobs) when the request echoes it."""
        req, echo = self.req, self.echo
        if not req.echo or echo is None:
            return [ChoiceAnswer(index, req, keep=keep) for index in range(req.sampling.n)]
        legacy = echo.legacy_logprobs() if req.sampling.logprobs is not None else None
        return [
            ChoiceAnswer(index, req, keep=keep, echo_text=echo.text, echo_logprobs=legacy)
            for index in range(req.sampling.n)
        ]

    async def _next(self) -> TokenChunk | Done:
        return self._held.popleft() if self._held else await _next_event(self.stream)

    # ---- whole ----------------------------------------------------------------------------
    async def collect(self, item: TokenChunk | Done) -> dict[str, Any]:
        req, writer = self.req, self.writer
        n = req.sampling.n
        answers = self._choice_answers(keep=True)
        async for answer, event in self._live_chunks(answers, item):
            answer.take(event)
            if event.finish_reason is not None and not answer.ended:
                answer.end(event.finish_reason)
        done = self.done
        if done is not None and self.failed:
            raise self.upstream_error(done)
        ends = _choice_ends(done, n)
        completion = 0
        choices = []
        for answer in answers:
            end = ends.get(answer.index)
            if not answer.ended:
                assert done is not None  # a choice still going ends only with the `done`
                answer.end(end.finish_reason if end is not None else done.finish_reason)
            assert answer.finish_reason is not None
            tokens = answer.completion_tokens(end)
            completion += tokens
            choices.append(
                writer.choice(
                    answer.index,
                    "".join(answer.texts),
                    answer.token_ids[:tokens],
                    answer.finish_reason,
                    answer.logprobs(tokens),
                )
            )
        prompt_tokens = done.prompt_tokens if done is not None else 0
        self.metrics.usage(prompt_tokens, completion)
        self.summary.ended([a.finish_reason for a in answers], prompt_tokens, completion)
        body = writer.response(choices, prompt_tokens, completion)
        if req.prompt_logprobs_asked:
            add_prompt_logprobs(body, self.echo, req.chat)
        return body

    # ---- streamed -------------------------------------------------------------------------
    async def stream_one(self, item: TokenChunk | Done) -> AsyncGenerator[bytes, None]:
        """The stream of the common request, one choice without logprobs: a token's chunk is
        the writer's prebuilt prefix and suffix around its text."""
        req, writer = self.req, self.writer
        if req.chat:
            yield writer.role_chunk()
        if req.echo and self.echo is not None:
            yield writer.token_chunk(self.echo.text, [])
        matcher = (
            StopMatcher(req.stop, include=req.include_stop_str_in_output, min_tokens=req.sampling.min_tokens)
            if req.stop
            else None
        )
        sent = 0  # tokens received so far
        first_written = False
        while isinstance(item, TokenChunk):
            sent += len(item.token_ids)
            text = item.text or ""
            if matcher is not None:
                text = matcher.push(text, sent)
            if text or (req.return_token_ids and item.token_ids):
                yield writer.token_chunk(text, item.token_ids)
                if not first_written:
                    first_written = True
                    self._first_token_written()
            if matcher is not None and matcher.matched:
                break
            item = await self._next()
        if isinstance(item, Done):
            done: Done | None = item
            if matcher is not None:
                tail = matcher.flush()
                if tail:
                    yield writer.token_chunk(tail, [])
            if not item.ok:
                for chunk in self._error_end(item):
                    yield chunk
                return
            finish, completion = item.finish_reason, item.completion_tokens
            yield writer.finish_chunk(finish)
        else:  # a stop string matched: finish now, then learn the usage
            finish = "stop"
            yield writer.finish_chunk(finish)
            done = await self._end_early()
            completion = sent
        prompt_tokens = done.prompt_tokens if done is not None else 0
        for chunk in self._usage_end([finish], prompt_tokens, completion):
            yield chunk

    async def stream_choices(self, item: TokenChunk | Done) -> AsyncGenerator[bytes, None]:
        """The stream of a request with n > 1 or logprobs: each choice's chunks with its index
        (and logprobs), a finish chunk when it ends; a stop string ends only its own choice."""
        req, writer = self.req, self.writer
        n = req.sampling.n
        answers = self._choice_answers(keep=False)
        if req.chat:
            for answer in answers:
                yield writer.role_chunk(answer.index)
        if req.echo and self.echo is not None:
            legacy = self.echo.legacy_logprobs() if req.sampling.logprobs is not None else None
            for answer in answers:
                yield writer.choice_chunk(answer.index, self.echo.text, [], legacy)
        tokens_shown = req.return_token_ids or req.sampling.logprobs is not None
        first_written = False
        async for answer, event in self._live_chunks(answers, item):
            text, logprobs = answer.take(event)
            if text or (tokens_shown and event.token_ids):
                yield writer.choice_chunk(answer.index, text, event.token_ids, logprobs)
                if not first_written:
                    first_written = True
                    self._first_token_written()
            if answer.stopped:
                yield writer.finish_chunk("stop", answer.index)
            elif event.finish_reason is not None and event.finish_reason != P.FINISH_ERROR:
                for chunk in self._choice_end(answer, event.finish_reason):
                    yield chunk
            elif event.finish_reason is not None:  # the `done` tells the error
                answer.finish_reason = event.finish_reason
        done = self.done
        if done is not None and self.failed:
            for answer in answers:  # the text held back was generated: it goes out first
                if not answer.ended:
                    tail = answer.end(P.FINISH_ERROR)
                    if tail:
                        yield writer.choice_chunk(answer.index, tail, [], None)
            for chunk in self._error_end(done):
                yield chunk
            return
        ends = _choice_ends(done, n)
        completion = 0
        for answer in answers:
            end = ends.get(answer.index)
            if not answer.ended:
                assert done is not None  # a choice still going ends only with the `done`
                finish = end.finish_reason if end is not None else done.finish_reason
                for chunk in self._choice_end(answer, finish):
                    yield chunk
            completion += answer.completion_tokens(end)
        prompt_tokens = done.prompt_tokens if done is not None else 0
        for chunk in self._usage_end([a.finish_reason for a in answers], prompt_tokens, completion):
            yield chunk

    def _choice_end(self, answer: ChoiceAnswer, finish_reason: str) -> list[bytes]:
        """The last chunks of a choice: the text its stop matcher held back, then its finish."""
        tail = answer.end(finish_reason)
        chunks = [self.writer.choice_chunk(answer.index, tail, [], None)] if tail else []
        return chunks + [self.writer.finish_chunk(finish_reason, answer.index)]

    def _error_end(self, done: Done) -> list[bytes]:
        error = self.upstream_error(done)
        if self.part:  # the batch tells it, naming the prompt
            self.error = error
            return []
        return [ResponseWriter.error_event(error), SSE_DONE]

    def _first_token_written(self) -> None:
        self.summary.ttft_s = time.perf_counter() - self.arrived
        if not self.part:  # a batch's first token is the batch's to count
            self.metrics.first_token_written(self.summary.ttft_s)

    def _usage_end(
        self, finish_reasons: list[str | None], prompt_tokens: int, completion_tokens: int
    ) -> list[bytes]:
        self.metrics.usage(prompt_tokens, completion_tokens)
        self.summary.ended(finish_reasons, prompt_tokens, completion_tokens)
        if self.part:  # the batch ends the stream, with the usage of all its prompts
            return []
        usage = [self.writer.usage_chunk(prompt_tokens, completion_tokens)] if self.req.include_usage else []
        return usage + [SSE_DONE]

    # ---- choices ---------------------------------------------------------------------------
    async def _live_chunks(
        self, answers: list[ChoiceAnswer], event: TokenChunk | Done
    ) -> AsyncIterator[tuple[ChoiceAnswer, TokenChunk]]:
        """Each chunk of a choice still going, with its answer (the caller takes it, and may end
        the choice); chunks still in flight for a choice that ended here are dropped.  It stops at
        the `done`, or once every choice ended (then the `done` is awaited, bounded): either way
        the `done` is in self.done, and self.failed says whether it is an error to answer with."""
        n = len(answers)
        while isinstance(event, TokenChunk):
            if 0 <= event.index < n and not answers[event.index].ended:
                answer = answers[event.index]
                yield answer, event
                if answer.ended and await self._every_choice_ended(answers, answer):
                    self.done = await self._done_after_choices(answers)
                    # a single choice's stop string: the `done` is its abort's, whatever it says
                    self.failed = self.done is not None and not self.done.ok and not _ended_early(answers)
                    return
            event = await self._next()
        self.done, self.failed = event, not event.ok

    # ---- ending choices -------------------------------------------------------------------
    async def _end_early(self) -> Done | None:
        """A stop string matched: abort upstream as a stop (the server counts it as one, protocol
        1.3) and wait (bounded) for the `done` with usage."""
        await self.stream.abort(finish_reason="stop")
        return await self._rest()

    async def _rest(self) -> Done | None:
        """The `done` with usage, awaited (bounded) past the tokens still in flight."""
        try:
            return await self.stream.wait(timeout=END_EARLY_WAIT_S)
        except TimeoutError:
            return None

    async def _done_after_choices(self, answers: list[ChoiceAnswer]) -> Done | None:
        """Every choice ended for the gateway before the `done` came: a single choice's stop
        string ends the request as before; several choices each ended already upstream, or
        were aborted one by one."""
        if _ended_early(answers):
            return await self._end_early()
        return await self._rest()

    async def _every_choice_ended(self, answers: list[ChoiceAnswer], answer: ChoiceAnswer) -> bool:
        """`answer` just ended for the gateway: True once every choice did (then
        _done_after_choices).  A stop string ends a single choice's request whole; with several,
        only its choice is aborted upstream and the others go on."""
        if _ended_early(answers):
            return True
        if answer.stopped:
            await self.stream.abort(finish_reason="stop", index=answer.index)
        return all(a.ended for a in answers)


def _ended_early(answers: list[ChoiceAnswer]) -> bool:
    """A stop string ended a single choice's request: its `done` is the abort's, whatever it says."""
    return len(answers) == 1 and answers[0].stopped


def _choice_ends(done: Done | None, n: int) -> dict[int, ChoiceEnd]:
    """How each choice ended upstream, by index: the `done`'s list, or a single choice's `done`."""
    if done is None:
        return {}
    if done.choices is not None:
        return {end.index: end for end in done.choices}
    if n == 1:
        return {0: ChoiceEnd(0, done.finish_reason, done.completion_tokens)}
    return {}
