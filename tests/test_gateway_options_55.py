"""Issue 55, the gateway's request fields: a message without content is refused naming it;
max_tokens has one range in every message, the server's; vLLM's request extensions
(include_stop_str_in_output honoured by the gateway, the others judged here and passed to
AsyncClient.generate as its keywords, min_tokens as a sampling field).  The rest of the issue's
gateway part: test_gateway_newcomer_55.py."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest

from ringleader.hostctl.gateway.answer import AnswerSummary, answer_request
from ringleader.hostctl.gateway.app import BackgroundGateway
from ringleader.hostctl.gateway.metrics import GatewayMetrics
from ringleader.hostctl.gateway.openai_api import APIError, ServedModel, check_request, parse_request
from ringleader.hostctl.gateway.stop_strings import StopMatcher
from ringleader.ipc.client import Client
from ringleader.ipc.client.core import Done, TokenChunk
from tests.conftest import post_json as post
from tests.conftest import running_server

PROMPT_IDS = list(range(40, 60))
USER = [{"role": "user", "content": "hi"}]


def api(gw: BackgroundGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)


def refusal(body: dict, *, chat: bool, model: ServedModel | None = None) -> APIError:
    raw = json.dumps({"model": "m", **body}).encode()
    with pytest.raises(APIError) as info:
        check_request(raw, chat=chat, model=model or ServedModel("m", 64))
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------- 6. a message without content


@pytest.mark.parametrize(
    "messages, where",
    [
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "system", "content": "be brief"}, {"role": "assistant"}], "messages[1].content"),
    ],
)
def test_a_message_without_content_is_refused_naming_it(messages, where):
    err = refusal({"messages": messages}, chat=True)
    assert err.param == where and err.message == f"{where}: is required: a string or an array of text parts"


def test_a_message_without_content_through_the_gateway(gateway):
    status, body = post(gateway, "/v1/chat/completions", {"messages": [{"role": "user"}]})
    assert status == 400 and body["error"]["param"] == "messages[0].content"


# ---------------------------------------------------------------- 8. max_tokens' one range


@pytest.mark.parametrize("value", [-1, "many", 1.5, 2**40, 65])
def test_every_max_tokens_message_gives_the_servers_range(value):
    # 0 is in the range (protocol 1.10: the prompt only scored), refused below without echo
    for chat, name in ((False, "max_tokens"), (True, "max_tokens"), (True, "max_completion_tokens")):
        err = refusal(
            {"prompt": "x", name: value} if not chat else {"messages": USER, name: value}, chat=chat
        )
        assert err.param == name
        assert err.message == f"{name}: must be an int in [0, 64], got {value!r}"
    capped = refusal(
        {"prompt": "x", "max_tokens": value}, chat=False, model=ServedModel("m", 64, True, None, 32)
    )
    assert "[0, 32]" in capped.message


def test_max_tokens_0_goes_with_a_scored_prompt():
    for chat, name in ((False, "max_tokens"), (True, "max_completion_tokens")):
        body = {"prompt": "x", name: 0} if not chat else {"messages": USER, name: 0}
        err = refusal(body, chat=chat)
        assert err.param == name and "goes with echo" in err.message
    assert parse_request({"prompt": "x", "max_tokens": 0, "echo": True}, chat=False).sampling.max_tokens == 0
    scored = parse_request({"messages": USER, "max_tokens": 0, "prompt_logprobs": 2}, chat=True)
    assert scored.sampling.prompt_logprobs == 2 and scored.prompt_logprobs_asked


def test_the_model_checks_the_server_makes_are_made_in_its_words():
    err = refusal({"prompt": "x", "top_k": 200}, chat=False, model=ServedModel("m", 64, True, 100))
    assert (err.param, err.code) == ("top_k", "bad_request")
    assert err.message == "top_k: must be at most the vocabulary's 100, got 200"


def test_max_tokens_through_the_gateway_is_the_native_servers_message(server, gateway):
    with Client(server.address, timeout=30) as native:
        stream = native.generate(prompt_ids=PROMPT_IDS, max_tokens=10_000)
        list(stream)
        assert stream.done is not None and stream.done.error_code == "bad_request"
        want = stream.done.error_message
    assert want == "max_tokens: must be an int in [0, 512], got 10000"
    for value, text in ((10_000, want), (-1, "max_tokens: must be an int in [0, 512], got -1")):
        status, body = post(gateway, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": value})
        assert status == 400 and body["error"]["message"] == text and body["error"]["param"] == "max_tokens"
    status, body = post(gateway, "/v1/chat/completions", {"messages": USER, "max_completion_tokens": 600})
    assert status == 400 and body["error"]["param"] == "max_completion_tokens"
    assert body["error"]["message"] == "max_completion_tokens: must be an int in [0, 512], got 600"


# ---------------------------------------------------------------- 9. include_stop_str_in_output


def test_a_matched_stop_string_stays_when_asked():
    def run(pieces, stops, include):
        m = StopMatcher(stops, include=include)
        return "".join(m.push(p) for p in pieces) + m.flush()

    assert run(["ab", "X", "Yc"], ("XY",), True) == "abXY"
    assert run(["ab", "X", "Yc"], ("XY",), False) == "ab"
    assert run(["abcd"], ("cd", "b"), True) == "ab"  # the earliest match
    assert run(["abcd"], ("bcd", "bc"), True) == "abcd"  # same place: the first listed
    assert run(["abX"], ("XY",), True) == "abX"  # no match: the held text is due at the end


def test_no_stop_string_is_matched_within_min_tokens():
    def run(pieces, min_tokens):  # one token per piece
        m = StopMatcher(("X",), min_tokens=min_tokens)
        return "".join(m.push(p, n) for n, p in enumerate(pieces, 1)) + m.flush()

    assert run(["a", "X", "b", "X", "c"], 0) == "a"
    assert run(["a", "X", "b", "X", "c"], 2) == "aXb"  # vLLM: the text of tokens 1..2 is not searched
    assert run(["a", "X", "b", "X", "c"], 5) == "aXbXc"


def test_min_tokens_with_stop_token_ids_is_refused_by_name():
    from ringleader.ipc.sampling_params import SamplingError, SamplingParams

    with pytest.raises(SamplingError) as err:
        SamplingParams(16, min_tokens=4, stop_token_ids=(5,))
    assert err.value.field == "min_tokens" and "stop_token_ids" in err.value.reason


def test_include_stop_str_in_output_end_to_end(gateway):
    client = api(gateway)
    greedy = dict(model="tiny", prompt=PROMPT_IDS, max_tokens=40, temperature=0)
    text = client.completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0].text
    k = next(i for i in range(3, len(text) - 2) if text.find(text[i : i + 2]) == i)
    stop = text[k : k + 2]
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    whole = client.completions.create(**greedy, stop=[stop], n=2, extra_body=extra)
    assert [c.text for c in whole.choices] == [text[: k + 2]] * 2
    assert [c.finish_reason for c in whole.choices] == ["stop", "stop"]
    for n in (1, 2):
        chunks = list(client.completions.create(**greedy, stop=stop, n=n, stream=True, extra_body=extra))
        for index in range(n):
            got = "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == index)
            assert got == text[: k + 2], (n, index)


# ---------------------------------------------------------------- 9. the extensions, judged and passed on


def test_the_extensions_become_generates_keywords_when_not_their_defaults():
    chat = parse_request(
        {"messages": USER, "skip_special_tokens": True, "add_generation_prompt": True}, chat=True
    )
    assert chat.generate_options == {} and not chat.include_stop_str_in_output
    body = {
        "messages": USER + [{"role": "assistant", "content": "The answer is"}],
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": False,
        "continue_final_message": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    req = parse_request(body, chat=True)
    assert req.generate_options == {
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": False,
        "continue_final_message": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    assert req.include_stop_str_in_output
    plain = parse_request(
        {"prompt": "x", "skip_special_tokens": False, "include_stop_str_in_output": False}, chat=False
    )
    assert plain.generate_options == {"skip_special_tokens": False} and not plain.include_stop_str_in_output


@pytest.mark.parametrize(
    "chat, body, param, words",
    [
        (True, {"skip_special_tokens": "no"}, "skip_special_tokens", "must be true or false"),
        (
            True,
            {"spaces_between_special_tokens": 0},
            "spaces_between_special_tokens",
            "must be true or false",
        ),
        (True, {"include_stop_str_in_output": 1}, "include_stop_str_in_output", "must be true or false"),
        (True, {"add_generation_prompt": "yes"}, "add_generation_prompt", "must be true or false"),
        (True, {"continue_final_message": 1}, "continue_final_message", "must be true or false"),
        (True, {"chat_template_kwargs": ["x"]}, "chat_template_kwargs", "must be an object"),
        (True, {"continue_final_message": True}, "continue_final_message", "add_generation_prompt is true"),
        (
            True,
            {"continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
            "add_generation_prompt is true",
        ),
        (False, {"chat_template_kwargs": {"a": 1}}, "chat_template_kwargs", "/v1/completions does not"),
        (False, {"add_generation_prompt": False}, "add_generation_prompt", "/v1/completions does not"),
        (False, {"continue_final_message": False}, "continue_final_message", "/v1/completions does not"),
        (False, {"skip_special_tokens": "x"}, "skip_special_tokens", "must be true or false"),
    ],
)
def test_the_extensions_are_refused_naming_the_field(chat, body, param, words):
    err = refusal({**({"messages": USER} if chat else {"prompt": "x"}), **body}, chat=chat)
    assert err.param == param and err.message.startswith(param + ": ") and words in err.message


class _Stream:
    """One token, then a done: what answer_request reads of an upstream stream."""

    def __init__(self) -> None:
        self.done: Done | None = None
        self._sent = False

    def __aiter__(self):
        return self

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        pass

    async def __anext__(self) -> TokenChunk:
        if not self._sent:
            self._sent = True
            return TokenChunk([7], "hi", 0, None, None)
        self.done = Done("length", 3, 1, None, None)
        raise StopAsyncIteration

    async def aclose(self):
        pass


class _NewClient:
    """A client whose generate() takes the extensions, as AsyncClient's will."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def generate(
        self,
        prompt=None,
        *,
        prompt_ids=None,
        messages=None,
        sampling=None,
        priority=0,
        structured=None,
        request_id=None,
        chat_template_kwargs=None,
        add_generation_prompt=True,
        continue_final_message=False,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
    ):
        self.calls.append(dict(locals(), self=None))
        return _Stream()


