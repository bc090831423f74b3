"""The prompt in an answer, end to end on the real model (SmolLM2, its GGUF dequantized to fp32):
`echo` with and without logprobs, `max_tokens: 0`, vLLM's `prompt_logprobs`, streamed and not,
through the official `openai` client, each checked against the native client's prompt logprobs
(protocol 1.10); and the tokenizer routes, whose counts are what a generation reports."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from ringleader.hostctl.gateway.app import BackgroundGateway
from ringleader.ipc.client import Client
from tests.conftest import post_json as post
from tests.conftest import running_server

PROMPT = "The capital of France is"
USER = [{"role": "user", "content": "Name the capital of France."}]


@pytest.fixture(scope="module")
def stack(smollm2_gguf):
    """(native address, the gateway, its official client, the served model's name)."""
    options = dict(weights="fp32", n_slots=4, max_ctx=512, token_budget=64)
    with running_server(str(smollm2_gguf), **options) as bg, BackgroundGateway(bg.address) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        yield bg.address, gw, client, client.models.list().data[0].id


def native_prompt(address: str, prompt=None, **kwargs):
    """The native client's answer to a scoring request: (its stream's prompt, the stream)."""
    with Client(address, timeout=60) as client:
        stream = client.generate(prompt, **{"max_tokens": 0, "prompt_logprobs": 1, **kwargs})
        list(stream)
    assert stream.done is not None and stream.done.ok and stream.prompt is not None
    return stream.prompt, stream


def test_echo_with_max_tokens_0_is_the_native_prompt_logprobs(stack):
    address, _, client, name = stack
    prompt, _ = native_prompt(address, PROMPT)
    r = client.completions.create(model=name, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(prompt.token_ids) == 5
    lp = choice.logprobs
    assert lp.tokens == prompt.tokens and "".join(lp.tokens) == PROMPT
    # two requests: approx, as another step may sum fp32 in another order
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in prompt.logprobs[1:]], abs=1e-5)
    for token, chosen, top, e in zip(
        lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], prompt.logprobs[1:]
    ):
        assert top[token] == chosen and max(top.values()) == pytest.approx(e.top_logprobs[0], abs=1e-5)
        assert len(top) <= 2  # the token's own and the likeliest alternative
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_lm_evals_request_scores_a_batch_of_token_ids_and_one_token(stack):
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 1, greedy."""
    address, gw, client, name = stack
    texts = [PROMPT, "One, two, three,"]
    ids = [post(gw, "/tokenize", {"prompt": t, "add_special_tokens": False})[1]["tokens"] for t in texts]
    r = client.completions.create(
        model=name, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    assert [c.index for c in r.choices] == [0, 1]
    for choice, prompt_ids, text in zip(r.choices, ids, texts):
        prompt, _ = native_prompt(address, prompt_ids=prompt_ids)
        with Client(address, timeout=60) as native:
            greedy = native.complete(prompt_ids=prompt_ids, max_tokens=1, temperature=0, logprobs=1)
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt_ids) + 1
        # another request in the same step changes fp32's summation order: 1e-6 apart, say
        assert lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:-1] == pytest.approx([e.logprob for e in prompt.logprobs[1:]], abs=1e-4)
        assert lp.token_logprobs[-1] == pytest.approx(greedy.logprobs[0].logprob, abs=1e-4)
        assert choice.text == text + greedy.text and lp.text_offset[-1] == len(text)
    assert r.usage.prompt_tokens == sum(len(i) for i in ids) and r.usage.completion_tokens == 2


def test_echo_without_logprobs_puts_the_prompt_first_streamed_or_not(stack):
    _, gw, client, name = stack
    greedy = dict(model=name, max_tokens=6, temperature=0)
    plain = client.completions.create(prompt=PROMPT, **greedy).choices[0]
    echoed = client.completions.create(prompt=PROMPT, echo=True, **greedy).choices[0]
    assert echoed.text == PROMPT + plain.text and echoed.logprobs is None
    chunks = [
        c for c in client.completions.create(prompt=PROMPT, echo=True, stream=True, **greedy) if c.choices
    ]
    assert chunks[0].choices[0].text == PROMPT  # the prompt comes first, as vLLM streams it
    assert "".join(c.choices[0].text for c in chunks) == echoed.text
    ids = post(gw, "/tokenize", {"prompt": PROMPT})[1][
        "tokens"
    ]  # token ids: echoed as the server decodes them
    scored = client.completions.create(model=name, prompt=ids, echo=True, max_tokens=0)
    assert scored.choices[0].text == PROMPT and scored.usage.completion_tokens == 0


def test_a_streamed_echo_with_logprobs_is_the_whole_answers(stack):
    _, _, client, name = stack
    asked = dict(model=name, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0)
    whole = client.completions.create(**asked).choices[0]
    parts = [c.choices[0] for c in client.completions.create(stream=True, **asked) if c.choices]
    assert parts[0].text == PROMPT and len(parts[0].logprobs.tokens) == 5
    assert "".join(p.text for p in parts) == whole.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        got = [v for p in parts if p.logprobs for v in getattr(p.logprobs, field)]
        assert got == getattr(whole.logprobs, field), field


def test_each_of_n_choices_echoes_the_prompt(stack):
    _, _, client, name = stack
    r = client.completions.create(
        model=name, prompt=PROMPT, echo=True, logprobs=0, n=2, max_tokens=3, temperature=1.0, seed=5
    )
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.text.startswith(PROMPT) and choice.logprobs.token_logprobs[0] is None
        assert len(choice.logprobs.tokens) == 5 + 3


def test_vllms_prompt_logprobs_beside_the_choices_and_the_chat_answer(stack):
    address, _, client, name = stack
    prompt, _ = native_prompt(address, PROMPT, prompt_logprobs=2)
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    listed = r.choices[0].model_extra["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(prompt.token_ids)
    for token_id, at, e in zip(prompt.token_ids[1:], listed[1:], prompt.logprobs[1:]):
        own = at[str(token_id)]
        assert own["logprob"] == pytest.approx(e.logprob, abs=1e-5) and own["decoded_token"] == e.token
        ranked = [at[str(i)]["rank"] for i in e.top_ids]
        assert ranked == [1, 2] and own["rank"] == (
            e.top_ids.index(token_id) + 1 if token_id in e.top_ids else None
        )
    chat = client.chat.completions.create(
        model=name, messages=USER, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    scored = chat.model_extra["prompt_logprobs"]
    assert (
        len(scored) == chat.usage.prompt_tokens
        and scored[0] is None
        and all(len(at) == 1 for at in scored[1:])
    )


def test_scoring_refusals_name_the_field(stack):
    _, _, client, name = stack
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=name, prompt=PROMPT, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=name, prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"


def test_the_tokenizer_routes_count_what_a_generation_counts(stack):
    _, gw, client, name = stack
    used = client.completions.create(model=name, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    status, counted = post(gw, "/tokenize", {"model": name, "prompt": PROMPT})
    assert status == 200 and counted["count"] == len(counted["tokens"]) == used
    assert post(gw, "/detokenize", {"tokens": counted["tokens"]}) == (200, {"prompt": PROMPT})
    chat_used = client.chat.completions.create(model=name, messages=USER, max_tokens=1).usage.prompt_tokens
    status, chat = post(gw, "/tokenize", {"messages": USER, "return_token_strs": True})
    assert status == 200 and chat["count"] == chat_used and chat["token_strs"][0] == "<|im_start|>"
    status, opened = post(gw, "/tokenize", {"messages": USER, "add_generation_prompt": False})
    assert (
        status == 200
        and opened["tokens"] == chat["tokens"][: opened["count"]]
        and opened["count"] < chat_used
    )
    status, refused = post(gw, "/tokenize", {"messages": USER, "add_special_tokens": True})
    assert status == 400 and refused["error"]["param"] == "add_special_tokens"
    with urllib.request.urlopen(gw.url + "/tokenizer_info", timeout=30) as r:
        info = json.loads(r.read())
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    assert info["model_max_length"] == 512
    eos = post(gw, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})[1]["tokens"]
    assert eos == [info["eos_token_id"]]  # how lm-eval's remote tokenizer finds the EOS id
