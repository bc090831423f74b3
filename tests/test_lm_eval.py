"""lm-eval's multiple-choice scoring through the gateway, on SmolLM2 served with `--weights fp32`.

lm-eval's `local-completions` model scores a (context, continuation) pair by prompt logprobs, the
legacy OpenAI way: POST /v1/completions with the tokenized context+continuation as `prompt` (a list
of token-id lists, `--batch_size` of them per request; a plain string with tokenized_requests=False
and batch size 1), `echo: true`, `logprobs: 1`, `max_tokens: 1`, `temperature: 0`, `seed: 1234`;
from each choice (sorted by `index`, one per prompt) it reads `logprobs.token_logprobs[ctxlen:-1]`
(the continuation's tokens: the echoed prompt's logprobs, the first null, then the one generated
token, dropped) and sums them, and calls the continuation greedy when each of those equals the
largest value of the same position's `top_logprobs` dict.  With no local tokenizer it first probes
GET /tokenizer_info (a dict with `eos_token`) and POST /tokenize ({"prompt", "add_special_tokens":
false} -> {"tokens"}), then tokenizes every context through /tokenize ("remote").

The first tests send those requests by hand and check them against transformers' log_softmax over
the same fp32 weights (needs no lm-eval); the last runs `python -m lm_eval --model
local-completions` itself (skipped where this interpreter has no lm-eval) on the local task
tests/data/lm_eval/rl_mc.yaml and compares with hf_reference.json, `lm_eval --model hf` on the
same weights (bench/lm_eval_check.py made it and compares)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from ringleader.bench import lm_eval_check
from ringleader.hostctl.gateway.app import BackgroundGateway
from tests.conftest import running_server

TASK_DIR = Path(__file__).resolve().parent / "data" / "lm_eval"
ITEMS = [json.loads(line) for line in (TASK_DIR / "items.jsonl").read_text().splitlines()]
TOKEN_TOLERANCE = 1e-4  # one token's logprob, server against transformers (fp32 both)
PER_REQUEST = 8  # prompts per request, as `lm_eval --batch_size 8` sends them


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    """transformers' model and tokenizer from the same GGUF file, dequantized to fp32."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    where = dict(gguf_file=smollm2_gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), dtype=torch.float32, **where
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), **where)
    return model, tokenizer


@pytest.fixture(scope="module")
def stack(smollm2_gguf):
    """The server on the dequantized weights (a token budget that splits a batch's prefill over
    steps) and the gateway in front of it; (gateway, model name)."""
    with running_server(str(smollm2_gguf), weights="fp32", n_slots=8, max_ctx=512, token_budget=32) as srv:
        with BackgroundGateway(srv.address) as gw:
            yield gw, get(gw, "/v1/models")["data"][0]["id"]


def get(gw, path: str) -> dict:
    with urllib.request.urlopen(gw.url + path, timeout=60) as r:
        return json.loads(r.read())