class _OldClient:
    """A client from before the extensions."""

    async def generate(
        self, prompt=None, *, prompt_ids=None, messages=None, sampling=None, **sampling_fields
    ):
        raise AssertionError("never called: the gateway refuses first")


def _answer(client, body: dict, chat: bool = True):
    req = parse_request({"model": "m", **body}, chat=chat)
    summary = AnswerSummary()
    answer = asyncio.run(answer_request(client, GatewayMetrics(), req, "m", time.perf_counter(), summary))
    return answer, summary


def test_the_extensions_are_passed_to_generate_as_its_keywords():
    client = _NewClient()
    body = {"messages": USER, "skip_special_tokens": False, "chat_template_kwargs": {"enable_thinking": True}}
    answer, summary = _answer(client, body)
    assert isinstance(answer, dict) and answer["choices"][0]["message"]["content"] == "hi"
    call = client.calls[0]
    assert call["skip_special_tokens"] is False and call["chat_template_kwargs"] == {"enable_thinking": True}
    assert call["add_generation_prompt"] is True and call["continue_final_message"] is False  # defaults
    assert call["request_id"] == answer["id"] == summary.id  # the upstream's id is the response's
    assert summary.finish_reasons == ["length"] and (summary.prompt_tokens, summary.completion_tokens) == (
        3,
        1,
    )
    _answer(client, {"messages": USER})
    assert client.calls[1]["skip_special_tokens"] is True  # nothing asked: the defaults


def test_the_chat_extensions_end_to_end_on_the_real_model(smollm2_gguf):
    with running_server(str(smollm2_gguf), n_slots=4, max_ctx=512, token_budget=16) as srv:
        with BackgroundGateway(srv.address) as gw:
            client = api(gw)
            name = client.models.list().data[0].id
            messages = [
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"},
            ]
            extra = {"add_generation_prompt": False, "continue_final_message": True}
            r = client.chat.completions.create(
                model=name, messages=messages, max_tokens=4, temperature=0, extra_body=extra
            )
            assert "Paris" in r.choices[0].message.content  # the final message, continued
            r = client.chat.completions.create(
                model=name,
                messages=USER,
                max_tokens=2,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
            assert r.usage.completion_tokens <= 2


def test_min_tokens_is_a_sampling_field_on_both_routes(gateway):
    field = "min_tokens"
    assert getattr(parse_request({"prompt": "x", field: 3}, chat=False).sampling, field) == 3
    assert getattr(parse_request({"messages": USER, field: 3}, chat=True).sampling, field) == 3
    r = api(gateway).completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=4, extra_body={field: 2})
    assert r.usage.completion_tokens >= 2
