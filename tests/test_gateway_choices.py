"""The gateway's `logprobs` and `n` (protocol 1.5): the request fields, the exact OpenAI shapes of
chat's and completions' logprobs, streamed and not, several choices with their own stop strings
(against a scripted upstream, so each path is driven on purpose).  End to end:
test_gateway_choices_e2e.py."""

from __future__ import annotations

import json
import math
from collections import deque
from typing import Any

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ringleader.hostctl.gateway.app import BackgroundGateway
from ringleader.hostctl.gateway.openai_api import APIError, GenerationRequest, parse_request
from ringleader.hostctl.gateway.responses import (
    LOGPROB_FLOOR,
    ChoiceAnswer,
    ResponseWriter,
    chat_logprobs_content,
    completion_logprobs,
)
from ringleader.ipc import protocol as P
from ringleader.ipc.client.core import ChoiceEnd, Done, TokenChunk, TokenLogprob
from ringleader.ipc.sampling_params import SamplingParams

PROMPT_IDS = list(range(40, 60))


def completion(**body):
    return parse_request({"model": "m", "prompt": "hi", **body}, chat=False)


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_request({"model": "m", **body}, chat=True)


def refusal(parse, **body) -> APIError:
    with pytest.raises(APIError) as info:
        parse(**body)
    assert info.value.status == 400
    return info.value


def sse_json(chunk: bytes) -> dict:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    return json.loads(chunk[6:])


def entry(token: str | None, logprob: float, tops: list[tuple[int, str | None, float]]) -> TokenLogprob:
    texts = [t for _, t, _ in tops]
    return TokenLogprob(
        logprob,
        [i for i, _, _ in tops],
        [v for _, _, v in tops],
        token,
        None if any(t is None for t in texts) else texts,  # type: ignore[misc]
    )


# ---------------------------------------------------------------- the request


def test_n_and_logprobs_are_accepted():
    s = chat(logprobs=True, top_logprobs=5, n=3).sampling
    assert (s.n, s.logprobs) == (3, 5)
    assert chat(logprobs=True).sampling.logprobs == 0  # the chosen token's alone
    assert chat(logprobs=False).sampling.logprobs is None and chat().sampling.logprobs is None
    s = completion(logprobs=5, n=2).sampling
    assert (s.n, s.logprobs) == (2, 5)
    assert completion(logprobs=0).sampling.logprobs == 0
    assert completion(best_of=1, echo=False).sampling.n == 1


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"best_of": 3}, "best_of", "send n"),
        ({"best_of": 2, "n": 2}, "best_of", "not supported"),
        ({"echo": 1}, "echo", "true or false"),
        ({"max_tokens": 0}, "max_tokens", "goes with echo"),  # generates nothing, scores nothing
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"logprobs": True}, "logprobs", "[0, 20]"),
        ({"n": 0}, "n", "[1, 128]"),
        ({"n": 129}, "n", "[1, 128]"),
        ({"n": True}, "n", "[1, 128]"),
        ({"top_logprobs": 2}, "top_logprobs", "unknown field"),  # chat's field
    ],
)
def test_completion_refusals(body, param, words):
    err = refusal(completion, **body)
    assert err.param == param and words in err.message


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        ({"logprobs": 2}, "logprobs", "true or false"),
        ({"n": 200}, "n", "[1, 128]"),
        ({"best_of": 2}, "best_of", "unknown field"),  # a completions field
    ],
)
def test_chat_refusals(body, param, words):
    err = refusal(chat, **body)
    assert err.param == param and words in err.message


# ---------------------------------------------------------------- the shapes