def post(gw, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        gw.url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": "Bearer "},  # lm-eval's, no key
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # the gateway's own words, in the failure
        raise AssertionError(
            f"POST {path} {json.dumps(body)[:300]} -> {e.code} {e.read().decode()}"
        ) from None


def lm_eval_body(model: str, prompt, max_tokens: int = 1) -> dict:
    """The body local-completions sends for loglikelihood (openai_completions.py _create_payload)."""
    return dict(
        model=model, prompt=prompt, temperature=0, max_tokens=max_tokens, logprobs=1, seed=1234, echo=True
    )


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a pair into tokens: the whole encoded, the context's length cut off."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx) :]


def pairs(tokenizer) -> list[tuple[int, list[int], list[int]]]:
    """(item, context ids, continuation ids) for every choice of the task, in order."""
    out = []
    for item in ITEMS:
        context = f"Question: {item['question']}\nAnswer:"
        out += [(item["id"], *encode_pair(tokenizer, context, " " + c)) for c in item["choices"]]
    return out


def transformers_logprobs(model, ids: list[int]) -> tuple[list[float], list[bool]]:
    """Each prompt token's logprob given the ones before it (the first has none: what echo's
    token_logprobs[1:] holds), and whether it was that position's most likely token."""
    return transformers_batch(model, [ids])[0]


def transformers_batch(model, prompts: list[list[int]]) -> list[tuple[list[float], list[bool]]]:
    """transformers_logprobs of several prompts in one forward, right-padded: a causal model's
    rows for a prompt's own positions do not see the padding after them."""
    width = max(map(len, prompts))
    batch = torch.tensor([ids + [0] * (width - len(ids)) for ids in prompts])
    with torch.no_grad():
        rows = torch.log_softmax(model(batch).logits.float(), -1)
    out = []
    for k, ids in enumerate(prompts):
        values = [rows[k, i - 1, ids[i]].item() for i in range(1, len(ids))]
        out.append((values, [rows[k, i - 1].argmax().item() == ids[i] for i in range(1, len(ids))]))
    return out


def scored(choices: list[dict], prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """The choices of one echo response checked for the shape lm-eval reads, in prompt order."""
    assert sorted(c["index"] for c in choices) == list(range(len(prompts)))
    out = []
    for choice in sorted(choices, key=lambda c: c["index"]):
        ids = prompts[choice["index"]]
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens, (len(lp["token_logprobs"]), len(ids))
        assert len(lp["top_logprobs"]) == len(lp["tokens"]) == len(lp["token_logprobs"])
        assert lp["token_logprobs"][0] is None  # nothing comes before the first token
        for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert isinstance(value, float) and value <= 0.0
            assert isinstance(top, dict) and top and max(top.values()) >= value - 1e-6
        out.append(lp)
    return out


def sum_and_greedy(lp: dict, ctxlen: int, max_tokens: int) -> tuple[float, bool]:
    """What lm-eval makes of one choice: the continuation's summed logprob, and whether each of
    its tokens was the position's top one."""
    end = len(lp["token_logprobs"]) - max_tokens
    values, tops = lp["token_logprobs"][ctxlen:end], lp["top_logprobs"][ctxlen:end]
    return sum(values), all(v == max(t.values()) for v, t in zip(values, tops))


def test_lm_evals_batched_echo_requests_score_as_transformers_does(stack, hf):
    """Every choice of the task sent as lm-eval sends it (token-id lists, PER_REQUEST a request):
    each prompt token's logprob is transformers' to 1e-4, and the summed continuations pick the
    same answers, with the committed reference's accuracy."""
    gw, name = stack
    model, tokenizer = hf
    scored_pairs = pairs(tokenizer)
    sums, greedy = [], []
    for start in range(0, len(scored_pairs), PER_REQUEST):
        batch = scored_pairs[start : start + PER_REQUEST]
        prompts = [ctx + cont for _, ctx, cont in batch]
        reply = post(gw, "/v1/completions", lm_eval_body(name, prompts))
        expected = transformers_batch(model, prompts)
        for (_, ctx, _), ids, lp, (want, top) in zip(
            batch, prompts, scored(reply["choices"], prompts, 1), expected
        ):
            got = lp["token_logprobs"][1 : len(ids)]
            worst = max(abs(g - w) for g, w in zip(got, want))
            assert worst < TOKEN_TOLERANCE, (ids, got, want)
            total, is_greedy = sum_and_greedy(lp, len(ctx), 1)
            assert abs(total - sum(want[len(ctx) - 1 :])) < 1e-3
            sums.append(total)
            greedy.append(is_greedy == all(top[len(ctx) - 1 :]))
    assert all(greedy)
    reference = lm_eval_check.load_reference(TASK_DIR)
    picks = [max(range(4), key=lambda i, k=k: sums[4 * k + i]) for k in range(len(ITEMS))]
    acc = [float(pick == item["answer"]) for pick, item in zip(picks, ITEMS)]
    assert acc == [item["acc"] for item in reference["items"]]
    assert sum(acc) / len(acc) == reference["acc"]
    for k, item in enumerate(reference["items"]):
        for i, want_ll in enumerate(item["loglikelihoods"]):
            assert abs(sums[4 * k + i] - want_ll) < lm_eval_check.LL_TOLERANCE, (k, i)


def test_max_tokens_0_strings_and_a_single_prompt_echo_the_same_logprobs(stack, hf):
    """OpenAI's legacy scoring (max_tokens 0: the prompt's logprobs alone), lm-eval's string
    prompts (tokenized_requests=False: a list of strings, or one string at batch size 1) and a
    one-prompt list give the logprobs the token-id batch gives."""
    gw, name = stack
    model, tokenizer = hf
    chosen = pairs(tokenizer)[8:12]  # one item's four choices
    prompts = [ctx + cont for _, ctx, cont in chosen]
    texts = [tokenizer.decode(ids) for ids in prompts]
    assert [tokenizer(t, add_special_tokens=False).input_ids for t in texts] == prompts
    base = scored(post(gw, "/v1/completions", lm_eval_body(name, prompts))["choices"], prompts, 1)
    zero = scored(post(gw, "/v1/completions", lm_eval_body(name, prompts, 0))["choices"], prompts, 0)
    strings = scored(post(gw, "/v1/completions", lm_eval_body(name, texts))["choices"], prompts, 1)
    one_string = scored(post(gw, "/v1/completions", lm_eval_body(name, texts[0]))["choices"], prompts[:1], 1)
    one_list = scored(post(gw, "/v1/completions", lm_eval_body(name, prompts[:1]))["choices"], prompts[:1], 1)
    for k, (_, ctx, _) in enumerate(chosen):
        n = len(prompts[k])
        want = base[k]["token_logprobs"][1:n]
        assert all(abs(a - b) < 1e-5 for a, b in zip(zero[k]["token_logprobs"][1:], want))
        assert all(abs(a - b) < 1e-5 for a, b in zip(strings[k]["token_logprobs"][1:n], want))
        assert strings[k]["tokens"][:n] == base[k]["tokens"][:n]
        assert sum_and_greedy(zero[k], len(ctx), 0)[0] == pytest.approx(
            sum_and_greedy(base[k], len(ctx), 1)[0]
        )
    for single in (one_string[0], one_list[0]):
        n = len(prompts[0])
        assert all(
            abs(a - b) < 1e-5 for a, b in zip(single["token_logprobs"][1:n], base[0]["token_logprobs"][1:n])
        )
    assert base[0]["tokens"][: len(prompts[0])] == [tokenizer.decode([t]) for t in prompts[0]]


def test_a_shared_context_in_the_prefix_cache_still_echoes_its_logprobs(stack, hf):
    """lm-eval sends each context once per choice: with a context of several KV pages, the second
    choice's prompt finds them in the prefix cache; its context's logprobs must still be there."""
    gw, name = stack
    model, tokenizer = hf
    context = (
        "The following is a short passage about the solar system. The Sun is a star at the center "
        "of the solar system, and eight planets travel around it on nearly circular paths. The "
        "largest of them is a gas giant with a great red storm.\nQuestion: Which planet is it?\nAnswer:"
    )
    chosen = [encode_pair(tokenizer, context, " " + c) for c in ("Jupiter", "Mars", "Venus", "Saturn")]
    assert len(chosen[0][0]) > 48  # three pages of 16 tokens or more
    prompts = [ctx + cont for ctx, cont in chosen]
    one_by_one = [
        scored(post(gw, "/v1/completions", lm_eval_body(name, [p]))["choices"], [p], 1)[0] for p in prompts
    ]
    together = scored(post(gw, "/v1/completions", lm_eval_body(name, prompts))["choices"], prompts, 1)
    sums, want_sums = [], []
    for (ctx, _), ids, alone, batched in zip(chosen, prompts, one_by_one, together):
        want, _ = transformers_logprobs(model, ids)
        for lp in (alone, batched):
            got = lp["token_logprobs"][1 : len(ids)]
            assert max(abs(g - w) for g, w in zip(got, want)) < TOKEN_TOLERANCE
        sums.append(sum_and_greedy(batched, len(ctx), 1)[0])
        want_sums.append(sum(want[len(ctx) - 1 :]))
    assert max(range(4), key=sums.__getitem__) == max(range(4), key=want_sums.__getitem__)


def test_the_tokenizer_routes_lm_eval_reads(stack, hf):
    """lm-eval's remote tokenizer: /tokenizer_info names eos_token (its probe needs the key; its
    eos_token_id is /tokenize of that text), /tokenize takes {"prompt", "add_special_tokens":
    false} and answers {"tokens"}, /detokenize takes {"tokens"} and answers {"prompt"}."""
    gw, _ = stack
    _, tokenizer = hf
    info = get(gw, "/tokenizer_info")
    assert info["eos_token"] == tokenizer.eos_token
    text = "Question: What is the capital of France?\nAnswer: Paris"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert (
        post(gw, "/tokenize", {"prompt": "test", "add_special_tokens": False})["tokens"]
        == tokenizer("test", add_special_tokens=False).input_ids
    )
    assert post(gw, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"] == ids
    assert post(gw, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"] == [
        tokenizer.eos_token_id
    ]
    assert post(gw, "/detokenize", {"tokens": ids})["prompt"] == text


def _lm_eval_missing() -> str | None:
    """Why this interpreter cannot run `python -m lm_eval --model local-completions`, or None."""
    if importlib.util.find_spec("lm_eval") is None:
        return f"lm_eval is not importable in {sys.executable}: pip install 'lm-eval[api]>=0.4.13,<0.5'"
    missing = [m for m in ("aiohttp", "tenacity", "requests", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        return f"lm_eval's API models need {missing}: pip install 'lm-eval[api]>=0.4.13,<0.5'"
    return None


LM_EVAL_MISSING = _lm_eval_missing()


@pytest.mark.skipif(LM_EVAL_MISSING is not None, reason=str(LM_EVAL_MISSING))
@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_lm_eval_local_completions_gives_the_hf_accuracy(stack, smollm2_gguf, tmp_path, backend):
    """`lm_eval --model local-completions` against the gateway: the same acc and acc_norm as
    `lm_eval --model hf` on the same fp32 weights (hf_reference.json), the same items right, and
    each choice's loglikelihood within LL_TOLERANCE.  huggingface: tokenized here from the GGUF's
    tokenizer, two requests in flight (lm-eval's aiohttp path); remote: auto-detected, tokenized by
    the gateway's /tokenize, one request at a time (its requests path)."""
    gw, name = stack
    tokenizer = None
    if backend == "huggingface":
        pytest.importorskip("transformers")
        tokenizer = lm_eval_check.save_gguf_tokenizer(smollm2_gguf, tmp_path / "tokenizer")
    out = tmp_path / "out"
    cmd = lm_eval_check.local_command(
        sys.executable,
        gw.url,
        name,
        out,
        tokenizer=tokenizer,
        batch_size=PER_REQUEST,
        num_concurrent=2 if backend == "huggingface" else 1,
        task_dir=TASK_DIR,
    )
    env = lm_eval_check.offline_env(tmp_path / "hf_home")
    ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420, cwd=tmp_path)
    log = ran.stdout + ran.stderr
    assert ran.returncode == 0, log[-6000:]
    if backend == "remote":
        assert "Auto-detected remote tokenizer support" in log, log[-3000:]
    run = lm_eval_check.read_run(out)
    reference = lm_eval_check.load_reference(TASK_DIR)
    assert run["n"] == reference["n"] == len(ITEMS)
    assert lm_eval_check.compare(run, reference) == []
