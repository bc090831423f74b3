"""Speculative decoding through the whole server: `--speculative ngram` on the CPU backend,
with the null model (its "next" pattern: each token is the one after it, so a prompt that
holds a run and then its start makes the answer quote the run) over real sockets on 127.0.0.1.
The host runs no code of its own for drafts: the engine thread calls the same Python functions
per step with speculation as without, and the scheduler does all of it."""

from __future__ import annotations

import sys
import threading

import pytest

from ringleader.device.backends.cpu import CpuBackend
from tests.conftest import RawPeer, running_server

RUN = list(range(100, 160))
PROMPT = RUN + RUN[:3]  # the answer continues the run: 103, 104, ... (as the prompt did)


def _answers(peer: RawPeer, n: int, **extra) -> dict[int, list[int]]:
    for rid in range(1, n + 1):
        peer.send({"op": "generate", "id": rid, "prompt_ids": PROMPT, "max_tokens": 50, **extra})
    out: dict[int, list[int]] = {rid: [] for rid in range(1, n + 1)}
    done = 0
    while done < n:
        m = peer.recv(60)
        if m["op"] == "token":
            out[m["id"]] += m["token_ids"]
        elif m["op"] == "done":
            done += 1
            assert m["finish_reason"] == "length", m
        elif m["op"] == "error":
            raise AssertionError(m)
    return out


def _stats(peer: RawPeer) -> dict:
    peer.send({"op": "stats", "id": 9999})
    while True:
        m = peer.recv(10)
        if m.get("op") == "stats":
            return m["device"]


def _serve(speculative: str, profile: bool):
    """Answers, device counters, and the code objects the engine thread ran (profile)."""
    seen: set = set()

    def tracer(frame, event, arg):
        if event == "call" and threading.current_thread().name == "rl-engine":
            seen.add(frame.f_code)

    options = dict(null_pattern="next", null_vocab=4096, speculative=speculative, n_slots=4)
    if profile:
        threading.setprofile(tracer)
    try:
        with running_server("null", backend_cls=CpuBackend, **options) as bg:
            peer = RawPeer(bg.address)
            answers = _answers(peer, 3, logprobs=1)
            stats = _stats(peer)
            peer.close()
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    return answers, stats, seen


@pytest.mark.skipif(sys.gettrace() is not None, reason="a tracer is already installed")
def test_the_host_runs_nothing_of_its_own_for_drafts():
    off, off_stats, off_code = _serve("off", profile=True)
    on, on_stats, on_code = _serve("ngram", profile=True)
    want = list(range(103, 153))
    assert off == on == {1: want, 2: want, 3: want}
    # the drafts were the scheduler's: verified and accepted, in fewer steps
    assert on_stats["spec_accepted_tokens"] >= 100 and off_stats["spec_drafts"] == 0
    assert on_stats["steps"] < 0.5 * off_stats["steps"]
    # and the engine thread ran no Python function it does not run without them (the profile
    # saw its loop: the phases and the step)
    assert {"critical", "overlapped", "run"} <= {c.co_name for c in on_code & off_code}
    extra = {f"{c.co_filename}:{c.co_name}" for c in on_code - off_code}
    assert not extra, extra


def test_the_counters_reach_prometheus_under_vllms_names():
    from ringleader.hostctl.serving.prometheus import MetricsExporter
    from tests.test_prometheus import P, scrape_until

    options = dict(null_pattern="next", null_vocab=4096, speculative="ngram", n_slots=4)
    with running_server("null", backend_cls=CpuBackend, **options) as bg:
        with MetricsExporter(bg.server, "127.0.0.1", 0) as exporter:
            peer = RawPeer(bg.address)
            _answers(peer, 2)
            stats = _stats(peer)
            names = ("drafts", "draft_tokens", "accepted_tokens")
            s = scrape_until(exporter.url, lambda s: s.value(P + "spec_decode_num_accepted_tokens_total") > 0)
            got = {n: s.value(f"{P}spec_decode_num_{n}_total") for n in names}
            peer.close()
    assert got == {n: stats["spec_" + n] for n in names}
    assert 0 < got["accepted_tokens"] <= got["draft_tokens"] and got["drafts"] > 0
