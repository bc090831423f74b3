"""Prompt logprobs on the real model (SmolLM2-135M-Instruct, its GGUF dequantized to fp32 on the
CPU) against transformers' log_softmax over the same prompt: a raw prompt and a chat prompt, each
scored cold and again once the prefix cache holds its pages (a request that asks for prompt
logprobs recomputes them), with a small --prompt-logprobs-rows so the prompt is scored over
several steps."""

from __future__ import annotations

import torch

from ringleader.ipc import protocol as P
from tests.conftest import RawPeer, running_server, transformers_fp32

TOP = 4
PROMPT = (
    "The history of the printing press begins in China, where woodblock printing was used on "
    "cloth and later on paper, long before Gutenberg built his press in Mainz."
)
MESSAGES = [{"role": "user", "content": "Name the capital of France."}]


def _ask(peer: RawPeer, rid: int, source: dict, scored: bool) -> dict:
    """The request's messages until its done; the prompt message first when scored."""
    extra = {"prompt_logprobs": TOP} if scored else {}
    peer.send({"op": "generate", "id": rid, **source, "max_tokens": 1, **extra})
    msgs = []
    while not msgs or msgs[-1]["op"] != "done":
        msgs.append(peer.recv(120))
    assert msgs[-1]["finish_reason"] == "length", msgs[-1]
    return msgs[0]


def test_prompt_logprobs_equal_transformers_log_softmax(smollm2_gguf):
    hf = transformers_fp32(smollm2_gguf)
    got = []
    options = dict(weights="fp32", n_slots=4, max_ctx=256, token_budget=16, prompt_logprobs_rows=7)
    with running_server(str(smollm2_gguf), **options) as bg:
        peer = RawPeer(bg.address)
        for rid, source in enumerate(({"prompt": PROMPT}, {"messages": MESSAGES})):
            cold = _ask(peer, 10 * rid + 1, source, scored=True)
            _ask(peer, 10 * rid + 2, source, scored=False)  # its pages are cached now
            warm = _ask(peer, 10 * rid + 3, source, scored=True)
            got += [cold, warm]
    for msg in got:
        ids = msg["prompt_token_ids"]
        assert len(ids) > 16, "longer than one page and than the rows a step scores"
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        entries = P.prompt_logprob_entries(msg)
        assert entries[0] is None and len(entries) == len(ids)
        for pos in range(1, len(ids)):
            row, entry = expected[pos - 1], entries[pos]
            assert abs(entry["logprob"] - row[ids[pos]].item()) < 1e-4, (pos, entry["logprob"])
            values, _ = row.topk(TOP)
            for tid, lp, want in zip(entry["top_ids"], entry["top_logprobs"], values.tolist()):
                assert abs(lp - row[tid].item()) < 1e-4 and abs(lp - want) < 1e-4
            assert entry["token"] == msg["prompt_tokens"][pos]
    # cold and warm agree (the cached pages did not stand in for scored rows)
    for cold, warm in ((got[0], got[1]), (got[2], got[3])):
        assert cold["prompt_token_ids"] == warm["prompt_token_ids"]
        a = cold["prompt_logprobs"]["logprob"][1:]
        b = warm["prompt_logprobs"]["logprob"][1:]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
