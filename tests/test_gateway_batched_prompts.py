"""A batch of prompts in one /v1/completions request, end to end on the real model (SmolLM2, its
GGUF dequantized to fp32): each prompt answered as it is alone (greedy, and seeded with n), its
choices at index prompt * n + choice, the usage summed, streamed too; a prompt the server refuses
fails the whole request naming it, and its siblings are aborted on the server."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from ringleader.hostctl.gateway.app import BackgroundGateway
from ringleader.ipc.client import Client
from tests.conftest import running_server, wait_until

PROMPTS = ["The capital of France is", "One, two, three,", [504, 3575, 282, 9531, 314]]  # text, text, ids


@pytest.fixture(scope="module")
def stack(smollm2_gguf):
    """(native address, the gateway, its official client, the served model's name)."""
    options = dict(weights="fp32", n_slots=8, max_ctx=512, token_budget=64)
    with running_server(str(smollm2_gguf), **options) as bg, BackgroundGateway(bg.address) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        yield bg.address, gw, client, client.models.list().data[0].id


def test_a_greedy_batch_equals_its_prompts_sent_one_by_one(stack):
    _, _, client, name = stack
    asked = dict(model=name, max_tokens=8, temperature=0, logprobs=1)
    alone = [client.completions.create(prompt=p, **asked) for p in PROMPTS]
    batch = client.completions.create(prompt=PROMPTS, **asked)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert [c.logprobs.tokens for c in batch.choices] == [a.choices[0].logprobs.tokens for a in alone]
    assert [c.finish_reason for c in batch.choices] == [a.choices[0].finish_reason for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone) == 24
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens


def test_n_choices_of_each_prompt_are_at_prompt_times_n_plus_choice(stack):
    _, _, client, name = stack
    asked = dict(model=name, max_tokens=6, temperature=1.0, seed=11, n=2)
    alone = [client.completions.create(prompt=p, **asked) for p in PROMPTS[:2]]
    want = [c.text for a in alone for c in a.choices]
    assert len(set(want)) > 2, "seeded sampling must give different answers to be a real test"
    batch = client.completions.create(prompt=PROMPTS[:2], **asked)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == want


def test_a_streamed_batch_says_each_chunks_index_and_ends_once(stack):
    _, gw, client, name = stack
    asked = dict(model=name, max_tokens=8, temperature=0)
    whole = client.completions.create(prompt=PROMPTS, **asked)
    texts = ["", "", ""]
    usage = None
    for chunk in client.completions.create(
        prompt=PROMPTS, stream=True, stream_options={"include_usage": True}, **asked
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    body = json.dumps({"model": name, "prompt": PROMPTS, "stream": True, "max_tokens": 2}).encode()
    req = urllib.request.Request(
        gw.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        events = r.read().decode().split("\n\n")
    ids = {json.loads(e[6:])["id"] for e in events if e.startswith("data: {")}
    assert events.count("data: [DONE]") == 1 and len(ids) == 1  # one answer, one id


def test_a_prompt_the_server_refuses_fails_the_batch_naming_it_and_aborts_the_others(stack):
    address, _, client, name = stack
    with Client(address, timeout=30) as native:
        aborted = native.stats()["finished"].get("abort", 0)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model=name,
                prompt=["Tell me a long story.", "word " * 600],  # the second is past the context
                max_tokens=400,
                extra_body={"ignore_eos": True},
            )
        error = info.value.body
        assert error["param"] == "prompt" and error["message"].startswith("prompt[1]: prompt length ")
        # the first, accepted upstream, is aborted rather than left running its 400 tokens
        assert wait_until(lambda: native.stats()["in_flight"] == 0, timeout=5)
        assert native.stats()["finished"].get("abort", 0) == aborted + 1
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=name, prompt=["fine", ""], max_tokens=1)
    assert info.value.body["param"] == "prompt" and info.value.body["message"].startswith("prompt[1]: ")
