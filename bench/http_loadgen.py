"""The HTTP load generator: the bench's workloads against any OpenAI-compatible endpoint.

It runs the same RequestSpec workloads and Loads as bench/loadgen.py (the closed and open
loops are loadgen.run_schedule, shared) and produces the same RequestRecords and RunResult,
so the report, the tables and the plots take its runs unchanged. One aiohttp.ClientSession per
measurement, with a connector of as many connections as the run can have requests in flight,
kept alive between requests and all opened before the clock starts (the ZeroMQ generator's
socket is connected before its clock starts too).

Each request is a streaming POST {url}/v1/completions: the prompt as token ids (or, with
`--http-prompt-text`, as the text the model's tokenizer decodes them to, for servers that take
no ids; with `--http-min-tokens`, min_tokens = max_tokens beside ignore_eos), max_tokens,
temperature, seed (the workload seed + the request's index, as the ZeroMQ generator sends
it), ignore_eos when the workload says so (a vLLM extension), stream_options.include_usage,
and return_token_ids (also vLLM's: each choice carries the ids of its chunk's tokens). The
bodies are encoded before the clock starts. The reply is Server-Sent Events, parsed by
splitting the byte stream on blank lines, one json.loads per event:

- a chunk with choices: its arrival time (time.perf_counter when the bytes were read) and its
  token count, len(choices[0].token_ids) when the server returns them, else 1 per non-empty
  text chunk (then a chunk that carries several tokens counts as one: the run's
  `token_count` says which way it was counted); choices[0].finish_reason when set;
- the usage chunk (choices []): usage.completion_tokens;
- `data: {"error": {...}}`: the request fails with error.code (error.type when it has no code);
- `data: [DONE]`: the end of the request (its E2E time).

A reply that is not 200 fails the request: 429 -> `overloaded`, 503 -> the body's
error.code (the gateway says `engine_dead` or `shutdown`; `http_503` without one), any other
status -> `http_<status>`; the message keeps the status and the body's message. A broken
connection is `disconnected`, an undecodable event `bad_reply`, a stream that ends with no
finish_reason `incomplete_stream`; a run past its timeout cancels what is left (`timeout`).

HTTP gives no server `stats`: stats_before/after are empty for a foreign server. With
`stats_address` (the ZeroMQ address of the ringleader server behind a gateway) they are read
from there before and after the run, outside the timed region, as bench/loadgen.py does.
The generator's own CPU (getrusage of this process) is measured over the run, as there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from ringleader.bench.loadgen import (
    Load,
    LoadGenerator,
    RunResult,
    SendOptions,
    cpu_seconds_self,
    run_schedule,
    timeline_after_seq,
)
from ringleader.bench.metrics import RequestRecord, summarize
from ringleader.bench.workloads import RequestSpec

log = logging.getLogger("ringleader.bench")

TOKEN_IDS = "token_ids"  # token counts from choices[].token_ids
TEXT_CHUNKS = "text_chunks"  # no token ids from the server: one per non-empty text chunk


@dataclass
class HttpRunResult(RunResult):
    token_count: str | None = None  # TOKEN_IDS, TEXT_CHUNKS, or None when no chunk arrived
    model: str | None = None  # the `model` field sent


def base_url(url: str) -> str:
    """'http://h:p', 'http://h:p/' and 'http://h:p/v1' all name the endpoint 'http://h:p'."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
    return url


def error_code_for(status: int, body_code: object) -> str:
    if status == 429:
        return "overloaded"
    if status == 503 and isinstance(body_code, str) and body_code:
        return body_code  # engine_dead or shutdown, as the gateway says
    return f"http_{status}"


