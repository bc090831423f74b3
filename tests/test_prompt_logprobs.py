"""Prompt logprobs (protocol 1.10): the scheduler lays out score entries for the prefill rows of a
request that asked, each prompt position exactly once however its prefill is chunked, capped by
score_rows, preempted or served from the prefix cache; the step writes their records; they reach
the client before the request's first token.  The scheduler with sched_driver's stand-in
sampler; the CUDA step's code path (StaticStep) against the eager step; the null model's C step
against its torch form; the wire on `tiny`.  Values against transformers on the real model:
test_prompt_logprobs_real.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringleader.device.model import LlamaModel
from ringleader.device.null.null_model import NullModel
from ringleader.device.null.null_options import NullOptions
from ringleader.device.null.null_step import NullStep
from ringleader.device.step.eager_step import EagerStep
from ringleader.device.step.kv_cache import KVCache
from ringleader.device.step.static_step import StaticStep
from ringleader.device.step.step_layout import StepLayout
from ringleader.ipc import layout as L
from ringleader.ipc import protocol as P
from ringleader.ipc.batch_frames import expand_batch
from ringleader.ipc.rings import RingConfig
from tests.conftest import RawPeer, running_server
from tests.sched_driver import Driver, scheduler, score_for


def _config(**over) -> RingConfig:
    base = dict(
        n_slots=4, max_ctx=64, token_budget=16, sq_size=64, cq_size=1024, arena_size=1 << 12,
        pending_cap=32, page_size=4, score_rows=5,
    )  # fmt: skip
    return RingConfig(**{**base, **over})


def _scored_exactly_once(rec, asked: bool) -> None:
    """Every position 1..len-1 of its prompt once, in order, each with the stand-in's record, all
    before its first token; nothing for a request that did not ask."""
    if not asked:
        assert rec.scores == []
        return
    prompt = rec.prompt.tolist()
    assert [p for p, _, _ in rec.scores] == list(range(1, len(prompt)))
    for pos, token, lp in rec.scores:
        assert token == prompt[pos] and lp == score_for(pos, token)
    assert set(rec.scores_after_tokens) <= {0}, "a prompt record came after a token"


def test_every_prompt_position_is_scored_once_under_a_small_cap():
    d = Driver(_config())
    rng = np.random.default_rng(1)
    asked = {}
    for plen, k in [(23, 2), (7, None), (40, 0), (1, 3), (13, 20), (30, None), (9, 1)]:
        h = d.submit(rng.integers(3, 900, plen), 4, prompt_logprobs=k, flags=L.SqFlag.IGNORE_EOS)
        asked[h] = k is not None
    most = 0
    for _ in range(10_000):
        status = d.step()
        most = max(most, int(d.a["step"][0]["n_score"]))
        if status == L.StepStatus.IDLE and d.rings.completions.pending() == 0:
            break
    assert most == 5, "some step filled the cap, and none went past it"
    for handle, rec in d.records.items():
        assert rec.done == [L.Finish.LENGTH] and len(rec.tokens) == 4
        _scored_exactly_once(rec, asked[handle])


def test_scores_survive_preemption_and_the_prefix_cache():
    # 16 pages of 4 positions for 4 slots: 20-token prompts growing by 30 cannot all fit, so
    # decode preempts; the last two prompts are the first's, whose pages the cache holds
    d = Driver(_config(n_pages=16, token_budget=8, score_rows=3))
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 900, 20)
    prompts = [shared, rng.integers(3, 900, 20), rng.integers(3, 900, 20), shared.copy(), shared.copy()]
    asked = [None, 1, 1, 1, None]
    handles = []
    for i, (prompt, k) in enumerate(zip(prompts, asked)):
        handles.append(d.submit(prompt, 30, prompt_logprobs=k, flags=L.SqFlag.IGNORE_EOS))
        if i == 0:
            d.run_until_idle()  # its pages are cached before the others come
    d.run_until_idle()
    assert int(d.a["ctl"][0]["preemptions"]) > 0, "the test must preempt to test it"
    assert int(d.a["ctl"][0]["prefix_cache_hits"]) > 0, "and hit the prefix cache"
    for h, k in zip(handles, asked):
        rec = d.records[h]
        assert rec.done == [L.Finish.LENGTH] and len(rec.tokens) == 30
        _scored_exactly_once(rec, k is not None)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing():
    d = Driver(_config())
    scored = d.submit(np.arange(3, 20), 0, prompt_logprobs=0)
    plain = d.submit(np.arange(3, 9), 0)
    d.run_until_idle()
    for h, asked in ((scored, True), (plain, False)):
        rec = d.records[h]
        assert rec.tokens == [] and rec.done == [L.Finish.LENGTH]
        _scored_exactly_once(rec, asked)


def test_an_aborted_request_leaves_no_record_behind():
    d = Driver(_config(score_rows=2))
    victim = d.submit(np.arange(3, 40), 5, prompt_logprobs=1)
    other = d.submit(np.arange(50, 60), 3, prompt_logprobs=0, flags=L.SqFlag.IGNORE_EOS)
    for _ in range(3):
        d.step()
    assert d.records[victim].scores, "it was scoring when aborted"
    d.abort(victim)
    d.run_until_idle()  # drain_cq asserts no event after a DONE
    assert d.records[victim].done == [L.Finish.ABORT]
    _scored_exactly_once(d.records[other], True)


# ---- the CUDA step's code path against the eager step, on the scheduler's layouts -------------


@pytest.fixture(scope="module")
def model():
    return LlamaModel.from_preset("tiny", torch.float32, "cpu", seed=0)


def test_static_step_scores_as_the_eager_step(model):
    cfg = _config(max_ctx=96, buckets=(4, 8, 16), page_size=8, score_rows=6, cq_size=2048)
    d = Driver(cfg)
    rng = np.random.default_rng(5)
    wanted = 0
    for plen, k in [(21, 3), (3, None), (9, 0), (17, 20), (2, 5)]:
        d.submit(rng.integers(3, 250, plen), 3, prompt_logprobs=k, flags=L.SqFlag.IGNORE_EOS)
        wanted += plen - 1 if k is not None else 0
    eager = EagerStep(model, KVCache.for_model(model.config, cfg.n_pages, cfg.page_size))
    kv = StaticStep.new_kv_cache(model, cfg.n_pages, cfg.page_size)
    step = StaticStep(model, kv, 4, 96, 16, attention="torch", fused=False, score_rows=cfg.score_rows)
    a, lay = d.a, StepLayout.from_arrays(d.a, "cpu")
    records = a["step_prompt_logprobs"]
    scored = 0
    for _ in range(200):
        d.rings.submissions.publish()
        if scheduler().step(d.mem.context_address) == L.StepStatus.IDLE:
            d.drain_cq()  # the DONE events of the last step's outputs
            break
        h = a["step"][0]
        bucket, n = int(h["bucket"]), int(h["n_score"])
        before = a["next_token"].copy()
        records.view(np.uint8)[:] = 0xEE
        eager.run(bucket, lay)
        expected = records.copy()
        records.view(np.uint8)[:] = 0xEE
        a["next_token"][:] = before
        step.run(bucket, lay)
        np.testing.assert_array_equal(records[n:].view(np.uint8), 0xEE)  # no entry past n_score
        for i in range(n):
            k = int(expected[i]["n_top"])
            assert k == int(records[i]["n_top"]) == min(20, int(a["score_top"][i]))
            assert abs(float(records[i]["logprob"]) - float(expected[i]["logprob"])) < 1e-4
            np.testing.assert_allclose(
                records[i]["top_logprobs"][:k], expected[i]["top_logprobs"][:k], atol=1e-4
            )
        scored += n
        d.drain_cq()
    assert scored == wanted and all(r.done for r in d.records.values())


def test_the_null_models_c_step_scores_as_its_torch_form():
    vocab, g = 300, torch.Generator().manual_seed(4)
    results = []
    for kernel in ("torch", "native"):
        lay = StepLayout.allocate(4, 16, "cpu", pages_per_slot=2, score_rows=8)
        lay.token_ids[:12] = torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(1)).int()
        lay.n_tokens[0], lay.n_score[0] = 12, 6
        lay.score_row[:] = torch.tensor([0, 1, 2, 5, 9, 11, 3, 3], dtype=torch.int32)
        lay.score_top[:] = torch.tensor([0, 3, 20, 1, 0, 2, 9, 9], dtype=torch.int32)
        step = NullStep(NullModel(NullOptions(vocab, 0.0, "next")), 4, kernel=kernel)
        lay.score_token[:] = step.table[lay.token_ids[lay.score_row.long()].long()]  # the pattern ...
        lay.score_token[1::2] = torch.randint(0, vocab, (4,), generator=g).int()  # ... or any token
        lay.step_prompt_logprobs[:] = -7
        step.run(12, lay)
        results.append(lay.step_prompt_logprobs.clone())
    torch.testing.assert_close(results[1], results[0], atol=0, rtol=0)
    assert bool((results[0][6:] == -7).all()), "entries past n_score untouched"


# ---- the wire ---------------------------------------------------------------------------------


def _until_done(peer: RawPeer, ids) -> dict:
    got: dict = {i: [] for i in ids}
    open_ = set(ids)
    while open_:
        msg = peer.recv(60)
        got[msg["id"]].append(msg)
        if msg["op"] == "done":
            open_.discard(msg["id"])
    return got


@pytest.mark.parametrize("batch", [False, True])
def test_the_prompt_message_comes_first_and_means_the_prompt(batch):
    with running_server(n_slots=4, max_ctx=128, token_budget=16) as bg:
        peer = RawPeer(bg.address)
        if batch:
            peer.send(P.hello_msg(True))
            assert peer.recv()["batch"] is True
        prompt = list(range(5, 35))
        peer.send({"op": "generate", "id": 1, "prompt_ids": prompt, "max_tokens": 3, "prompt_logprobs": 2})
        peer.send({"op": "generate", "id": 2, "prompt": "hello there", "max_tokens": 0, "prompt_logprobs": 0})
        peer.send(
            {"op": "generate", "id": 3, "prompt_ids": prompt, "max_tokens": 2, "n": 3, "prompt_logprobs": 1}
        )
        raw: list[dict] = []
        while sum(m["op"] == "done" for m in raw) < 3:
            msg = peer.recv(60)
            raw += list(expand_batch(msg)) if msg["op"] == "batch" else [msg]
    by_id = {i: [m for m in raw if m["id"] == i] for i in (1, 2, 3)}
    for i, n_prompt in ((1, 30), (2, None), (3, 30)):
        msgs = by_id[i]
        first = msgs[0]
        assert first["op"] == "token" and first["token_ids"] == [] and "prompt_logprobs" in first
        assert sum("prompt_logprobs" in m for m in msgs) == 1, "one prompt message per request"
        ids = first["prompt_token_ids"]
        if n_prompt is not None:
            assert ids == prompt
        entries = P.prompt_logprob_entries(first)
        assert len(entries) == len(ids) == len(first["prompt_tokens"]) and entries[0] is None
        asked = {1: 2, 2: 0, 3: 1}[i]
        for entry in entries[1:]:
            assert entry["logprob"] <= 0 and len(entry["top_ids"]) == asked
            assert entry["top_logprobs"] == sorted(entry["top_logprobs"], reverse=True)
            if asked:
                assert entry["logprob"] <= entry["top_logprobs"][0] + 1e-6
        done = msgs[-1]
        tokens = sum(len(m.get("token_ids", ())) for m in msgs)
        assert done["op"] == "done" and done["usage"]["prompt_tokens"] == len(ids)
        assert done["usage"]["completion_tokens"] == tokens == {1: 3, 2: 0, 3: 6}[i]
    assert by_id[3][0].get("index") == 0  # n > 1: choice 0 scores the prompt, once
    assert by_id[2][0]["prompt_text"] == "hello there"


def test_a_server_that_scores_nothing_refuses_by_name():
    with running_server(n_slots=2, max_ctx=64, token_budget=8, prompt_logprobs_rows=0) as bg:
        peer = RawPeer(bg.address)
        peer.send({"op": "generate", "id": 1, "prompt_ids": [5, 6, 7], "max_tokens": 2, "prompt_logprobs": 1})
        peer.send({"op": "generate", "id": 2, "prompt_ids": [5, 6, 7], "max_tokens": 2})
        got = _until_done(peer, [1, 2])
    refused = got[1][-1]
    assert refused["finish_reason"] == "error" and refused["error"]["code"] == "bad_request"
    assert refused["error"]["message"].startswith("prompt_logprobs: ")
    assert got[2][-1]["finish_reason"] == "length", "the server serves everyone else"
