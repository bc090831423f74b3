"""The null model (`--model null`): its options refused by name, its patterns, its step in every
form (the torch reference, the CPU's C step, the one Triton launch under the interpreter) giving
the same tokens and logprobs records, and a server on it answering as the patterns say,
with the stated busy time held on the engine thread. The CUDA form on a GPU is in
tests/test_gpu_backend.py; its ahead-of-time compile in tests/test_triton_aot.py."""

from __future__ import annotations

import math
import time

import pytest
import torch

from ringleader.device.engine_config import EngineConfig
from ringleader.device.null.null_model import NULL_LOGIT, NullModel, pattern_table, record_logprobs
from ringleader.device.null.null_options import NullOptions
from ringleader.device.null.null_step import NullStep
from ringleader.device.sampling.sampler import LOGPROBS_WORD
from ringleader.device.step.step_layout import StepLayout
from ringleader.device.text.tokenizer import ByteTokenizer
from ringleader.ipc.client import Client
from tests.conftest import running_server
from tests.triton_interpreter import run_interpreted_checks_of

EOS = ByteTokenizer.EOS


@pytest.mark.parametrize(
    "fields,words",
    [
        (dict(null_vocab=100), "--null-vocab must be an integer in [264,"),
        (dict(null_vocab=True), "--null-vocab must be an integer"),
        (dict(null_step_us=-1.0), "--null-step-us must be a number in [0,"),
        (dict(null_step_us=float("nan")), "--null-step-us must be a number"),
        (dict(null_pattern="zeros"), "--null-pattern must be one of next, repeat, eos"),
        (dict(null_step_wait="nap"), "--null-step-wait must be one of spin, sleep"),
    ],
)
def test_bad_options_are_refused_by_name(fields, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        EngineConfig(model="null", **fields)


def test_null_options_go_with_the_null_model_only():
    with pytest.raises(ValueError, match="--null-step-us goes with --model null, not --model tiny"):
        EngineConfig(model="tiny", null_step_us=5.0)
    assert EngineConfig(model="null").null_options() == NullOptions()
    got = EngineConfig(model="null", null_vocab=1000, null_step_us=12.5, null_pattern="eos").null_options()
    assert got == NullOptions(1000, 12.5, "eos") and got.step_ns == 12500


def test_patterns_never_emit_eos_unless_asked():
    nxt = pattern_table("next", 300, [EOS])
    assert nxt[0] == 1 and nxt[299] == 0 and nxt[EOS - 1] == EOS + 1 and nxt[EOS] == EOS + 1
    assert not bool((nxt == EOS).any())
    rep = pattern_table("repeat", 300, [EOS])
    assert rep[5] == 5 and rep[EOS] == EOS + 1 and not bool((rep == EOS).any())
    assert bool((pattern_table("eos", 300, [EOS]) == EOS).all())
    two = pattern_table("next", 300, [10, 11])  # adjacent end ids are both skipped
    assert two[9] == 12 and not bool(torch.isin(two, torch.tensor([10, 11])).any())


def test_record_logprobs_are_the_null_logits_softmax():
    vocab = 1000
    logits = torch.zeros(vocab, dtype=torch.float64)
    logits[7] = NULL_LOGIT
    lp = torch.log_softmax(logits, 0)
    token, other = record_logprobs(vocab)
    assert math.isclose(token, float(lp[7]), rel_tol=1e-7) and math.isclose(other, float(lp[0]), rel_tol=1e-9)


def _layout(seed: int, n_slots: int = 24, budget: int = 40, vocab: int = 500) -> tuple[StepLayout, int]:
    """A step's layout with random rows and sample entries (some past n_samples: stale) and
    random logprobs asks."""
    g = torch.Generator().manual_seed(seed)
    lay = StepLayout.allocate(n_slots, budget, "cpu", pages_per_slot=4)
    n_tokens = int(torch.randint(1, budget + 1, (1,), generator=g))
    lay.token_ids[:n_tokens] = torch.randint(0, vocab, (n_tokens,), generator=g, dtype=torch.int32)
    m = min(n_slots, n_tokens)
    n_samples = int(torch.randint(0, m + 1, (1,), generator=g))
    lay.sample_row[:m] = torch.randint(0, n_tokens, (m,), generator=g, dtype=torch.int32)
    lay.sample_slot[:m] = torch.randperm(n_slots, generator=g)[:m].to(torch.int32)
    lay.params["logprobs"][:m] = torch.randint(-1, 21, (m,), generator=g, dtype=torch.int32)
    lay.n_samples[0], lay.n_tokens[0] = n_samples, n_tokens
    lay.next_token[:] = -5  # what no step wrote
    lay.step_logprobs[:] = -7
    return lay, n_tokens


def _run(kernel: str, lay: StepLayout, bucket: int, vocab: int) -> StepLayout:
    NullStep(NullModel(NullOptions(vocab, 0.0, "next")), lay.next_token.shape[0], kernel=kernel).run(
        bucket, lay
    )
    return lay


def _check_forms_agree(kernels: tuple[str, ...]) -> None:
    vocab = 500
    for seed in range(12):
        results = []
        for kernel in ("torch", *kernels):
            lay, n_tokens = _layout(seed, vocab=vocab)
            results.append(_run(kernel, lay, n_tokens, vocab))
        ref = results[0]
        m = int(ref.n_samples[0])
        table = pattern_table("next", vocab, [EOS])
        for i in range(m):  # the pattern, at each live entry's slot
            slot, row = int(ref.sample_slot[i]), int(ref.sample_row[i])
            assert int(ref.next_token[slot]) == int(table[int(ref.token_ids[row])])
            asked = int(ref.params["logprobs"][i])
            rec = ref.step_logprobs[slot]
            if asked >= 0:
                assert int(rec[LOGPROBS_WORD["n_top"]]) == asked
                assert int(rec[LOGPROBS_WORD["top_ids"]]) == int(ref.next_token[slot])
            else:
                assert bool((rec == -7).all())
        untouched = torch.ones_like(ref.next_token, dtype=torch.bool)
        untouched[ref.sample_slot[:m].long()] = False
        assert bool((ref.next_token[untouched] == -5).all())  # stale entries write nothing
        for kernel, other in zip(kernels, results[1:]):
            assert torch.equal(other.next_token, ref.next_token), (kernel, seed)
            assert torch.equal(other.step_logprobs, ref.step_logprobs), (kernel, seed)


def test_the_native_step_is_the_torch_step():
    _check_forms_agree(("native",))


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_a_sleeping_step_takes_its_time_but_not_a_core(kernel):
    """--null-step-wait sleep: the step lasts its busy time on the wall clock, and the calling
    thread's CPU time stays a small part of it (a spin would hold the core all along)."""
    lay, n_tokens = _layout(3)
    model = NullModel(NullOptions(500, 30_000.0, "next", step_wait="sleep"))
    step = NullStep(model, lay.next_token.shape[0], kernel=kernel)
    step.run(n_tokens, lay)  # built and bound
    wall, cpu = time.perf_counter(), time.thread_time()
    step.run(n_tokens, lay)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall >= 0.029 and cpu < 0.5 * wall, (wall, cpu)


def run_interpreted_checks() -> None:
    """Under TRITON_INTERPRET=1 (a child process): the Triton step against both torch forms."""
    _check_forms_agree(("native", "triton"))
    print("null step: triton interpreted checks passed")


def test_the_triton_step_is_the_torch_step_under_the_interpreter():
    run_interpreted_checks_of("tests.test_null_model", "null step: triton interpreted checks passed")


def test_a_server_on_the_null_model_answers_as_its_pattern_says():
    with running_server("null", null_vocab=1000) as bg, Client(bg.address, timeout=30) as c:
        s = c.complete("abc", max_tokens=6)
        assert s.text == "defghi" and s.done.finish_reason == "length"
        s = c.complete(prompt_ids=[998], max_tokens=4)
        assert s.token_ids == [999, 0, 1, 2]  # wraps at the vocabulary
        s = c.complete(prompt_ids=[EOS - 2], max_tokens=4, stop_token_ids=[EOS + 3])
        assert s.token_ids == [EOS - 1, EOS + 1, EOS + 2, EOS + 3] and s.done.finish_reason == "stop"
        s = c.complete(prompt_ids=[40], max_tokens=3, logprobs=3, temperature=1.5, seed=4)
        token_lp, other_lp = record_logprobs(1000)
        assert s.token_ids == [41, 42, 43]  # sampling settings do not change a null token
        first = s.logprobs[0]
        assert first.top_ids == [41, 0, 1] and first.logprob == pytest.approx(token_lp, abs=1e-6)
        assert first.top_logprobs[1] == pytest.approx(other_lp, rel=1e-6)
        s = c.complete(prompt_ids=[50], max_tokens=3, n=3)
        assert [ch.token_ids for ch in s.choices] == [[51, 52, 53]] * 3 and s.done.completion_tokens == 9
        assert c.stats()["model_info"]["vocab_size"] == 1000


def test_the_eos_pattern_ends_every_request_at_once_and_step_us_holds_the_step():
    with (
        running_server("null", null_pattern="eos", null_step_us=3000.0) as bg,
        Client(bg.address, timeout=30) as c,
    ):
        s = c.complete(prompt_ids=[1, 2, 3], max_tokens=50)
        assert s.token_ids == [EOS] and s.done.finish_reason == "stop"
        s = c.complete(prompt_ids=[1], max_tokens=5, ignore_eos=True)
        assert s.token_ids == [EOS] * 5
        stats = c.stats()
    assert stats["backend"]["null_step_us"] == 3000.0 and stats["backend"]["weights"] == "none"
    assert stats["device"]["model_step_us_p50"] >= 3000.0  # a busy wait of at least the stated time
