"""min_tokens (issue 55, vLLM's): below it the model's end ids cannot be drawn, greedy included, on
the CPU sampler and in both Triton samplers (under the interpreter, in a child process), with
rows past their min_tokens left bit for bit as they were; the kernels that read it still compile
for sm_90 and sm_80 without spills.  The end-to-end check on a real server is in
tests/test_request_extensions_55.py."""

from __future__ import annotations

import time

import pytest
import torch

from ringleader.device.sampling.sampler import SamplingTensors, mask_ends, penalize_and_scale, sample
from ringleader.device.sampling.triton_sample_row import HAVE_TRITON, sample_rows_triton
from ringleader.device.step.step_layout import StepLayout, end_ids_for
from ringleader.device.step.triton_launch import LaunchRecorder
from ringleader.ipc import layout
from ringleader.ipc.sampling_params import SamplingParams
from tests.test_triton_sample_row import _install_fast_xor_sum, _logits, _params, clear_rows, valid_rows
from tests.triton_interpreter import run_interpreted_checks_of

MARKER = "min_tokens interpreted checks passed"
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")

# ---------------------------------------------------------------- min_tokens, the sampler

EOS = (7, 11)
V = 1000


def _end_logits(m: int, seed: int) -> torch.Tensor:
    """Logits whose most likely tokens are the end ids: 7 (an EOS) first, then 13 (a stop id of
    some rows), then 11 (the other EOS), far above the rest."""
    logits = _logits(m, V, seed=seed)
    logits[:, 7], logits[:, 13], logits[:, 11] = 40.0, 39.0, 38.0
    return logits


def _end_params(**values) -> SamplingTensors:
    """8 rows: min_tokens and counters so that rows 1, 4 and 6 are below their min_tokens."""
    values.setdefault("min_tokens", [0, 5, 5, 5, 3, 0, 9, 1])
    values.setdefault("counter", [0, 4, 5, 6, 0, 3, 8, 1])
    params = _params(8, **{k: v for k, v in values.items() if k not in ("end_ids", "stop_ids")})
    params = params.replace(min_tokens=torch.tensor(values["min_tokens"], dtype=torch.int32))
    stops = [[13, -1], [13, -1], [-1, -1], [13, 2], [-1, -1], [13, -1], [20, 13], [13, -1]]
    return params.replace(
        end_ids=values.get("end_ids", torch.tensor(EOS, dtype=torch.int32)),
        stop_ids=values.get("stop_ids", torch.tensor(stops, dtype=torch.int32)),
    )


BELOW = [1, 4, 6]


def _banned(params: SamplingTensors, row: int) -> set[int]:
    ids = set(params.end_ids.tolist()) if params.end_ids is not None else set()
    if params.stop_ids is not None:
        ids |= {i for i in params.stop_ids[row].tolist() if i >= 0}
    return ids


def test_mask_ends_masks_only_rows_below_min_tokens():
    logits = _end_logits(8, seed=1)
    params = _end_params()
    masked = mask_ends(logits, params)
    for row in range(8):
        inf = set(torch.isneginf(masked[row]).nonzero().flatten().tolist())
        assert inf == (_banned(params, row) if row in BELOW else set()), row
        keep = ~torch.isneginf(masked[row])
        assert torch.equal(masked[row][keep].view(torch.int32), logits[row][keep].view(torch.int32))
    # without end ids (or min_tokens 0 everywhere) nothing is masked, bit for bit
    assert torch.equal(mask_ends(logits, params.without_min_tokens()), logits)
    none_below = params.replace(min_tokens=torch.zeros(8, dtype=torch.int32))
    assert torch.equal(mask_ends(logits, none_below).view(torch.int32), logits.view(torch.int32))
    assert params.any_below_min_tokens() and not none_below.any_below_min_tokens()
    assert not params.without_min_tokens().any_below_min_tokens()


@pytest.mark.parametrize("temperature", [0.0, 1.0, 2.0])
def test_sample_never_draws_an_end_id_below_min_tokens(temperature):
    logits = _end_logits(8, seed=2)
    for seed in range(20):
        params = _end_params(temperature=temperature, seed=[seed * 8 + i for i in range(8)])
        tokens = sample(logits, params).tolist()
        for row, token in enumerate(tokens):
            if row in BELOW:
                assert token not in _banned(params, row), (row, token)
            elif temperature == 0.0:
                assert token == 7  # the argmax, an EOS: allowed at or past min_tokens
    params = _end_params(temperature=0.0)
    greedy = sample(logits, params).tolist()
    for row in BELOW:  # the best token each row may draw
        allowed = logits[row].clone()
        allowed[list(_banned(params, row))] = float("-inf")
        assert greedy[row] == int(allowed.argmax()) and greedy[row] != 7, row
    assert greedy[4] == 13  # 13 is a stop id of other rows, not of row 4
    # only the EOS ids known (no stop ids): a row below its min_tokens may draw its stop id
    eos_only = _end_params(temperature=0.0, stop_ids=None)
    assert [sample(logits, eos_only).tolist()[r] for r in BELOW] == [13, 13, 13]