class HttpLoadGenerator:
    """Inside one event loop: `async with HttpLoadGenerator(url) as gen: await gen.measure(...)`."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        connections: int = 100,
        timeout_s: float = 600.0,
        options: SendOptions | None = None,
        stats_address: str | None = None,
        headers: dict | None = None,
        decode: Callable[[list[int]], str] | None = None,
        min_tokens: bool = False,
    ):
        self.url = base_url(url)
        self.decode = decode  # prompts as text (servers that take no token ids: llama.cpp's)
        self.min_tokens = min_tokens  # with ignore_eos, min_tokens = max_tokens too
        self.model = model
        self.connections = max(1, connections)
        self.timeout_s = timeout_s
        self.options = options or SendOptions()
        self.stats_address = stats_address
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.session: aiohttp.ClientSession | None = None
        self.chunks_with_ids = 0  # chunks counted from token_ids
        self.chunks_by_text = 0  # chunks counted as one token for their text
        self._lags: list[float] = []

    async def __aenter__(self) -> HttpLoadGenerator:
        connector = aiohttp.TCPConnector(limit=self.connections, limit_per_host=0)
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0),
        )
        return self

    async def __aexit__(self, *exc) -> None:
        if self.session is not None:
            await self.session.close()

    # ---- the endpoint -------------------------------------------------------------------------
    async def models(self) -> list[str]:
        """The ids GET /v1/models lists."""
        async with self.session.get(self.url + "/v1/models") as resp:
            body = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {self.url}/v1/models: HTTP {resp.status}: {body[:300]!r}")
        return [m["id"] for m in json.loads(body).get("data", []) if isinstance(m, dict) and "id" in m]

    async def open_connections(self, k: int) -> None:
        """Opens k keep-alive connections (k GET /v1/models at once, their answers ignored), so
        that no measured request waits for a TCP connect: the ZeroMQ generator's one socket is
        connected before its clock starts too."""

        async def one() -> None:
            try:
                async with self.session.get(self.url + "/v1/models") as resp:
                    await resp.read()
            except aiohttp.ClientError:
                pass

        await asyncio.gather(*(one() for _ in range(min(k, self.connections))))

    async def stats(self, timeline_after_seq: int | None = None) -> dict:
        """The ringleader server's stats over ZeroMQ when stats_address is set, else {}."""
        if not self.stats_address:
            return {}
        async with LoadGenerator(self.stats_address) as gen:
            return await gen.stats(timeline_after_seq=timeline_after_seq)

    # ---- a measured run -------------------------------------------------------------------------
    async def measure(
        self, specs: list[RequestSpec], load: Load, warmup: list[RequestSpec] | None = None
    ) -> HttpRunResult:
        """Warm-up (excluded), stats, the run, stats again (as LoadGenerator.measure)."""
        if self.model is None:
            ids = await self.models()
            if not ids:
                raise RuntimeError(f"GET {self.url}/v1/models lists no model; give one (--http-model)")
            self.model = ids[0]
        warmup_failed = 0
        if warmup:
            conc = max(1, min(len(warmup), load.concurrency or len(warmup)))
            recs = await self.run(warmup, Load(concurrency=conc))
            warmup_failed = sum(1 for r in recs if not r.ok)
        await self.open_connections(load.concurrency or len(specs))
        before = await self.stats()
        self.chunks_with_ids = self.chunks_by_text = 0
        cpu0, t0 = cpu_seconds_self(), time.perf_counter()
        records = await self.run(specs, load)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds_self() - cpu0
        after = await self.stats(timeline_after_seq(before))
        lag = summarize(self._lags, scale=1e3) if load.concurrency is None else {}
        if self.chunks_with_ids:
            counted = TOKEN_IDS if not self.chunks_by_text else f"{TOKEN_IDS}+{TEXT_CHUNKS}"
        else:
            counted = TEXT_CHUNKS if self.chunks_by_text else None
        return HttpRunResult(records, before, after, cpu, wall, lag, warmup_failed, counted, self.model)

    async def run(self, specs: list[RequestSpec], load: Load) -> list[RequestRecord]:
        """Sends every spec (closed or open loop) and waits for the end of every stream (or the timeout)."""
        records = [RequestRecord(i, len(s.prompt_ids), s.max_tokens) for i, s in enumerate(specs)]
        bodies = [self._body(s, i) for i, s in enumerate(specs)]
        tasks: dict[int, asyncio.Task] = {}
        loop = asyncio.get_running_loop()

        def send(i: int, finished) -> None:
            tasks[i] = loop.create_task(self._request(records[i], bodies[i], finished))

        self._lags = []
        try:
            await run_schedule(len(specs), load, send, self.timeout_s, self._lags)
        finally:
            await self._give_up(tasks, records)
        return records

    async def _give_up(self, tasks: dict[int, asyncio.Task], records: list[RequestRecord]) -> None:
        """Requests still open (timeout) are cancelled (their connection closed) and count as failed."""
        open_tasks = [t for t in tasks.values() if not t.done()]
        for t in open_tasks:
            t.cancel()
        if open_tasks:
            await asyncio.gather(*open_tasks, return_exceptions=True)
        for i, rec in enumerate(records):
            if i not in tasks:
                rec.finish_reason, rec.error_code = "error", "not_sent"
            elif rec.done_t is None and rec.error_code is None:
                rec.finish_reason, rec.error_code = "error", "timeout"

    def _body(self, spec: RequestSpec, index: int) -> bytes:
        o = self.options
        body = {
            "model": self.model,
            "prompt": spec.prompt_ids if self.decode is None else self.decode(list(spec.prompt_ids)),
            "max_tokens": spec.max_tokens,
            "temperature": o.temperature,
            "seed": (o.seed + index) % (1 << 63),
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if o.ignore_eos:
            body["ignore_eos"] = True
            if self.min_tokens:  # what servers without ignore_eos take (llama-cpp-python's)
                body["min_tokens"] = spec.max_tokens
        if body["model"] is None:
            del body["model"]
        return json.dumps(body, separators=(",", ":")).encode()

    async def _request(self, rec: RequestRecord, body: bytes, finished) -> None:
        cancelled = False
        try:
            rec.send_t = time.perf_counter()
            async with self.session.post(
                self.url + "/v1/completions", data=body, headers=self.headers
            ) as resp:
                if resp.status != 200:
                    self._http_error(rec, resp.status, await resp.read())
                    return
                await self._read_stream(rec, resp)
        except asyncio.CancelledError:
            cancelled = True
            raise
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as exc:
            self._fail(rec, "disconnected", f"{type(exc).__name__}: {exc}")
        except ValueError as exc:  # json.JSONDecodeError and malformed chunks
            self._fail(rec, "bad_reply", f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            log.exception("HTTP load generator failed on a request")
            self._fail(rec, "client_error", f"{type(exc).__name__}: {exc}")
        finally:
            if not cancelled:
                finished()

    async def _read_stream(self, rec: RequestRecord, resp: aiohttp.ClientResponse) -> None:
        buf = b""
        ended = False
        async for data in resp.content.iter_any():
            t = time.perf_counter()
            if buf:
                data = buf + data
            if b"\r" in data:
                data = data.replace(b"\r\n", b"\n")
            start = 0
            while True:
                end = data.find(b"\n\n", start)
                if end < 0:
                    break
                if self._event(rec, data[start:end], t):
                    ended = True
                start = end + 2
            buf = data[start:]
        if buf.strip() and not ended:  # a last event without its blank line
            ended = self._event(rec, buf.strip(b"\n"), time.perf_counter())
        if rec.done_t is None:
            rec.done_t = time.perf_counter()
        if rec.finish_reason is None:
            self._fail(rec, "incomplete_stream", "the stream ended without a finish_reason")

    def _event(self, rec: RequestRecord, block: bytes, t: float) -> bool:
        """One SSE event; True for [DONE]."""
        if block.startswith(b"data: ") and b"\n" not in block:
            payload = block[6:]
        else:  # several lines, comments, event names: only the data lines count
            parts = []
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    parts.append(line[6:] if line.startswith(b"data: ") else line[5:])
            if not parts:
                return False
            payload = b"\n".join(parts)
        if payload == b"[DONE]":
            if rec.done_t is None:
                rec.done_t = t
            return True
        msg = json.loads(payload)
        err = msg.get("error")
        if err is not None:
            err = err if isinstance(err, dict) else {"message": str(err)}
            code = err.get("code") or err.get("type") or "error"
            self._fail(rec, str(code), str(err.get("message") or ""))
            return False
        choices = msg.get("choices")
        if choices:
            choice = choices[0]
            ids = choice.get("token_ids")
            if ids is not None:
                k = len(ids)
                self.chunks_with_ids += 1
            else:
                k = 1 if choice.get("text") else 0
                self.chunks_by_text += k
            rec.chunk_t.append(t)
            rec.chunk_n.append(k)
            reason = choice.get("finish_reason")
            if reason is not None and rec.error_code is None:
                rec.finish_reason = reason
        usage = msg.get("usage")
        if usage:
            rec.completion_tokens = int(usage.get("completion_tokens") or 0)
        return False

    def _http_error(self, rec: RequestRecord, status: int, body: bytes) -> None:
        err: dict = {}
        try:
            parsed = json.loads(body)
            if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
                err = parsed["error"]
        except ValueError:
            pass
        message = err.get("message") or body[:300].decode("utf-8", errors="replace")
        code = err.get("code")
        detail = f"HTTP {status}" + (f" ({code})" if code else "") + f": {message}"
        self._fail(rec, error_code_for(status, code), detail)

    @staticmethod
    def _fail(rec: RequestRecord, code: str, message: str) -> None:
        if rec.done_t is None:
            rec.done_t = time.perf_counter()
        if rec.error_code is None:  # the first error is the one that counts
            rec.finish_reason, rec.error_code, rec.error_message = "error", code, message


def connections_for(load: Load, n_specs: int) -> int:
    """Connections a run can use at once: its concurrency, or every request of an open loop."""
    return max(1, load.concurrency if load.concurrency is not None else n_specs)


def measure_http(
    url: str,
    specs: list[RequestSpec],
    load: Load,
    *,
    warmup: list[RequestSpec] | None = None,
    options: SendOptions | None = None,
    timeout_s: float = 600.0,
    model: str | None = None,
    stats_address: str | None = None,
    decode: Callable[[list[int]], str] | None = None,
    min_tokens: bool = False,
) -> HttpRunResult:
    """Synchronous wrapper: one event loop and one ClientSession for the whole measurement
    (decode: send each prompt as this text of its ids)."""

    async def go() -> HttpRunResult:
        async with HttpLoadGenerator(
            url,
            model=model,
            connections=connections_for(load, len(specs)),
            timeout_s=timeout_s,
            options=options,
            stats_address=stats_address,
            decode=decode,
            min_tokens=min_tokens,
        ) as gen:
            return await gen.measure(specs, load, warmup)

    return asyncio.run(go())


def list_models(url: str) -> list[str]:
    """GET {url}/v1/models: the ids of the models served."""

    async def go() -> list[str]:
        async with HttpLoadGenerator(url, connections=1) as gen:
            return await gen.models()

    return asyncio.run(go())
