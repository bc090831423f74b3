"""The gateway's OpenAI request checks and stop-string matching, without sockets."""

from __future__ import annotations

import json

import pytest

from ringleader.hostctl.gateway.openai_api import APIError, GenerationRequest, parse_request
from ringleader.hostctl.gateway.responses import ResponseWriter
from ringleader.hostctl.gateway.stop_strings import StopMatcher
from ringleader.ipc import protocol as P
from ringleader.ipc.sampling_params import FLOAT32_MAX


def completion(**body):
    return parse_request({"model": "m", "prompt": "hi", **body}, chat=False)


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_request({"model": "m", **body}, chat=True)


def test_defaults_follow_openai():
    r = completion()
    assert r.sampling.max_tokens == 16 and r.sampling.temperature == 1.0 and r.sampling.top_p == 1.0
    assert not r.stream and not r.include_usage and r.stop == ()
    # chat without max_tokens: the rest of the context, which the server resolves (as vllm serve)
    assert chat().sampling.max_tokens is None and chat(max_tokens=None).sampling.max_tokens is None


def test_float_fields_take_the_protocols_range():
    # one range for both paths (the declaration, ringleader.ipc.sampling_params): vLLM's, not OpenAI's 0..2
    assert completion(temperature=3).sampling.temperature == 3.0
    assert completion(temperature=FLOAT32_MAX).sampling.temperature == FLOAT32_MAX
    for value in (1e308, 10**400, -1, 3.5e38, float("nan"), float("inf")):
        with pytest.raises(APIError) as info:
            completion(temperature=value)
        err = info.value
        assert err.status == 400 and err.param == "temperature"
        assert err.message.startswith("temperature: must be a finite number in [0, 3.4028235e+38], got ")
    with pytest.raises(APIError, match=r"^top_p: must be a finite number in \(0, 1\]"):
        completion(top_p=1e308)


def test_fields_are_translated():
    r = completion(
        prompt=[5, 6, 7],
        max_tokens=9,
        temperature=0,
        top_p=0.5,
        top_k=-1,
        seed=3,
        stop=["x", "yz", "x"],
        stop_token_ids=[4],
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
        return_token_ids=True,
        priority=2,
    )
    assert r.prompt is None and r.prompt_ids == [5, 6, 7]
    s = r.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (9, 0.0, 0.5, -1, 3)
    assert s.stop_token_ids == (4,) and s.ignore_eos
    assert r.stop == ("x", "yz") and r.include_usage and r.return_token_ids and r.priority == 2
    assert completion(prompt=["one"]).prompt == "one"  # a batch of one
    assert chat(max_completion_tokens=7).sampling.max_tokens == 7


def test_penalties_and_min_p_are_honoured():
    s = chat(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, min_p=0.1).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.5, -1.0, 1.2, 0.1)
    assert s.penalized


@pytest.mark.parametrize(
    "body",
    [{"user": "x"}, {"metadata": {"a": "b"}}, {"store": False}, {"service_tier": "auto"}, {"mirostat": None}],
    ids=repr,
)
def test_no_op_fields_are_accepted(body):
    assert chat(**body).sampling == chat().sampling


@pytest.mark.parametrize(
    "name, value",
    [
        ("mirostat", 2),
        ("dry_multiplier", 0.8),  # llama-server's
        ("typical_p", 0.9),
        ("repeat_penalty", 1.1),  # llama-server's name of repetition_penalty
        ("length_penalty", 1.0),
        ("use_beam_search", False),
        ("bad_words", ["x"]),
        ("allowed_token_ids", [1]),
        (
            "structural_tag",
            "{}",
        ),  # vLLM's old top-level field; structured_outputs.structural_tag is refused too
        ("best_of", 1),  # a completions field, not chat's
        ("prompt", "hi"),
    ],
)
def test_unknown_chat_fields_are_refused_naming_them(name, value):
    with pytest.raises(APIError) as info:
        chat(**{name: value})
    err = info.value
    assert err.status == 400 and err.param == name
    assert err.message.startswith(f"{name}: unknown field (vllm serve ignores it")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"echo": "yes"}, "echo"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # vLLM's rule
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # chat's field
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"min_p": float("nan")}, "min_p"),
        ({"n": True}, "n"),
        ({"store": True}, "store"),
        ({"user": 5}, "user"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 1e39}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 5000}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a"] * 9}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": ["a", ""]}, "prompt"),  # a batch's empty prompt
        ({"prompt": ["a", [1, "x"]]}, "prompt"),
        ({"prompt": ["a"] * 1025}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": {"x": 1}}, "prompt"),
        ({"model": 5}, "model"),
    ],
)
def test_completion_refusals_name_the_field(body, param):
    with pytest.raises(APIError) as info:
        completion(**body)
    err = info.value
    assert err.status == 400 and err.param == param and err.message.startswith(param)
    assert json.loads(json.dumps(err.body()))["error"]["param"] == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"logprobs": 2}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 0}, "n"),
        (
            {"response_format": {"type": "grammar"}},
            "response_format.type",
        ),  # test_structured_front_doors.py: the rest
    ],
)
def test_chat_refusals_name_the_field(body, param):
    with pytest.raises(APIError) as info:
        chat(**body)
    assert info.value.status == 400 and info.value.param == param


