"""OpenAI `n` and logprobs through the gateway, end to end: the official `openai` client against
a real server (`tiny`, and SmolLM2 for chat), each answer checked against the native client's."""

from __future__ import annotations

import openai
import pytest

from ringleader.hostctl.gateway.app import BackgroundGateway
from ringleader.ipc.client import Client
from tests.conftest import running_server
from tests.test_gateway_choices import PROMPT_IDS, api


def native(server, **kwargs):
    with Client(server.address, timeout=60) as c:
        stream = c.generate(**kwargs)
        chunks = list(stream)
        return chunks, stream.done


GREEDY = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def test_completion_logprobs_are_the_native_clients(server, gateway):
    chunks, done = native(
        server, prompt_ids=PROMPT_IDS, max_tokens=12, ignore_eos=True, temperature=0, logprobs=5
    )
    want = [e for c in chunks for e in c.logprobs]
    r = api(gateway).completions.create(model="tiny", prompt=PROMPT_IDS, logprobs=5, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert lp.token_logprobs == [e.logprob for e in want]
    assert lp.tokens == [e.token for e in want]
    for chosen, token, top, e in zip(lp.token_logprobs, lp.tokens, lp.top_logprobs, want):
        assert top[token] == chosen and len(top) <= 6
        assert chosen == max(top.values()) == e.top_logprobs[0]  # greedy: the chosen is the likeliest
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = list(
        api(gateway).completions.create(model="tiny", prompt=PROMPT_IDS, logprobs=5, stream=True, **GREEDY)
    )
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for p in parts for v in getattr(p, name)] == getattr(lp, name), name


def test_logprobs_refusals_through_the_official_client(gateway):
    client = api(gateway)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, best_of=3)
    assert info.value.body["param"] == "best_of" and "send n" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=21)
    assert info.value.body["param"] == "logprobs"
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages, top_logprobs=3)
    assert info.value.status_code == 400 and info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs"


SEEDED = dict(max_tokens=10, temperature=1.0, seed=21)


def test_n_choices_each_equal_the_single_request_with_the_next_seed(server, gateway):
    want = [
        [
            t
            for c in native(server, prompt_ids=PROMPT_IDS, ignore_eos=True, **{**SEEDED, "seed": 21 + i})[0]
            for t in c.token_ids
        ]
        for i in range(3)
    ]
    assert len({tuple(w) for w in want}) > 1, "the seeds must give different answers to be a real test"
    extra = {"ignore_eos": True, "return_token_ids": True}
    client = api(gateway)
    r = client.completions.create(model="tiny", prompt=PROMPT_IDS, n=3, extra_body=extra, **SEEDED)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in r.choices] == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (20, 30)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT_IDS,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
            **SEEDED,
        )
    )
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finishes: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for c in chunks[:-1]:
        (choice,) = c.choices
        got[choice.index] += choice.model_extra.get("token_ids") or []
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert [got[i] for i in range(3)] == want
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert chunks[-1].usage.completion_tokens == 30 and chunks[-1].usage.prompt_tokens == 20


def test_n_choices_with_logprobs_and_a_stop_string_in_one(server, gateway):
    client = api(gateway)
    extra = {"ignore_eos": True, "return_token_ids": True}
    full = client.completions.create(
        model="tiny", prompt=PROMPT_IDS, n=3, logprobs=2, extra_body=extra, **SEEDED
    )
    texts = [c.text for c in full.choices]
    target = texts[1]
    # a stop in choice 1 that the others never show
    k, stop = next(
        (i, target[i : i + 2])
        for i in range(1, len(target) - 1)
        if target.find(target[i : i + 2]) == i
        and all(target[i : i + 2] not in t for t in (texts[0], texts[2]))
    )
    cut = client.completions.create(
        model="tiny", prompt=PROMPT_IDS, n=3, logprobs=2, stop=stop, extra_body=extra, **SEEDED
    )
    c0, c1, c2 = cut.choices
    assert (c1.text, c1.finish_reason) == (target[:k], "stop")
    assert (c0.text, c2.text) == (texts[0], texts[2]) and c0.finish_reason == c2.finish_reason == "length"
    kept = len(c1.model_extra["token_ids"])
    assert len(c1.logprobs.tokens) == kept and c1.logprobs.tokens == full.choices[1].logprobs.tokens[:kept]
    assert cut.usage.completion_tokens == 10 + kept + 10


# ---------------------------------------------------------------- the real model: chat


@pytest.fixture(scope="module")
def smollm2_stack(smollm2_gguf):
    with running_server(str(smollm2_gguf), n_slots=4, max_ctx=512, token_budget=16) as srv:
        with BackgroundGateway(srv.address) as gw:
            yield srv, gw


MESSAGES = [{"role": "user", "content": "Name the capital of France."}]


def test_chat_logprobs_streamed_and_not(smollm2_stack):
    _, gw = smollm2_stack
    client = api(gw)
    name = client.models.list().data[0].id
    body = dict(model=name, messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True, top_logprobs=5)
    r = client.chat.completions.create(**body)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    # one entry per counted token: the end-of-turn token that stopped it too (as vLLM answers)
    *said, end = content
    assert r.choices[0].finish_reason == "stop" and end.token == "<|im_end|>"
    assert "".join(e.token for e in said) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 5 and e.bytes == list(e.token.encode())
        assert e.logprob == e.top_logprobs[0].logprob and e.token == e.top_logprobs[0].token  # greedy
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].logprobs is None
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(**{**body, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_chat_n_streamed_opens_each_choice(smollm2_stack):
    _, gw = smollm2_stack
    client = api(gw)
    name = client.models.list().data[0].id
    body = dict(model=name, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=4, n=2)
    whole = client.chat.completions.create(**body)
    assert [c.index for c in whole.choices] == [0, 1]
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
