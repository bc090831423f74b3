"""Speculative decoding on the real model (SmolLM2-135M-Instruct, its Q4_1 GGUF kept quantized,
the server's default on the CPU): `--speculative ngram` gives every one of the project's
real-model prompts (bench/lab/quant_agreement.py) and a quoting one, each sent alone, the same
greedy tokens as `--speculative off`, and a sampled run the same tokens for every seed of a fixed set (the
sampler draws each token from a hash of seed and counter, so with the same seed the drafts change
nothing at all; the distribution over seeds is then the same by construction), with drafts
accepted in both."""

from __future__ import annotations

from ringleader.bench.lab.quant_agreement import CHATS, RAW_PROMPTS
from ringleader.ipc.client import Client
from tests.conftest import running_server

PASSAGE = (
    "The old lighthouse stood at the edge of the cliff for more than a century, guiding ships "
    "through the narrow channel between the rocks. Its keeper climbed the spiral stairs every "
    "evening to light the great lamp, and in the morning he wrote the weather in a small book."
)
QUOTE = [{"role": "user", "content": "Repeat the following text exactly:\n\n" + PASSAGE}]
SEEDS = range(6)


def _tokens(client, asks, **options) -> list[list[int]]:
    """Each request alone, one after another: a step's rows are then the request's own (with
    drafts, up to 5), so both forms run the same kernels. (The CPU step picks some kernels by
    its row count, C++ up to 32 rows and torch's above, so under concurrency the tokens depend
    on which requests share a step, with or without drafts, as in most batched runtimes.)"""
    out = []
    for a in asks:
        stream = client.complete(**a, **options)
        assert stream.done.ok, stream.done
        out.append(stream.choices[0].token_ids)
    return out


def _serve_all(smollm2_gguf, speculative: str):
    asks = [dict(prompt=p) for p in RAW_PROMPTS] + [dict(messages=m) for m in [*CHATS, QUOTE]]
    sampled = [
        dict(messages=m, temperature=0.8, top_p=0.95, seed=s) for s in SEEDS for m in (QUOTE, CHATS[0])
    ]
    with running_server(str(smollm2_gguf), n_slots=8, max_ctx=1024, speculative=speculative) as bg:
        with Client(bg.address, timeout=300) as c:
            greedy = _tokens(c, asks, max_tokens=48, temperature=0.0)
            before = c.stats()["device"]
            tokens = _tokens(c, sampled, max_tokens=40)
            after = c.stats()["device"]
    accepted = (
        before["spec_accepted_tokens"],
        after["spec_accepted_tokens"] - before["spec_accepted_tokens"],
    )
    return greedy, tokens, accepted


def test_greedy_and_seeded_output_is_the_same_with_drafts(smollm2_gguf):
    greedy_off, sampled_off, _ = _serve_all(smollm2_gguf, "off")
    greedy_on, sampled_on, (greedy_accepted, sampled_accepted) = _serve_all(smollm2_gguf, "ngram")
    assert all(len(t) > 0 for t in greedy_off + sampled_off)
    for i, (off, on) in enumerate(zip(greedy_off, greedy_on)):
        assert on == off, f"greedy prompt {i}: drafts changed the tokens"
    for i, (off, on) in enumerate(zip(sampled_off, sampled_on)):
        assert on == off, f"sampled request {i} (seed {list(SEEDS)[i // 2]}): drafts changed the tokens"
    assert greedy_accepted > 20 and sampled_accepted > 20, (greedy_accepted, sampled_accepted)
    # sampling is sampling: the seeds gave different quotes at least somewhere
    assert len({tuple(t) for t in sampled_on[::2]}) > 1