def test_penalize_and_scale_leaves_rows_past_min_tokens_bit_for_bit():
    logits = _end_logits(8, seed=3)
    params = _end_params(temperature=0.7, repetition_penalty=1.3)
    divisor = torch.full((8,), 0.7)
    with_ends = penalize_and_scale(logits, params, divisor)
    without = penalize_and_scale(logits, params.without_min_tokens(), divisor)
    past = [r for r in range(8) if r not in BELOW]
    assert torch.equal(with_ends[past].view(torch.int32), without[past].view(torch.int32))
    assert torch.isneginf(with_ends[1, [7, 11, 13]]).all()


def test_end_ids_are_the_schedulers_eos_ids():
    assert end_ids_for([2], "cpu").tolist() == [2]
    assert end_ids_for(list(range(10)), "cpu").tolist() == list(range(layout.MAX_EOS_IDS))
    assert end_ids_for([], "cpu") is None
    lay = StepLayout.allocate(4, 8, "cpu", 2, 0)
    lay.params["min_tokens"][:2] = torch.tensor([3, 0], dtype=torch.int32)
    params = lay.sampling(2, end_ids=end_ids_for([2], "cpu"))
    assert params.end_ids.tolist() == [2] and params.min_tokens.tolist() == [3, 0]
    assert params.any_below_min_tokens()  # the counters are 0
    assert SamplingParams(min_tokens=3).ring_values()["min_tokens"] == 3


# ---------------------------------------------------------------- min_tokens, the Triton samplers


def test_min_tokens_in_the_triton_samplers_under_interpreter():
    run_interpreted_checks_of("tests.test_min_tokens", MARKER)


def run_interpreted_checks() -> None:
    """Entry point of the child process (TRITON_INTERPRET=1 set before anything imported triton)."""
    from ringleader.device.sampling import triton_sample_row as tsr

    assert type(tsr._sample_row_kernel).__name__ == "InterpretedFunction", "triton imported too early"
    _install_fast_xor_sum()
    t0 = time.perf_counter()
    check_penalize_and_scale_bit_for_bit()
    check_the_fused_sampler()
    check_the_greedy_fast_path()
    check_the_steps_sampling()
    print(f"{MARKER} in {time.perf_counter() - t0:.1f} s")


def check_penalize_and_scale_bit_for_bit() -> None:
    from ringleader.device.sampling.triton_sampler import counter_uniform_triton, penalize_and_scale_triton

    logits = _end_logits(8, seed=4)
    temperature = [0.0, 0.8, 1.0, 0.0, 1.3, 0.9, 0.0, 1.1]
    for variant in ("both", "eos only", "stops only"):
        extra = {"stop_ids": None} if variant == "eos only" else {}
        if variant == "stops only":
            extra["end_ids"] = None
        params = _end_params(temperature=temperature, repetition_penalty=[1.0, 1.2] * 4, **extra)
        divisor = torch.where(params.temperature <= 0, 1.0, params.temperature.float())
        got = penalize_and_scale_triton(logits, params, divisor)
        want = penalize_and_scale(logits, params, divisor)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), variant
        assert torch.isneginf(got[[1, 6]][:, 13]).all() == (variant != "eos only")  # their stop id
        valid = valid_rows(8, 8)
        layered = sample(logits, params, counter_uniform_triton, valid, penalize_and_scale_triton)
        assert torch.equal(layered, sample(logits, params, valid=valid)), variant


def check_the_fused_sampler() -> None:
    logits = _end_logits(8, seed=5)
    for mode in (
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.2, top_p=0.9),
    ):
        for seed in range(3):
            params = _end_params(seed=[seed * 8 + i for i in range(8)], **mode)
            n = torch.tensor([8], dtype=torch.int32)
            got = sample_rows_triton(logits, params, n, logits.argmax(1).int())
            valid = valid_rows(8, 8)
            want = sample(logits, params, valid=valid)
            clear = clear_rows(logits, params, valid)
            assert torch.equal(got[clear], want[clear]), (mode, got, want)
            for row in BELOW:
                assert int(got[row]) not in _banned(params, row), (mode, row, got)


