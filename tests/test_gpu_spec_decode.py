"""Speculative decoding on the GPU (run E's tests-all stage): the device scheduler drafts,
lays out and accepts, the CUDA step verifies. The null model's "next" pattern makes every answer
quote its prompt (its drafts are all accepted: the counters must show it), and `tiny` at fp32
must give the same greedy tokens with drafts as without, through the ping-pong launch and the
fused step (verification segments of up to 5 rows) alike."""

from __future__ import annotations

from tests.test_gpu_backend import _serve, gpu

RUN = list(range(100, 160))


def _answers(bg, asks):
    from ringleader.ipc.client import Client

    with Client(bg.address, timeout=120) as c:
        return [c.complete(**a).choices[0].token_ids for a in asks], c.stats()["device"]


@gpu
def test_gpu_drafts_are_verified_and_accepted_on_the_device():
    asks = [dict(prompt_ids=RUN + RUN[:3], max_tokens=40, ignore_eos=True) for _ in range(3)]
    options = dict(model="null", null_pattern="next", null_vocab=4096, n_slots=8, token_budget=64)
    with _serve(speculative="ngram", **options) as bg:
        got, stats = _answers(bg, asks)
    assert got == [list(range(103, 143))] * 3
    assert stats["spec_accepted_tokens"] >= 60 and stats["spec_drafts"] > 0, stats
    assert stats["steps"] < 3 * 40 / 2, stats  # fewer steps than tokens: drafts were accepted


@gpu
def test_gpu_greedy_tokens_are_the_same_with_drafts():
    asks = [
        dict(prompt_ids=[(7 * i + j) % 200 + 3 for j in range(24)] * 2, max_tokens=32, ignore_eos=True)
        for i in range(4)
    ]
    options = dict(dtype="float32", n_slots=8, token_budget=64)
    with _serve(speculative="off", **options) as bg:
        want, _ = _answers(bg, asks)
    with _serve(speculative="ngram", **options) as bg:
        got, stats = _answers(bg, asks)
    assert got == want
    assert stats["spec_draft_tokens"] >= stats["spec_accepted_tokens"] >= 0
