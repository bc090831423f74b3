"""Logprobs end to end on the real model: SmolLM2-135M-Instruct (Q4_1 GGUF), fp32 on the CPU,
against transformers' log_softmax of its own logits for the same tokens.  Also on `tiny`: what a
seeded sampled request's logprobs say, and that n and logprobs go together."""

from __future__ import annotations

import math

import pytest
import torch

from ringleader.ipc.client import Client
from tests.conftest import running_server, transformers_fp32

N_TOKENS = 24
TOP = 5


@pytest.fixture(scope="module")
def tiny():
    with running_server(n_slots=4, max_ctx=256, token_budget=32) as bg:
        with Client(bg.address, timeout=60) as client:
            yield client


def test_greedy_logprobs_equal_transformers_log_softmax(smollm2_gguf):
    hf = transformers_fp32(smollm2_gguf)
    prompts = ["The history of the printing press begins", "def fibonacci(n):\n    "]
    with running_server(str(smollm2_gguf), weights="fp32", n_slots=4, max_ctx=256, token_budget=16) as bg:
        with Client(bg.address, timeout=120) as client:
            streams = [
                client.generate(p, max_tokens=N_TOKENS, logprobs=TOP, ignore_eos=True) for p in prompts
            ]
            for stream in streams:
                stream.wait(timeout=300)
            from ringleader.device.model.presets import tokenizer_for

            tokenizer = tokenizer_for(str(smollm2_gguf))
    for prompt, stream in zip(prompts, streams):
        assert stream.done.ok and len(stream.logprobs) == len(stream.token_ids) == N_TOKENS
        prompt_ids = tokenizer.encode(prompt)
        ids = torch.tensor([prompt_ids + stream.token_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0].float()
        expected = torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]  # the rows that chose them
        for step, (token, entry) in enumerate(zip(stream.token_ids, stream.logprobs)):
            row = expected[step]
            assert abs(entry.logprob - row[token].item()) < 1e-4, (step, entry.logprob, row[token].item())
            values, _ = row.topk(TOP)
            assert len(entry.top_ids) == TOP
            # the true top-k: each alternative's value is its own, in order, and as large as the k-th
            for tid, lp, want in zip(entry.top_ids, entry.top_logprobs, values.tolist()):
                assert abs(lp - row[tid].item()) < 1e-4 and abs(lp - want) < 1e-4
            # greedy: the chosen token is the first alternative, with the same value
            assert entry.logprob == entry.top_logprobs[0] and token == entry.top_ids[0]
            assert entry.token == tokenizer.decode([token], skip_special_tokens=False)
            assert entry.top_tokens == [
                tokenizer.decode([t], skip_special_tokens=False) for t in entry.top_ids
            ]


def test_sampled_logprobs_are_the_raw_distributions(tiny):
    # temperature and a penalty change what is drawn, not the logprobs reported (vLLM's raw mode)
    stream = tiny.complete(
        prompt_ids=[5, 6, 7, 8], max_tokens=20, temperature=1.7, repetition_penalty=1.3, seed=3, logprobs=20
    )
    plain = tiny.complete(prompt_ids=[5, 6, 7, 8], max_tokens=1, logprobs=20)
    assert stream.logprobs[0].top_ids == plain.logprobs[0].top_ids
    assert stream.logprobs[0].top_logprobs == plain.logprobs[0].top_logprobs
    for token, entry in zip(stream.token_ids, stream.logprobs):
        assert entry.logprob <= entry.top_logprobs[0] <= 0.0
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
        if token in entry.top_ids:
            assert entry.top_logprobs[entry.top_ids.index(token)] == entry.logprob
        assert math.fsum(math.exp(v) for v in entry.top_logprobs) <= 1.0 + 1e-5


def test_zero_alternatives_and_none_asked(tiny):
    stream = tiny.complete(prompt_ids=[9, 9, 9], max_tokens=6, logprobs=0)
    assert [e.top_ids for e in stream.logprobs] == [[]] * 6
    assert all(e.logprob <= 0 for e in stream.logprobs)
    assert tiny.complete(prompt_ids=[9, 9, 9], max_tokens=6).logprobs is None


def test_n_and_logprobs_together(tiny):
    stream = tiny.complete(prompt_ids=[1, 2, 3], max_tokens=8, n=3, seed=5, temperature=1.0, logprobs=2)
    for choice in stream.choices:
        alone = tiny.complete(
            prompt_ids=[1, 2, 3], max_tokens=8, seed=5 + choice.index, temperature=1.0, logprobs=2
        )
        assert choice.token_ids == alone.token_ids
        # the same tokens; values to rounding (a batch of three and a batch of one round apart)
        for got, want in zip(choice.logprobs, alone.logprobs):
            assert got.top_ids == want.top_ids and abs(got.logprob - want.logprob) < 1e-5


def test_logprobs_is_judged_by_its_declaration(tiny):
    with pytest.raises(ValueError, match="logprobs"):
        tiny.generate(prompt_ids=[1, 2], logprobs=21)


@pytest.mark.parametrize("n", [1, 2])
def test_every_chunk_of_a_request_that_asked_carries_a_list(n):
    """A stream that ends inside a UTF-8 sequence gets a last chunk of text with no token ids
    (one per choice with n > 1): its logprobs are an empty list, not missing, so a client may
    write `[e for chunk in stream for e in chunk.logprobs]`. The null model makes the ending
    certain: after 193 come 194 (a lead byte, shown as U+FFFD) and 195 (a lead byte, held)."""
    with running_server("null", n_slots=4) as bg, Client(bg.address, timeout=60) as client:
        stream = client.generate(prompt_ids=[193], max_tokens=2, logprobs=1, n=n, ignore_eos=True)
        chunks = list(stream)
        assert stream.done.ok
        tails = [c for c in chunks if not c.token_ids]
        assert len(tails) == n and all(c.text == "\ufffd" and c.logprobs == [] for c in tails)
        for index in range(n):  # the choices' chunks interleave
            assert [e.top_ids[0] for c in chunks if c.index == index for e in c.logprobs] == [194, 195]
        plain = list(client.generate(prompt_ids=[193], max_tokens=2, ignore_eos=True))
        assert all(c.logprobs is None for c in plain)  # a request that did not ask gets none