def test_chat_logprobs_entries_have_openais_fields():
    entries = [
        entry("Hé", -0.25, [(7, "Hé", -0.25), (8, " x", -1.5)]),
        entry(None, -math.inf, [(9, None, -0.1), (3, None, float("nan"))]),  # no tokenizer
    ]
    content = chat_logprobs_content([7, 3], entries)
    assert content[0] == {
        "token": "Hé",
        "logprob": -0.25,
        "bytes": [72, 195, 169],
        "top_logprobs": [
            {"token": "Hé", "logprob": -0.25, "bytes": [72, 195, 169]},
            {"token": " x", "logprob": -1.5, "bytes": [32, 120]},
        ],
    }
    # vLLM's name of a token without text; JSON has no -Infinity or NaN
    assert content[1]["token"] == "token_id:3" and content[1]["logprob"] == LOGPROB_FLOOR
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["token_id:9", "token_id:3"]
    assert content[1]["top_logprobs"][1]["logprob"] == LOGPROB_FLOOR
    json.dumps(content, allow_nan=False)
    # logprobs: true without top_logprobs: the chosen token alone
    assert chat_logprobs_content([5], [entry("a", -1.0, [])])[0]["top_logprobs"] == []


def test_completion_logprobs_are_the_legacy_shape():
    entries = [
        entry("ab", -0.5, [(1, "ab", -0.5), (2, "c", -1.0)]),
        entry("d", -3.0, [(4, "e", -0.2), (5, "f", -0.9)]),  # sampled outside the top 2
    ]
    legacy = completion_logprobs([1, 3], entries, 10)
    assert legacy == {
        "tokens": ["ab", "d"],
        "token_logprobs": [-0.5, -3.0],
        # the alternatives and the chosen token (up to logprobs + 1 entries, as OpenAI's legacy API)
        "top_logprobs": [{"ab": -0.5, "c": -1.0}, {"e": -0.2, "f": -0.9, "d": -3.0}],
        "text_offset": [10, 12],
    }
    assert completion_logprobs([3], [entry(None, -1.0, [])], 0)["top_logprobs"] == [{"token_id:3": -1.0}]


@pytest.mark.parametrize("is_chat", [False, True])
def test_the_general_chunk_is_the_fast_paths_bytes_without_logprobs(is_chat):
    req = GenerationRequest(chat=is_chat, model=None, return_token_ids=True)
    w = ResponseWriter(req, 'mo"del')
    text = 'quote " newline \n unicode é \u2028'
    assert w.choice_chunk(0, text, [1, 2], None) == w.token_chunk(text, [1, 2])
    assert sse_json(w.choice_chunk(2, text, [1], None))["choices"][0]["index"] == 2


