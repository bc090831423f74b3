"""Through the whole server: greedy output on a checkpoint written by transformers' save_pretrained
is token-identical to transformers' own generate (fp32, CPU), for id and text prompts, alone and
under concurrency."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from ringleader.ipc.client import Client  # noqa: E402
from tests.conftest import running_server  # noqa: E402

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "ringleader streams tokens over zeromq",
    "a persistent kernel schedules the batch",
    "hello world, hello ring",
] * 20


def _tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("ckpt")
    hf.save_pretrained(path, safe_serialization=True)
    tok = _tokenizer_json(path)
    return hf, path, tok


def _hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt) :].tolist()


def test_server_greedy_matches_transformers(checkpoint):
    hf, path, tok = checkpoint
    prompts = [[1, 5, 17, 200, 33], [1, 250, 3, 3, 90, 91, 92, 7], [1, 42], list(range(1, 40))]
    texts = ["hello world", "the lazy dog jumps"]
    n = 20
    expected = [_hf_greedy(hf, p, n) for p in prompts]
    expected_text = [_hf_greedy(hf, tok.encode(t).ids, n) for t in texts]
    assert len({tuple(e) for e in expected}) == len(expected), "outputs must vary with the prompt"
    # a small token budget forces the longer prompts through chunked prefill beside decodes
    with running_server(str(path), n_slots=4, max_ctx=256, token_budget=8) as bg:
        with Client(bg.address, timeout=120) as c:
            streams = [c.generate(prompt_ids=p, max_tokens=n, ignore_eos=True) for p in prompts]
            text_streams = [c.generate(t, max_tokens=n, ignore_eos=True) for t in texts]
            for s in streams + text_streams:
                s.wait()
    assert [s.token_ids for s in streams] == expected
    assert [s.token_ids for s in text_streams] == expected_text
    for s, t in zip(text_streams, texts):
        assert s.done.prompt_tokens == len(tok.encode(t).ids)
        assert s.text == tok.decode(s.token_ids, skip_special_tokens=True)
