"""Structured output's masks in the Triton samplers against sampling.sample() and mask_disallowed.

A constrained row (mask_at >= 0) may only draw a token its bitmask in `grammar` allows, in every
mode (greedy, temperature, top_k, top_p, min_p, penalties): the layered step's Triton
penalize_and_scale (device/sampling/triton_sampler.py) must give mask_disallowed's bits, so its
sample() draws torch's token exactly; the fused step's one-launch sampler
(device/sampling/triton_sample_row.py) must draw sample()'s token on every row clear of rounding
(test_triton_sample_row's margins), and a greedy constrained row must not take the lm_head's
argmax. A row without a constraint reads no mask word (a greedy one keeps the fast path), and
stale rows' garbage offsets stay inside the array.

The kernels run under the Triton interpreter in a child process (`run_interpreted_checks`); the
argument checks, the launch count and the ahead-of-time compile run in this process.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ringleader.device.sampling.sampler import SamplingTensors, mask_disallowed, sample
from ringleader.device.sampling.triton_sample_row import HAVE_TRITON, candidate_count, sample_rows_triton
from ringleader.device.step.step_layout import StepLayout
from ringleader.device.step.triton_launch import LaunchRecorder
from tests.test_triton_sample_row import (
    _counts,
    _install_fast_xor_sum,
    _logits,
    _params,
    clear_rows,
    valid_rows,
)
from tests.triton_interpreter import run_interpreted_checks_of

MARKER = "structured sampling interpreted checks passed"
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
GARBAGE = (10**9, -5, 2**31 - 1)  # offsets a stale (or corrupt) entry may hold
LAST_WORD = 0x5A5A5A5A  # the array's last word: what a clamped offset reads, half the tokens allowed


def test_structured_sampling_under_interpreter():
    run_interpreted_checks_of("tests.test_triton_structured_sampling", MARKER)


# ---- masks ---------------------------------------------------------------------------------------


def _bitmask(vocab: int, tokens) -> np.ndarray:
    """ipc/automaton.py's bitmask: bit t & 31 of word t >> 5 set for each allowed token."""
    bits = np.zeros(-(-vocab // 32) * 32, dtype=np.uint8)
    bits[np.asarray(tokens, dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def _grammar(logits: torch.Tensor, seed: int) -> tuple[torch.Tensor, dict[str, int]]:
    """A grammar array of a few masks at odd offsets (a gap before each), its last word
    LAST_WORD; the offsets by name. "not_argmax_<r>" allows only row r's raw second-best token."""
    m, vocab = logits.shape
    gen = np.random.default_rng(seed)
    second = logits.topk(2, dim=1).indices[:, 1].tolist()
    masks = {
        "one": [int(gen.integers(vocab))],
        "few": gen.choice(vocab, 20, replace=False),
        "many": np.flatnonzero(gen.random(vocab) < 0.6),
        "tail": np.arange(vocab - 40, vocab),  # the last word, partial when V % 32 != 0
        **{f"not_argmax_{r}": [second[r]] for r in range(m)},
    }
    words, offsets = [np.zeros(3, np.int32)], {}
    at = 3
    for name, tokens in masks.items():
        offsets[name] = at
        words.append(_bitmask(vocab, tokens))
        words.append(np.array([-1], np.int32))  # a gap of set bits: a wrong word index shows
        at += len(words[-2]) + 1
    words.append(np.array([LAST_WORD], np.int32))
    return torch.from_numpy(np.concatenate(words)), offsets


def _constrained(params: SamplingTensors, grammar: torch.Tensor, mask_at: list[int]) -> SamplingTensors:
    return SamplingTensors(
        params.counter,
        params.token_counts,
        params.slot,
        grammar=grammar,
        mask_at=torch.tensor(mask_at, dtype=torch.int32),
        **params.values,
    )


def _allowed(params: SamplingTensors, vocab: int) -> torch.Tensor:
    """bool [m, V]: the tokens each row may draw (everything for a row without a constraint)."""
    zeros = torch.zeros(params.mask_at.shape[0], vocab)
    return torch.isfinite(mask_disallowed(zeros, params.grammar, params.mask_at))


def _stale_unmasked(params: SamplingTensors, valid: torch.Tensor) -> SamplingTensors:
    """The fused sampler's reference: stale rows ignore their masks (their token is never used)."""
    mask_at = torch.where(valid, params.mask_at.to(torch.int32), -1)
    return SamplingTensors(
        params.counter,
        params.token_counts,
        params.slot,
        grammar=params.grammar,
        mask_at=mask_at,
        **params.values,
    )


# ---- the interpreted checks ----------------------------------------------------------------------


def run_interpreted_checks() -> None:
    """Entry point of the child process (TRITON_INTERPRET=1 set before anything imported triton)."""
    from ringleader.device.sampling import triton_sample_row as tsr
    from ringleader.device.sampling import triton_sampler as ts

    assert type(tsr._sample_row_kernel).__name__ == "InterpretedFunction", "triton imported too early"
    assert type(ts._penalize_and_scale_kernel).__name__ == "InterpretedFunction"
    _install_fast_xor_sum()
    t0 = time.perf_counter()
    clear = [0, 0]
    for vocab in (1000, 2048):
        for mode in MODES:
            got = check_mode(mode, vocab)
            clear[0] += got[0]
            clear[1] += got[1]
    check_greedy_constrained_ignores_the_head_argmax()
    check_garbage_offsets()
    check_the_steps_sampling()
    assert clear[0] >= 0.9 * clear[1], f"only {clear[0]} of {clear[1]} rows were clear of rounding"
    print(f"{MARKER} in {time.perf_counter() - t0:.1f} s; {clear[0]} of {clear[1]} rows clear of rounding")


M = 16
MODES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=[0.7, 1.0, 1.3, 2.0] * 4),
    "top_k": dict(temperature=1.1, top_k=[1, 5, 50, 1024] * 4),
    "top_p": dict(temperature=1.0, top_p=[0.3, 0.8, 0.95, 0.999] * 4),
    "min_p": dict(temperature=0.9, min_p=[0.02, 0.1, 0.3, 0.0] * 4),
    "penalized": dict(
        temperature=[0.0, 0.9, 0.0, 1.2] * 4,
        top_k=[0, 0, 0, 40] * 4,
        repetition_penalty=[1.3, 1.0, 0.8, 1.1] * 4,
        frequency_penalty=[0.0, 0.5, 0.2, -0.3] * 4,
        presence_penalty=[0.4, 0.0, 0.0, 0.2] * 4,
    ),
}


def _mode_params(mode: str, vocab: int, logits: torch.Tensor) -> SamplingTensors:
    """MODES[mode] for M rows: constrained rows beside unconstrained ones (mask_at -1, -7)."""
    grammar, at = _grammar(logits, seed=vocab + len(mode))
    mask_at = [at["one"], -1, at["few"], at["many"], at["tail"], -7, at["not_argmax_6"], at["many"]]
    mask_at += [-1, at["few"], at["not_argmax_10"], at["one"], at["tail"], -1, at["many"], at["few"]]
    values = dict(MODES[mode])
    if mode == "penalized":
        values.update(token_counts=_counts(5, vocab, seed=vocab), slot=[i % 5 for i in range(M)])
    seeds = (torch.arange(M, dtype=torch.int64) * 104729 + vocab + len(mode)).tolist()
    return _constrained(_params(M, seed=seeds, **values), grammar, mask_at)


def check_mode(mode: str, vocab: int) -> tuple[int, int]:
    """One mode over M rows: the layered step's Triton forms (penalize_and_scale bit for bit,
    hence sample()'s exact token) and the fused sampler (sample()'s token on clear rows); every
    constrained row's token allowed. Returns (clear rows, rows) of the fused check."""
    from ringleader.device.sampling.sampler import penalize_and_scale
    from ringleader.device.sampling.triton_sampler import counter_uniform_triton, penalize_and_scale_triton

    logits = _logits(M, vocab, seed=vocab * 7 + len(mode))
    params = _mode_params(mode, vocab, logits)
    what = f"{mode}, V={vocab}"
    allowed = _allowed(params, vocab)
    constrained = params.mask_at >= 0
    temperature = params.temperature.float()
    divisor = torch.where(temperature <= 0, 1.0, temperature)
    got = penalize_and_scale_triton(logits, params, divisor)
    want = penalize_and_scale(logits, params, divisor)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{what}: penalize_and_scale"
    assert torch.isinf(got[~allowed]).all() and not torch.isinf(got[allowed]).any(), what

    valid = valid_rows(M, M)
    reference = sample(logits, params, valid=valid)
    layered = sample(logits, params, counter_uniform_triton, valid, penalize_and_scale_triton)
    assert torch.equal(layered, reference), f"{what}: the layered step's Triton forms drew otherwise"
    assert allowed[torch.arange(M), reference].all(), f"{what}: sample() drew a disallowed token"

    head_argmax = logits.argmax(1).int()
    fused = sample_rows_triton(logits, params, torch.tensor([M], dtype=torch.int32), head_argmax)
    clear = clear_rows(logits, params, valid)
    wrong = (fused != reference) & clear
    assert not wrong.any(), (
        f"{what}: rows {wrong.nonzero().flatten().tolist()} {fused[wrong]} != {reference[wrong]}"
    )
    assert allowed[torch.arange(M), fused].all(), f"{what}: the fused sampler drew a disallowed token"
    greedy = temperature <= 0
    assert torch.equal(fused[greedy], reference[greedy]), f"{what}: a greedy row differs"
    # the rows whose mask leaves out the raw argmax: an unmasked sampler would fail here
    if mode == "greedy":
        assert (fused[[6, 10]] != head_argmax[[6, 10]]).all() and constrained[[6, 10]].all(), what
    return int(clear.sum()), M


def check_greedy_constrained_ignores_the_head_argmax() -> None:
    """A greedy constrained row computes its masked argmax whatever greedy_token says; a greedy
    row without one takes greedy_token unread (a planted wrong value comes back), stale rows too."""
    m, vocab = 6, 1000
    logits = _logits(m, vocab, seed=21)
    grammar, at = _grammar(logits, seed=22)
    mask_at = [at["not_argmax_0"], -1, at["not_argmax_2"], -1, at["not_argmax_4"], at["one"]]
    params = _constrained(_params(m, temperature=0.0), grammar, mask_at)
    planted = torch.arange(m, dtype=torch.int32) + 100
    second = logits.topk(2, dim=1).indices[:, 1]
    n_samples = 5  # row 5 is stale: its mask is ignored, it takes the fast path
    got = sample_rows_triton(logits, params, torch.tensor([n_samples], dtype=torch.int32), planted)
    assert got[[0, 2, 4]].tolist() == second[[0, 2, 4]].tolist(), got
    assert got[[1, 3, 5]].tolist() == planted[[1, 3, 5]].tolist(), got
    # without greedy_token the kernel's own argmax: the raw one for rows without a constraint
    alone = sample_rows_triton(logits, params, torch.tensor([m], dtype=torch.int32), None)
    assert alone.tolist() == sample(logits, params).tolist()


def check_garbage_offsets() -> None:
    """Offsets past the array or negative (a stale entry's, or a corrupt one) never fault: a valid
    row with a huge offset reads the array's last word for every token (mask_disallowed's clamp),
    a negative one has no constraint; stale rows in every mode read nothing out of bounds."""
    from ringleader.device.sampling.sampler import penalize_and_scale
    from ringleader.device.sampling.triton_sampler import penalize_and_scale_triton

    m, vocab, n_samples = 8, 1000, 4
    logits = _logits(m, vocab, seed=23)
    grammar, at = _grammar(logits, seed=24)
    mask_at = [GARBAGE[0], GARBAGE[1], GARBAGE[2], at["few"], GARBAGE[0], GARBAGE[2], GARBAGE[1], at["one"]]
    values = dict(temperature=[0.0, 1.0, 0.8, 1.0, 0.0, 1.0, 0.9, 1.2], top_k=[0, 0, 30, 0, 0, 5, 0, 0])
    params = _constrained(_params(m, **values), grammar, mask_at)
    last = (torch.tensor([LAST_WORD]) >> torch.arange(32)) & 1
    allowed = _allowed(params, vocab)
    assert torch.equal(allowed[0], last.bool().repeat(-(-vocab // 32))[:vocab]), "the reference's clamp"
    divisor = torch.where(params.temperature <= 0, 1.0, params.temperature.float())
    got = penalize_and_scale_triton(logits, params, divisor)
    assert torch.equal(got.view(torch.int32), penalize_and_scale(logits, params, divisor).view(torch.int32))
    valid = valid_rows(m, n_samples)
    fused = sample_rows_triton(logits, params, torch.tensor([n_samples], dtype=torch.int32), None)
    reference = sample(logits, _stale_unmasked(params, valid), valid=valid)
    clear = clear_rows(logits, _stale_unmasked(params, valid), valid)
    assert torch.equal(fused[clear], reference[clear]), (fused, reference, clear)
    assert allowed[torch.arange(n_samples), fused[:n_samples]].all()
    assert bool(((fused >= 0) & (fused < vocab)).all())


def check_the_steps_sampling() -> None:
    """The layout's grammar and sample_mask reach both steps' samplers: StaticStep._sample_into
    (the layered step: sample() with the Triton forms) and FusedDecode._sample (the one-launch
    sampler), each writing next_token at the valid entries' slots only."""
    from ringleader.device.sampling.triton_sampler import (
        counter_uniform_triton,
        penalize_and_scale_triton,
        store_logprobs_triton,
    )
    from ringleader.device.step.fused_step import FusedDecode
    from ringleader.device.step.static_step import StaticStep

    n_slots, m, vocab, n_samples = 8, 6, 1000, 5
    logits = _logits(m, vocab, seed=25)
    grammar, at = _grammar(logits, seed=26)
    lay = StepLayout.allocate(n_slots, 16, "cpu", 2, vocab, grammar_words=grammar.numel())
    lay.grammar.copy_(grammar)
    mask_at = [at["not_argmax_0"], -1, at["few"], at["many"], at["one"], GARBAGE[0]]
    lay.sample_mask[:m] = torch.tensor(mask_at, dtype=torch.int32)
    lay.sample_slot[:m] = torch.tensor([3, 0, 7, 1, 5, 2], dtype=torch.int32)
    lay.sample_counter[:m] = torch.arange(m, dtype=torch.int32) + 4
    lay.n_samples.fill_(n_samples)
    for name, values in dict(temperature=[0.0, 0.0, 1.0, 0.9, 1.1, 1.0], top_k=[0, 0, 0, 20, 0, 0]).items():
        lay.params[name][:m] = torch.tensor(values, dtype=lay.params[name].dtype)
    lay.params["seed"][:m] = torch.arange(m, dtype=torch.int64) * 31 + 5

    step = object.__new__(StaticStep)  # only what _sample_into reads (no model)
    step.n_slots = n_slots
    step.sample_len = n_slots  # no drafts: a sample place per slot
    step._entry_ids = torch.arange(n_slots, dtype=torch.int32)
    step._token_sink = torch.zeros(n_slots + 1, dtype=torch.int32)
    step._end_ids = None  # no end ids: min_tokens' are test_request_extensions_55's
    step._uniform, step._scale, step._store_logprobs = (
        counter_uniform_triton,
        penalize_and_scale_triton,
        store_logprobs_triton,
    )
    fused = object.__new__(FusedDecode)
    fused.step, fused.use_pdl = step, False

    params = lay.sampling(m)
    valid = valid_rows(m, n_samples)
    want = sample(logits, params, valid=valid)
    slots = lay.sample_slot[:n_samples].long()
    lay.next_token.fill_(-7)
    step._sample_into(logits, lay, m)
    layered = lay.next_token.clone()
    assert layered[slots].tolist() == want[:n_samples].tolist(), (layered, want)
    assert (layered[[2, 4, 6]] == -7).all(), "a stale entry or an unsampled slot was written"
    lay.next_token.fill_(-7)
    fused._sample(logits, logits.argmax(1).int(), lay, m)
    clear = clear_rows(logits, params, valid)[:n_samples]
    assert torch.equal(lay.next_token[slots][clear], layered[slots][clear]), (lay.next_token, layered)
    assert (lay.next_token[[2, 4, 6]] == -7).all()
    assert int(layered[3]) == int(logits[0].topk(2).indices[1]), "greedy constrained: the masked argmax"
    allowed = _allowed(params, vocab)[:n_samples]
    assert allowed[torch.arange(n_samples), lay.next_token[slots].long()].all()


# ---- in this process: argument checks, one launch, ahead-of-time compile -------------------------


def _meta_masked(m: int = 5, vocab: int = 3000, n_slots: int = 7, grammar_words: int = 1 << 20):
    lay = StepLayout.allocate(n_slots, 16, "meta", 2, vocab, grammar_words)
    return torch.empty(m, vocab, device="meta"), lay.sampling(m), lay


@needs_triton
def test_one_launch_each_with_masks_on_meta():
    from ringleader.device.sampling.triton_sampler import penalize_and_scale_triton

    logits, params, lay = _meta_masked()
    with LaunchRecorder() as rec:
        sample_rows_triton(logits, params, lay.n_samples, None, lay.next_token, lay.sample_slot[:5])
        penalize_and_scale_triton(logits, params, torch.empty(5, device="meta"))
    assert dict(rec.counts) == {"_sample_row_kernel": 1, "_penalize_and_scale_kernel": 1}


@needs_triton
@pytest.mark.parametrize(
    "grammar, mask_at, named",
    [
        (torch.empty(8, device="meta", dtype=torch.int64), None, "grammar"),
        (torch.empty(2, 4, device="meta", dtype=torch.int32), None, "grammar"),
        (torch.empty(0, device="meta", dtype=torch.int32), None, "grammar"),
        (torch.empty(16, device="meta", dtype=torch.int32)[::2], None, "grammar"),
        (torch.empty(8, dtype=torch.int32), None, "grammar"),
        (None, torch.empty(5, device="meta"), "mask_at"),
        (None, torch.empty(4, device="meta", dtype=torch.int32), "mask_at"),
        (None, torch.empty(5, dtype=torch.int32), "mask_at"),
    ],
)
def test_bad_masks_name_what_is_wrong(grammar, mask_at, named):
    from ringleader.device.sampling.triton_sampler import penalize_and_scale_triton

    logits, params, lay = _meta_masked()
    bad = SamplingTensors(
        params.counter,
        params.token_counts,
        params.slot,
        grammar=params.grammar if grammar is None else grammar,
        mask_at=params.mask_at if mask_at is None else mask_at,
        **params.values,
    )
    with LaunchRecorder() as rec:
        with pytest.raises(ValueError, match=named):
            sample_rows_triton(logits, bad, lay.n_samples, None)
        with pytest.raises(ValueError, match=named):
            penalize_and_scale_triton(logits, bad, torch.empty(5, device="meta"))
    assert not rec.counts


@needs_triton
@pytest.mark.parametrize("arch, use_pdl", [(90, True), (80, False)])
def test_masked_kernels_compile_without_spills(arch, use_pdl):
    """Both kernels with masks, compiled ahead of time for a large vocabulary (as the step's
    layout passes them: the grammar at its default size): no spill, and they fit the SM."""
    from ringleader.bench.lab.triton_compile import compile_specialization
    from ringleader.bench.lab.triton_specializations import Specializer
    from ringleader.device.sampling.triton_sampler import penalize_and_scale_triton

    m, vocab = 64, 151936
    logits, params, lay = _meta_masked(m, vocab, n_slots=128, grammar_words=64 << 18)
    launches: list = []
    with LaunchRecorder(on_launch=launches.append):
        greedy = torch.empty(m, device="meta", dtype=torch.int32)
        sample_rows_triton(
            logits, params, lay.n_samples, greedy, lay.next_token, lay.sample_slot[:m], use_pdl
        )
        penalize_and_scale_triton(logits, params, torch.empty(m, device="meta"))
    assert candidate_count(vocab) == 1024 and len(launches) == 2
    for launch in launches:
        result = compile_specialization(Specializer(arch).derive(launch))
        assert result["ok"] and result["spills"] == 0, result
