"""`n` on the native protocol (1.5): n choices under one id, each with its own seed stream,
every token frame carrying its index, each choice's last chunk its finish_reason, one `done` for
the request with the usage summed; the prompt prefilled once where the prefix cache holds it;
aborting one choice or all; and no field a request did not ask for on the wire."""

from __future__ import annotations

import pytest

from ringleader.ipc.client import Client
from tests.conftest import RawPeer, running_server, wait_until

PROMPT = list(range(3, 3 + 40))  # two full pages of 16 and a partial one


@pytest.fixture(scope="module")
def server():
    with running_server(n_slots=8, max_ctx=256, token_budget=32) as bg:
        yield bg


@pytest.fixture
def client(server):
    with Client(server.address, timeout=60) as c:
        yield c


def _prefix_hits(client) -> int:
    return int(client.stats()["device"]["prefix_cache_hits"])


def test_each_choice_equals_the_single_request_with_its_seed(client):
    sampled = dict(temperature=1.0, top_k=50, max_tokens=12, ignore_eos=True)
    stream = client.complete(prompt_ids=PROMPT, n=3, seed=41, **sampled)
    again = client.complete(prompt_ids=PROMPT, n=3, seed=41, **sampled)
    assert [c.index for c in stream.choices] == [0, 1, 2]
    for choice, repeat in zip(stream.choices, again.choices):
        assert choice.token_ids == repeat.token_ids  # reproducible
        alone = client.complete(prompt_ids=PROMPT, seed=41 + choice.index, **sampled)
        assert choice.token_ids == alone.token_ids
        assert choice.finish_reason == "length"
    assert len({tuple(c.token_ids) for c in stream.choices}) > 1  # three seeds, not one answer
    done = stream.done
    assert done.ok and done.prompt_tokens == len(PROMPT) and done.completion_tokens == 36
    assert [(e.index, e.finish_reason, e.completion_tokens) for e in done.choices] == [
        (0, "length", 12),
        (1, "length", 12),
        (2, "length", 12),
    ]


def test_the_prompt_is_prefilled_once(client):
    prompt = [7] + list(range(100, 100 + 47))  # three full pages, new to the cache
    before = _prefix_hits(client)
    stream = client.complete(prompt_ids=prompt, n=4, max_tokens=4, ignore_eos=True)
    assert stream.done.ok and len(stream.choices) == 4
    # choices 1..3 each find the prompt's three full pages (48 tokens) cached by choice 0
    assert wait_until(lambda: _prefix_hits(client) - before >= 3 * 32)
    assert _prefix_hits(client) - before == 3 * 32


def test_frames_carry_what_was_asked_and_nothing_else(server):
    peer = RawPeer(server.address)
    try:
        peer.send({"op": "generate", "id": "one", "prompt_ids": PROMPT, "max_tokens": 3})
        frames = peer.recv_until(lambda m: m["op"] == "done")
        assert all(set(m) <= {"op", "id", "token_ids", "text"} for m in frames if m["op"] == "token")
        assert "choices" not in frames[-1]

        peer.send({"op": "generate", "id": "many", "prompt_ids": PROMPT, "max_tokens": 3, "n": 2})
        frames = peer.recv_until(lambda m: m["op"] == "done")
        tokens = [m for m in frames if m["op"] == "token"]
        assert all(m["index"] in (0, 1) and "logprobs" not in m for m in tokens)
        ends = [m for m in tokens if "finish_reason" in m]
        assert sorted(m["index"] for m in ends) == [0, 1]  # one last chunk per choice
        for m in ends:  # and nothing of its choice after it
            assert not [f for f in tokens[tokens.index(m) + 1 :] if f["index"] == m["index"]]
        done = frames[-1]
        assert done["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 6}
        assert [c["index"] for c in done["choices"]] == [0, 1]
        assert peer.quiet_for(0.3) == []  # exactly one done
    finally:
        peer.close()


def test_abort_one_choice_and_the_others_go_on(client):
    stream = client.generate(prompt_ids=PROMPT, n=3, max_tokens=200, ignore_eos=True)
    first = next(stream)
    stream.abort(index=1)
    done = stream.wait(timeout=60)
    ends = {e.index: e for e in done.choices}
    assert ends[1].finish_reason == "abort" and ends[1].completion_tokens < 200
    assert ends[0].finish_reason == ends[2].finish_reason == "length"
    assert ends[0].completion_tokens == ends[2].completion_tokens == 200
    assert done.finish_reason == "length"  # the first choice's
    assert first.index in (0, 1, 2)


def test_abort_without_index_ends_every_choice_once(client):
    stream = client.generate(prompt_ids=PROMPT, n=4, max_tokens=200, ignore_eos=True)
    next(stream)
    stream.abort()
    done = stream.wait(timeout=60)
    assert done.finish_reason == "abort"
    assert sorted(e.index for e in done.choices) == [0, 1, 2, 3]
    assert all(e.finish_reason in ("abort", "length") for e in done.choices)


def test_a_timeout_ends_every_choice_with_one_error(client):
    stream = client.generate(prompt_ids=PROMPT, n=3, max_tokens=200, ignore_eos=True, timeout_ms=50)
    done = stream.wait(timeout=60)
    assert done.finish_reason == "error" and done.error_code == "timeout"
    assert [e.finish_reason for e in done.choices] == ["error"] * 3


def test_n_is_judged_by_its_declaration(server):
    peer = RawPeer(server.address)
    try:
        for bad in (0, 129, "2", 1.5):
            peer.send({"op": "generate", "id": 1, "prompt_ids": PROMPT, "n": bad})
            done = peer.recv_until(lambda m: m["op"] == "done")[-1]
            assert done["error"]["code"] == "bad_request" and done["error"]["message"].startswith("n:")
        peer.send({"op": "abort", "id": 1, "index": -1})
        error = peer.recv_until(lambda m: m["op"] == "error")[-1]
        assert "index" in error["message"]
    finally:
        peer.close()


def test_many_choices_of_many_requests_each_end_once(client):
    streams = [
        client.generate(prompt_ids=PROMPT[: 5 + k], n=1 + k % 4, max_tokens=5 + k, ignore_eos=True)
        for k in range(12)
    ]
    for k, stream in enumerate(streams):
        done = stream.wait(timeout=120)
        n = 1 + k % 4
        assert done.ok and done.completion_tokens == n * (5 + k)
        assert len(stream.choices) == n
        assert all(len(c.token_ids) == 5 + k for c in stream.choices)


def test_the_books_balance_with_choices(client):
    # every choice is counted once accepted and once finished (docs/metrics.md)
    client.complete(prompt_ids=PROMPT, n=5, max_tokens=3)
    assert wait_until(lambda: client.stats()["in_flight"] == 0)
    stats = client.stats()
    assert stats["accepted"] == sum(stats["finished"].values())


def test_the_choices_bench_runs_and_counts_the_shared_prefill(tmp_path):
    from ringleader.bench.lab import choices

    out = tmp_path / "choices.json"
    assert (
        choices.main(
            ["--n", "3", "--prompt-len", "40", "--max-tokens", "2", "--repeats", "1", "--json", str(out)]
        )
        == 0
    )
    import json

    median = json.loads(out.read_text())["median"]
    # 40 tokens: two full pages cached for choices 1 and 2 (the last token's page runs to sample)
    assert median["shared"]["prefix_hit_tokens"] == 2 * 32 and median["unshared"]["prefix_hit_tokens"] == 0
    assert median["shared"]["step_rows"] == 40 + 2 * 8 + 3 and median["unshared"]["step_rows"] == 3 * 40 + 3