def check_the_greedy_fast_path() -> None:
    """A greedy row below its min_tokens keeps the lm_head's argmax (planted values come back)
    unless that argmax is one of its end ids; then it computes the masked argmax. Stale rows
    ignore their min_tokens."""
    logits = _end_logits(8, seed=6)
    params = _end_params(temperature=0.0)
    planted = torch.tensor([500, 501, 502, 503, 504, 505, 506, 507], dtype=torch.int32)
    n = torch.tensor([8], dtype=torch.int32)
    assert sample_rows_triton(logits, params, n, planted).tolist() == planted.tolist()
    head = planted.clone()
    head[[1, 4, 6]] = torch.tensor([7, 13, 13], dtype=torch.int32)  # an EOS; 13: row 6's stop id
    got = sample_rows_triton(logits, params, n, head).tolist()
    want = sample(logits, params).tolist()  # the masked argmax
    assert got[1] == want[1] != 7 and got[6] == want[6] != 13, (got, want)
    assert got[4] == 13, got  # 13 is no end id of row 4: its head stands (its masked argmax too)
    assert [got[r] for r in (0, 2, 3, 5, 7)] == [500, 502, 503, 505, 507]  # not below: the head
    stale = sample_rows_triton(logits, params, torch.tensor([2], dtype=torch.int32), head).tolist()
    assert stale[1] == want[1] and stale[2:] == head[2:].tolist(), stale  # stale rows: the head


def check_the_steps_sampling() -> None:
    """The steps pass the model's end ids: StaticStep._sample_into (layered) and
    FusedDecode._sample keep a row below its min_tokens off them."""
    from ringleader.device.sampling.triton_sampler import (
        counter_uniform_triton,
        penalize_and_scale_triton,
        store_logprobs_triton,
    )
    from ringleader.device.step.fused_step import FusedDecode
    from ringleader.device.step.static_step import StaticStep

    n_slots, m = 8, 4
    logits = _end_logits(m, seed=7)
    lay = StepLayout.allocate(n_slots, 16, "cpu", 2, V)
    lay.sample_slot[:m] = torch.tensor([3, 0, 7, 1], dtype=torch.int32)
    lay.sample_counter[:m] = torch.tensor([0, 2, 5, 1], dtype=torch.int32)
    lay.params["min_tokens"][:m] = torch.tensor([4, 2, 6, 0], dtype=torch.int32)  # rows 0 and 2 below
    lay.params["temperature"][:m] = torch.tensor([0.0, 0.0, 1.0, 0.0])
    lay.n_samples.fill_(m)
    step = object.__new__(StaticStep)
    step.n_slots = n_slots
    step.sample_len = n_slots  # no drafts: a sample place per slot
    step._entry_ids = torch.arange(n_slots, dtype=torch.int32)
    step._token_sink = torch.zeros(n_slots + 1, dtype=torch.int32)
    step._end_ids = end_ids_for(EOS, "cpu")
    step._uniform, step._scale = counter_uniform_triton, penalize_and_scale_triton
    step._store_logprobs = store_logprobs_triton
    step._sample_into(logits, lay, m)
    layered = lay.next_token[[3, 0, 7, 1]].tolist()
    assert layered[0] == 13 and layered[1] == 7 and layered[2] not in EOS and layered[3] == 7, layered
    fused = object.__new__(FusedDecode)
    fused.step, fused.use_pdl = step, False
    lay.next_token.fill_(-1)
    fused._sample(logits, logits.argmax(1).int(), lay, m)
    assert lay.next_token[[3, 0, 7, 1]].tolist() == layered


@needs_triton
@pytest.mark.parametrize("arch, use_pdl", [(90, True), (80, False)])
def test_the_samplers_with_end_ids_compile_without_spills(arch, use_pdl):
    """Both kernels as the steps launch them now (the model's end ids always given), compiled
    ahead of time for a large vocabulary: no spill."""
    from ringleader.bench.lab.triton_compile import compile_specialization
    from ringleader.bench.lab.triton_specializations import Specializer
    from ringleader.device.sampling.triton_sampler import penalize_and_scale_triton

    m, vocab = 64, 151936
    lay = StepLayout.allocate(128, 16, "meta", 2, vocab, 64 << 18)
    params = lay.sampling(m, end_ids=torch.empty(2, dtype=torch.int32, device="meta"))
    logits = torch.empty(m, vocab, device="meta")
    launches: list = []
    with LaunchRecorder(on_launch=launches.append):
        greedy = torch.empty(m, device="meta", dtype=torch.int32)
        sample_rows_triton(
            logits, params, lay.n_samples, greedy, lay.next_token, lay.sample_slot[:m], use_pdl
        )
        penalize_and_scale_triton(logits, params, torch.empty(m, device="meta"))
    assert len(launches) == 2
    for launch in launches:
        assert launch.meta["HAS_ENDS"]
        result = compile_specialization(Specializer(arch).derive(launch))
        assert result["ok"] and result["spills"] == 0, result