def test_chat_content_parts_and_developer_role():
    r = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert r.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]


def test_a_body_that_is_not_an_object():
    with pytest.raises(APIError, match="JSON object"):
        parse_request([1, 2], chat=False)


@pytest.mark.parametrize(
    "code, status",
    [
        (P.ERR_BAD_REQUEST, 400),
        (P.ERR_OVERLOADED, 429),
        (P.ERR_ENGINE_DEAD, 503),
        (P.ERR_SHUTDOWN, 503),
        ("disconnected", 503),
        (P.ERR_TIMEOUT, 504),
        ("something_new", 500),
    ],
)
def test_upstream_codes_map_to_statuses(code, status):
    err = APIError.from_upstream(code, "max_tokens: too many")
    assert err.status == status and err.code == code
    assert err.param == ("max_tokens" if code == P.ERR_BAD_REQUEST else None)
    assert APIError.from_upstream(P.ERR_BAD_REQUEST, "prompt_ids: bad id").param == "prompt"


def _sse_json(chunk: bytes) -> dict:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    return json.loads(chunk[6:])


@pytest.mark.parametrize("is_chat", [False, True])
def test_token_chunks_are_valid_json(is_chat):
    req = GenerationRequest(chat=is_chat, model=None, return_token_ids=True)
    w = ResponseWriter(req, 'mo"del')
    text = 'quote " backslash \\ newline \n unicode é \u2028'
    obj = _sse_json(w.token_chunk(text, [1, 2]))
    choice = obj["choices"][0]
    assert obj["model"] == 'mo"del' and obj["id"] == w.id and choice["token_ids"] == [1, 2]
    assert (choice["delta"]["content"] if is_chat else choice["text"]) == text
    assert choice["finish_reason"] is None
    assert _sse_json(w.finish_chunk("length"))["choices"][0]["finish_reason"] == "length"
    assert _sse_json(w.usage_chunk(3, 4))["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
    }


def feed(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.push(p) for p in pieces)
    return out + matcher.flush()


def test_stop_string_inside_one_chunk():
    m = StopMatcher(("END",))
    assert feed(m, ["abcENDxyz", "more"]) == "abc" and m.matched


def test_stop_string_across_chunks_is_held_back_then_cut():
    m = StopMatcher(("END",))
    assert m.push("abcE") == "abc"  # "E" could start END: held
    assert m.push("N") == ""
    assert m.push("Dtail") == "" and m.matched
    assert m.flush() == ""


def test_held_text_is_released_when_it_is_not_a_stop():
    m = StopMatcher(("END",))
    assert m.push("abEN") == "ab"
    assert m.push("x") == "ENx"
    assert m.push("E") == ""
    assert m.flush() == "E" and not m.matched


def test_the_earliest_of_several_stops_wins():
    m = StopMatcher(("zz", "b"))
    assert feed(m, ["aaz", "zab"]) == "aa"
    m = StopMatcher(("abc", "bc"))
    assert feed(m, ["xab", "c"]) == "x"


def test_every_split_of_a_text_gives_the_same_answer():
    text = "the quick brown fox jumps over the lazy dog"
    for stop in ("fox", "o", "dog", "cat", "y d", "the lazy"):
        expected = text.split(stop, 1)[0]
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                got = feed(StopMatcher((stop,)), [text[:i], text[i:j], text[j:]])
                assert got == expected, (stop, i, j)