def test_chat_chunks_and_answer_shapes():
    req = chat(logprobs=True, top_logprobs=1, n=2, stream=True)
    w = ResponseWriter(req, "m")
    content = chat_logprobs_content([7], [entry("a", -0.5, [(7, "a", -0.5)])])
    role = sse_json(w.role_chunk(1))
    assert role["choices"] == [
        {"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    chunk = sse_json(w.choice_chunk(1, "a", [7], {"content": content, "refusal": None}))
    assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == w.id
    assert chunk["choices"] == [
        {
            "index": 1,
            "delta": {"content": "a"},
            "logprobs": {"content": content, "refusal": None},
            "finish_reason": None,
        }
    ]
    parsed = ChatCompletionChunk.model_validate(chunk)
    top = parsed.choices[0].logprobs.content[0].top_logprobs[0]
    assert (top.token, top.logprob, top.bytes) == ("a", -0.5, [97])
    finish = sse_json(w.finish_chunk("length", 1))["choices"]
    assert finish == [{"index": 1, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    whole = w.response(
        [
            w.choice(0, "a", [7], "stop", {"content": content, "refusal": None}),
            w.choice(1, "b", [8], "length", {"content": [], "refusal": None}),
        ],
        4,
        2,
    )
    assert whole["object"] == "chat.completion" and whole["usage"]["total_tokens"] == 6
    assert whole["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "a"},
        "logprobs": {"content": content, "refusal": None},
        "finish_reason": "stop",
    }
    assert ChatCompletion.model_validate(whole).choices[1].finish_reason == "length"


def test_completion_chunk_and_answer_shapes():
    req = completion(logprobs=1, stream=True)
    w = ResponseWriter(req, "m")
    legacy = completion_logprobs([7], [entry("a", -0.5, [(7, "a", -0.5)])], 3)
    chunk = sse_json(w.choice_chunk(0, "a", [7], legacy))
    assert chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 0, "text": "a", "logprobs": legacy, "finish_reason": None}]
    assert chunk["choices"][0]["logprobs"] == {
        "tokens": ["a"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"a": -0.5}],
        "text_offset": [3],
    }
    whole = w.response([w.choice(0, "a", [7], "length", legacy)], 1, 1)
    assert Completion.model_validate(whole).choices[0].logprobs.text_offset == [3]


def chunk_of(index: int, texts: list[str | None], first_id: int = 1, **extra: Any) -> TokenChunk:
    ids = list(range(first_id, first_id + len(texts)))
    logprobs = [entry(t, -0.5, [(i, t, -0.5)]) for i, t in zip(ids, texts)]
    text = None if all(t is None for t in texts) else "".join(t or "" for t in texts)
    return TokenChunk(ids, text, index, logprobs, **extra)


def test_completion_text_offsets_continue_across_chunks():
    answer = ChoiceAnswer(0, completion(logprobs=0, stream=True), keep=False)
    _, first = answer.take(chunk_of(0, ["ab", "c"]))
    _, second = answer.take(chunk_of(0, ["de"]))
    assert first is not None and second is not None
    assert first["text_offset"] == [0, 2] and second["text_offset"] == [3]
    # a token whose bytes are not whole characters yet: its chunk's text is empty, its name not
    partial = TokenChunk([9], "", 0, [entry("\ufffd", -1.0, [])])
    _, third = answer.take(partial)
    _, fourth = answer.take(chunk_of(0, ["é"]))
    assert third is not None and fourth is not None
    assert third["text_offset"] == [5] and fourth["text_offset"] == [5]  # offsets in the text
    # without a tokenizer the names' lengths add up
    bare = ChoiceAnswer(0, completion(logprobs=0), keep=True)
    bare.take(chunk_of(0, [None, None], first_id=5))
    bare.take(chunk_of(0, [None], first_id=7))
    assert bare.logprobs(3)["text_offset"] == [0, 10, 20]  # type: ignore[index]


def test_a_stop_string_ends_its_choice_and_the_kept_logprobs_are_the_counted_tokens():
    answer = ChoiceAnswer(1, completion(logprobs=0, stop=["XY"]), keep=True)
    assert answer.take(chunk_of(1, ["ab", "X"]))[0] == "ab"  # "X" held back
    assert not answer.ended
    text, logprobs = answer.take(chunk_of(1, ["Yz"], first_id=3))
    assert text == "" and answer.stopped and answer.finish_reason == "stop"
    assert logprobs is not None and logprobs["tokens"] == ["Yz"]
    # the answer is its tokens through the stop, as its token ids and usage count them
    end = ChoiceEnd(1, "stop", 9)  # the server's count includes the tokens in flight
    assert answer.completion_tokens(end) == 3 == len(answer.token_ids)
    assert answer.logprobs(3)["tokens"] == ["ab", "X", "Yz"]  # type: ignore[index]
    assert "".join(answer.texts) == "ab"
    plain = ChoiceAnswer(0, chat(stop="q"), keep=True)
    plain.take(TokenChunk([1], "a"))
    assert plain.end("length") == "" and plain.finish_reason == "length"
    assert plain.completion_tokens(ChoiceEnd(0, "length", 1)) == 1 and plain.logprobs(1) is None


# ---------------------------------------------------------------- a scripted upstream


class ScriptedStream:
    """An upstream stream as the server 1.5 sends it: each choice's tokens in turn, a choice's
    last chunk with its finish_reason (n > 1), one done with the summed usage.  An abort of a
    choice lets `in_flight` more of its tokens come, then its last chunk says "stop"."""

    def __init__(
        self,
        texts: list[list[str]],
        sampling: SamplingParams,
        *,
        in_flight: int,
        error: tuple[str, str] | None = None,
    ):
        self.n = sampling.n
        self.logprobs = sampling.logprobs is not None
        self.pending = {i: deque(t) for i, t in enumerate(texts[: self.n])}
        self.order = deque(range(self.n))
        self.counts = dict.fromkeys(range(self.n), 0)
        self.finishes: dict[int, str] = {}
        self.aborted: dict[int, int] = {}
        self.aborts: list[tuple[str, int | None]] = []
        self.in_flight = in_flight
        self.error = error
        self.done: Done | None = None
        self.next_id = 100

    def __aiter__(self):
        return self

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def aclose(self):
        if self.done is None:
            self.done = Done(P.FINISH_ERROR, 0, 0, "client_closed", "closed")

    async def abort(self, finish_reason: str = "abort", index: int | None = None) -> None:
        self.aborts.append((finish_reason, index))
        for i in range(self.n) if index is None else [index]:
            self.aborted.setdefault(i, self.in_flight)

    async def wait(self, timeout=None) -> Done:
        while self.done is None:
            try:
                await self.__anext__()
            except StopAsyncIteration:
                pass
        return self.done

    def _chunk(self, index: int, finish: str | None) -> TokenChunk:
        text = self.pending[index].popleft()
        self.counts[index] += 1
        self.next_id += 1
        logprobs = [entry(text, -0.25, [(self.next_id, text, -0.25)])] if self.logprobs else None
        return TokenChunk([self.next_id], text, index, logprobs, finish if self.n > 1 else None)

    def _end(self, index: int, finish: str) -> TokenChunk | None:
        self.finishes[index] = finish
        if self.n == 1:
            return None  # a single choice ends with the done
        return TokenChunk([], "", index, [] if self.logprobs else None, finish)

    async def __anext__(self) -> TokenChunk:
        if self.done is not None:
            raise StopAsyncIteration
        while self.order:
            index = self.order.popleft()
            pending = self.pending[index]
            if index in self.aborted:
                if self.aborted[index] > 0 and pending:
                    self.aborted[index] -= 1
                    self.order.append(index)
                    return self._chunk(index, None)
                end = self._end(index, "stop")
                if end is not None:
                    return end
                continue
            if self.error is not None and index == self.n - 1 and len(pending) == 1:
                self.finishes[index] = P.FINISH_ERROR
                continue
            if len(pending) > 1:
                self.order.append(index)
                return self._chunk(index, None)
            self.finishes[index] = "length"
            return self._chunk(index, "length")
        ends = [ChoiceEnd(i, self.finishes[i], self.counts[i]) for i in range(self.n)]
        code, message = self.error or (None, None)
        self.done = Done(
            P.FINISH_ERROR if self.error else ends[0].finish_reason,
            5,
            sum(self.counts.values()),
            code,
            message,
            choices=ends if self.n > 1 else None,
        )
        raise StopAsyncIteration


class ScriptedClient:
    def __init__(self, real):
        self.real = real
        self.texts: list[list[str]] = []
        self.in_flight = 1
        self.error: tuple[str, str] | None = None
        self.streams: list[ScriptedStream] = []

    async def generate(self, *args, sampling: SamplingParams, **kwargs) -> ScriptedStream:
        stream = ScriptedStream(self.texts, sampling, in_flight=self.in_flight, error=self.error)
        self.streams.append(stream)
        return stream

    async def aclose(self):
        await self.real.aclose()


@pytest.fixture(scope="module")
def scripted():
    options = dict(served_model_name="fake", max_model_len=64, has_tokenizer=True)
    with BackgroundGateway("tcp://127.0.0.1:9", **options) as gw:
        client = ScriptedClient(gw.gateway._client)
        gw.gateway._client = client  # type: ignore[assignment]
        yield gw, client


@pytest.fixture
def upstream(scripted):
    gw, client = scripted
    client.texts = [["a", "b", "XY", "c"], ["d", "e"], ["f", "g", "h"]]
    client.in_flight, client.error, client.streams = 1, None, []
    return client


def api(gw: BackgroundGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)


def test_several_choices_are_answered_by_index(scripted, upstream):
    gw, _ = scripted
    r = api(gw).completions.create(
        model="fake", prompt="p", n=3, logprobs=0, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == ["abXYc", "de", "fgh"]
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    assert [c.logprobs.tokens for c in r.choices] == [["a", "b", "XY", "c"], ["d", "e"], ["f", "g", "h"]]
    assert [len(c.model_extra["token_ids"]) for c in r.choices] == [4, 2, 3]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 9)
    assert upstream.streams[0].aborts == []


def test_a_stop_string_ends_only_its_choice(scripted, upstream):
    gw, _ = scripted
    upstream.texts = [["a", "b", "XY", "c", "d"], ["d", "e", "f"], ["f", "g", "h", "i"]]
    r = api(gw).completions.create(
        model="fake", prompt="p", n=3, stop="XY", logprobs=0, extra_body={"return_token_ids": True}
    )
    stream = upstream.streams[0]
    assert stream.aborts == [("stop", 0)]  # that choice alone
    c0, c1, c2 = r.choices
    assert (c0.text, c0.finish_reason) == ("ab", "stop")
    # its tokens through the stop: the one in flight when the abort came is not the answer's
    assert c0.logprobs.tokens == ["a", "b", "XY"] and len(c0.model_extra["token_ids"]) == 3
    assert stream.counts[0] == 4
    assert (c1.text, c2.text) == ("def", "fghi") and c1.finish_reason == c2.finish_reason == "length"
    assert r.usage.completion_tokens == 3 + 3 + 4


def test_streamed_choices_each_open_and_finish(scripted, upstream):
    gw, _ = scripted
    upstream.texts = [["a", "X", "Y", "q", "r"], ["d", "e", "f", "g"]]
    chunks = list(
        api(gw).chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            stop=["XY"],
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    roles = [c.choices[0].index for c in chunks[:2] if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 3 + 4
    by_index: dict[int, list] = {0: [], 1: []}
    for c in body:
        (choice,) = c.choices
        by_index[choice.index].append(choice)
    for index, text, tokens, finish in (
        (0, "a", ["a", "X", "Y"], "stop"),
        (1, "defg", ["d", "e", "f", "g"], "length"),
    ):
        choices = by_index[index]
        assert "".join(c.delta.content or "" for c in choices) == text
        assert [e.token for c in choices if c.logprobs for e in c.logprobs.content] == tokens
        assert [c.finish_reason for c in choices if c.finish_reason] == [finish]
        assert choices[-1].finish_reason == finish  # nothing of a choice after its finish
    # choice 0's finish went out when its stop matched, before choice 1 ended
    order = [(c.choices[0].index, c.choices[0].finish_reason) for c in body]
    assert order.index((0, "stop")) < order.index((1, "length"))
    assert upstream.streams[0].aborts == [("stop", 0)]


def test_a_single_choice_with_logprobs_and_a_stop_ends_the_request(scripted, upstream):
    gw, _ = scripted
    upstream.texts = [["a", "XY", "b", "c"]]
    for stream in (False, True):
        r = api(gw).completions.create(model="fake", prompt="p", stop="XY", logprobs=0, stream=stream)
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks) == "a"
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert tokens == ["a", "XY"] and chunks[-1].choices[0].finish_reason == "stop"
    assert [s.aborts for s in upstream.streams] == [[("stop", None)]] * 2  # the whole request


def test_an_upstream_error_is_the_usual_api_error(scripted, upstream):
    gw, _ = scripted
    upstream.error = (P.ERR_ENGINE_DEAD, "engine died")
    with pytest.raises(openai.InternalServerError) as info:
        api(gw).completions.create(model="fake", prompt="p", n=2, logprobs=1)
    assert info.value.status_code == 503 and info.value.body["code"] == "engine_dead"
    with pytest.raises(openai.APIError) as streamed:
        list(api(gw).completions.create(model="fake", prompt="p", n=2, stream=True))
    assert "engine died" in str(streamed.value)
