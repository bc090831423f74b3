"""The one-launch sampler (device/sampling/triton_sample_row.py) against sampling.sample().

The kernel runs under the Triton interpreter in a child process started with TRITON_INTERPRET=1
(`run_interpreted_checks`), on CPU tensors; the argument checks, the launch count and the
ahead-of-time compile run in this process.

Exactness: a sampled row must draw sample()'s token unless one of the row's decisions lies within
float rounding of its threshold (the kernel sums in another order than torch.cumsum, and its exp
is not torch's): `clear_rows` redoes sample() in float64 from the same penalized, scaled logits
and marks a row unclear when the draw's target or a top_p cut is within 2**-17 of the CDF's total
of a boundary (128 ulps; measured: torch within 1, the kernel's chunked sums within 40), or a
token sits within 1e-5 of min_p's threshold. Clear rows must match exactly, and they must be the
vast majority (90% of the run; the run prints how many).
Greedy rows (and stale ones) must always match: the penalties are bit for bit sample()'s.

Speed: the interpreter runs tl.sort's bitonic network with its xor reductions element by element
in Python (about 3 s a row); the child swaps that one reduction for numpy's (`_fast_xor_sum`),
the same values, and runs one check with Triton's own to show the swap changes nothing.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from ringleader.device.sampling.sampler import SamplingTensors, counter_uniform, penalize_and_scale, sample
from ringleader.device.sampling.triton_sample_row import HAVE_TRITON, candidate_count, sample_rows_triton
from ringleader.device.step.step_layout import sampling_views
from ringleader.device.step.triton_launch import LaunchRecorder
from ringleader.ipc.layout import PROMPT_MARK, SAMPLING
from ringleader.ipc.sampling_params import MAX_TOP_K
from tests.triton_interpreter import run_interpreted_checks_of

MARKER = "sample_rows interpreted checks passed"
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


def test_sample_rows_under_interpreter():
    run_interpreted_checks_of("tests.test_triton_sample_row", MARKER)


# ---- the reference and its margins --------------------------------------------------------------


def valid_rows(m: int, n_samples: int) -> torch.Tensor:
    return torch.arange(m) < n_samples


def clear_rows(logits: torch.Tensor, params: SamplingTensors, valid: torch.Tensor) -> torch.Tensor:
    """bool [m]: rows whose every decision in sample() is farther than float rounding from its
    threshold, judged in float64 from sample()'s own fp32 penalized and scaled logits."""
    m, vocab = logits.shape
    temperature = params.temperature.float()
    greedy = (temperature <= 0) | ~valid
    scaled = penalize_and_scale(logits, params, torch.where(greedy, 1.0, temperature)).double()
    target = counter_uniform(params.seed.long(), params.counter.long()).double()
    # torch's cumsum is within an ulp of the exact one (relative to the total), the kernel's chunked
    # sums and scans within 40 ulps on these rows (measured in numpy): 128 ulps is the bound granted
    tol = 2.0**-17
    clear = torch.ones(m, dtype=torch.bool)
    for i in range(m):
        if greedy[i]:
            continue
        top_k, top_p, min_p = int(params.top_k[i]), float(params.top_p[i]), float(params.min_p[i])
        relative = torch.exp(scaled[i] - scaled[i].max())
        if min_p > 0 and bool(((relative - min_p).abs() <= 1e-5 * min_p).any()):
            clear[i] = False  # a token sits on min_p's threshold (exp differs by an ulp or two)
        mass = torch.where(relative < min_p, 0.0, relative)
        if top_k <= 0 and top_p >= 1.0:
            clear[i] &= _draw_is_clear(mass.cumsum(0), float(target[i]), tol)
            continue
        values, _ = torch.topk(scaled[i], candidate_count(vocab))
        rank = torch.arange(values.numel())
        kept = (torch.exp(values - scaled[i].max()) >= min_p) & ((top_k <= 0) | (rank < top_k))
        values = values.masked_fill(~kept, float("-inf"))
        total = values.logsumexp(0) if top_k > 0 else scaled[i].max() + mass.sum().log()
        probs = torch.exp(values - total)
        before = probs.cumsum(0) - probs
        if top_p < 1.0 and bool(((before - top_p).abs() <= tol).any()):
            clear[i] = False  # the nucleus cut is within rounding of top_p
        weight = torch.where((before < top_p) | (top_p >= 1.0) | (rank == 0), probs, 0.0)
        clear[i] &= _draw_is_clear(weight.cumsum(0), float(target[i]), tol)
    return clear


def _draw_is_clear(cum: torch.Tensor, target: float, tol: float) -> bool:
    """Whether target * total lies farther than tol * total from every step of the CDF `cum`."""
    total = float(cum[-1])
    threshold = target * total
    pos = int((cum < threshold).sum())
    below = float(cum[pos - 1]) if pos > 0 else 0.0
    return threshold - below > tol * total and float(cum[min(pos, cum.numel() - 1)]) - threshold > tol * total


def _params(m: int, **values) -> SamplingTensors:
    """Settings for m rows: each given field a list (or one value for every row); seeds and
    counters distinct per row unless given."""
    dtypes = {"top_k": torch.int32, "seed": torch.int64, "counter": torch.int32, "slot": torch.int32}
    counts = values.pop("token_counts", None)
    tensors = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            tensors[name] = value
            continue
        value = value if isinstance(value, list) else [value] * m
        tensors[name] = torch.tensor(value, dtype=dtypes.get(name, torch.float32))
    counter = tensors.pop("counter", torch.arange(m, dtype=torch.int32) * 3 + 1)
    tensors.setdefault("seed", torch.arange(m, dtype=torch.int64) * 7919 + 11)
    slot = tensors.pop("slot", None)
    return SamplingTensors(counter, counts, slot, **tensors)


def _logits(m: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, vocab, generator=gen) * scale


def _counts(n_slots: int, vocab: int, seed: int) -> torch.Tensor:
    """A token_counts table: output counts on some tokens, PROMPT_MARK on some prompt tokens."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (n_slots, vocab), generator=gen, dtype=torch.int32)
    counts *= torch.rand(n_slots, vocab, generator=gen) < 0.05
    prompt = torch.rand(n_slots, vocab, generator=gen) < 0.03
    return counts + prompt.int() * PROMPT_MARK


def check_against_sample(
    name: str,
    logits: torch.Tensor,
    params: SamplingTensors,
    n_samples: int | None = None,
    greedy_token: torch.Tensor | None = None,
    min_clear: float = 0.5,
) -> torch.Tensor:
    """The kernel's tokens against sample()'s: every clear row equal (greedy rows always), and
    at least min_clear of the rows clear (the whole run asks 90%)."""
    m = logits.shape[0]
    n_samples = m if n_samples is None else n_samples
    valid = valid_rows(m, n_samples)
    before = logits.clone()
    got = sample_rows_triton(logits, params, torch.tensor([n_samples], dtype=torch.int32), greedy_token)
    assert torch.equal(logits, before), f"{name}: the logits were written"
    assert got.dtype == torch.int64 and got.shape == (m,)
    want = sample(logits, params, valid=valid)
    clear = clear_rows(logits, params, valid)
    wrong = (got != want) & clear
    assert not wrong.any(), (
        f"{name}: rows {wrong.nonzero().flatten().tolist()} got {got[wrong]} want {want[wrong]}"
    )
    assert float(clear.float().mean()) >= min_clear, f"{name}: only {int(clear.sum())} of {m} rows are clear"
    CLEAR_ROWS[0] += int(clear.sum())
    CLEAR_ROWS[1] += m
    return got


CLEAR_ROWS = [0, 0]  # clear rows, rows: over every check_against_sample of the run


# ---- the interpreted checks ---------------------------------------------------------------------


def _fast_xor_sum(input, axis=None, keep_dims=False):
    """triton.language.standard.xor_sum for the interpreter with numpy's reduction (tl.sort's
    compare-and-swap calls it with a constant axis)."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    axis = getattr(axis, "value", axis)
    keep = bool(getattr(keep_dims, "value", keep_dims))
    data = np.bitwise_xor.reduce(input.handle.data, axis=axis, keepdims=True)
    if not keep:
        data = np.squeeze(data, axis=axis)
    shape = list(data.shape)
    ty = tl.block_type(input.dtype, shape) if shape else input.dtype
    return tl.tensor(TensorHandle(data, input.handle.dtype), ty)


def _install_fast_xor_sum() -> None:
    import triton.language.standard as standard

    original = standard.xor_sum
    _fast_xor_sum.fn = original.fn  # type: ignore[attr-defined]  # what gluon re-wraps on import
    standard.xor_sum = _fast_xor_sum


def run_interpreted_checks() -> None:
    """Entry point of the child process (TRITON_INTERPRET=1 set before anything imported triton)."""
    from ringleader.device.sampling import triton_sample_row as tsr

    assert type(tsr._sample_row_kernel).__name__ == "InterpretedFunction", "triton imported too early"
    t0 = time.perf_counter()
    check_with_tritons_own_sort()
    _install_fast_xor_sum()
    check_greedy_fast_path_and_ties()
    check_greedy_with_penalties()
    check_each_restriction()
    check_penalties_with_sampling()
    check_stale_rows_and_next_token()
    check_seeds_are_deterministic()
    check_small_vocabularies()
    check_radix_edges()
    clear, rows = CLEAR_ROWS
    assert clear >= 0.9 * rows, f"only {clear} of {rows} rows were clear of rounding"
    print(f"{MARKER} in {time.perf_counter() - t0:.1f} s; {clear} of {rows} rows clear of rounding")


def check_with_tritons_own_sort() -> None:
    """One restricted row with the interpreter's own tl.sort (before the numpy reduction)."""
    params = _params(2, temperature=[0.8, 1.1], top_k=[30, 0], top_p=[1.0, 0.7])
    check_against_sample("triton's sort", _logits(2, 3000, seed=1), params, min_clear=1.0)


def check_greedy_fast_path_and_ties() -> None:
    """Greedy rows with neutral penalties take greedy_token as given (no pass over the logits);
    without greedy_token they compute the argmax, first index on ties."""
    m, vocab = 6, 3000
    logits = _logits(m, vocab, seed=2)
    logits[0, [5, 700, 2999]] = 50.0  # ties: the first index wins
    logits[1, [2998, 2999]] = 50.0  # ties in the last, partial chunk
    logits[2, :] = 1.0  # all tied: index 0
    logits[3, 2100] = 60.0  # the maximum in the second chunk
    params = _params(m, temperature=[0.0, 0.0, 0.0, -1.0, 0.0, 0.0])
    got = check_against_sample("greedy, computed", logits, params, greedy_token=None)
    assert got[:4].tolist() == [5, 2998, 0, 2100]
    # a deliberately wrong greedy_token proves the fast path reads nothing else
    planted = torch.arange(m, dtype=torch.int32) + 100
    n = torch.tensor([m], dtype=torch.int32)
    assert sample_rows_triton(logits, params, n, planted).tolist() == planted.tolist()
    # neutral penalties with a count table still take the fast path
    with_counts = _params(m, temperature=0.0, token_counts=_counts(m, vocab, seed=3))
    assert sample_rows_triton(logits, with_counts, n, planted).tolist() == planted.tolist()


def check_greedy_with_penalties() -> None:
    """A greedy row with a penalty: the argmax of the penalized logits (read through its slot),
    whatever greedy_token says; a neutral row beside it takes greedy_token."""
    m, vocab, n_slots = 8, 3000, 5
    logits = _logits(m, vocab, seed=4)
    counts = _counts(n_slots, vocab, seed=5)
    # make the penalties decide: each row's top token was generated (or is in the prompt)
    top = logits.argmax(1)
    slot = torch.tensor([4, 0, 3, 1, 2, 9, -3, 2], dtype=torch.int32)  # 9, -3: clamped
    for i in range(m):
        counts[int(slot[i].clamp(0, n_slots - 1)), int(top[i])] = 2 + (i % 2) * PROMPT_MARK
    logits[7, [10, 20]] = logits[7].max() + 1.0  # a tie after the penalties
    params = _params(
        m,
        temperature=0.0,
        repetition_penalty=[1.3, 1.0, 1.0, 0.7, 2.0, 1.1, 1.0, 1.0],
        frequency_penalty=[0.0, 0.5, 0.0, 0.2, 0.0, 0.3, -1.5, 0.0],
        presence_penalty=[0.0, 0.0, 0.8, 0.0, 1.0, 0.0, 0.0, 0.0],
        token_counts=counts,
        slot=slot,
    )
    greedy_token = logits.argmax(1).int()
    got = check_against_sample("greedy, penalized", logits, params, greedy_token=greedy_token)
    assert (got[:6] != top[:6]).any(), "the penalties changed no argmax: the check checks nothing"
    assert got[7] == 10
    got_none = sample_rows_triton(logits, params, torch.tensor([m], dtype=torch.int32), None)
    assert torch.equal(got, got_none)


def check_each_restriction() -> None:
    """Unrestricted, min_p only, top_k, top_p and all three, over two vocabularies that are not a
    multiple of the chunk, many seeds each: sample()'s token on every clear row."""
    m = 16
    settings: dict[str, dict[str, Any]] = {
        "unrestricted": dict(temperature=1.0),
        "min_p": dict(temperature=0.9, min_p=[0.0, 0.02, 0.1, 0.3] * 4),
        "top_k": dict(temperature=1.2, top_k=[1, 5, 40, 1024] * 4),
        "top_p": dict(temperature=1.0, top_p=[0.3, 0.8, 0.95, 0.999] * 4),
        "combined": dict(temperature=[0.7, 1.5] * 8, top_k=[0, 8, 100, 700] * 4, top_p=0.9, min_p=0.05),
    }
    for vocab, scale in ((3000, 3.0), (5000, 1.0)):
        for i, (name, values) in enumerate(settings.items()):
            seeds = torch.arange(m, dtype=torch.int64) * 104729 + vocab + i
            params = _params(m, seed=seeds.tolist(), **values)
            logits = _logits(m, vocab, seed=vocab + i, scale=scale)
            check_against_sample(f"{name}, V={vocab}", logits, params)
    # a flat distribution: top_p's nucleus is cut at the K candidates (sample()'s bound)
    flat = _logits(4, 5000, seed=6, scale=0.01)
    check_against_sample("flat top_p", flat, _params(4, temperature=1.0, top_p=0.95))


def check_penalties_with_sampling() -> None:
    """Penalties, then the temperature and every restriction, through the slots of a table."""
    m, vocab, n_slots = 12, 3000, 6
    counts = _counts(n_slots, vocab, seed=7)
    params = _params(
        m,
        temperature=[0.8, 1.0, 1.3] * 4,
        top_k=[0, 0, 20, 200] * 3,
        top_p=[1.0, 0.9, 1.0, 0.85] * 3,
        min_p=[0.0, 0.05] * 6,
        repetition_penalty=[1.2, 1.0, 0.9, 1.0] * 3,
        frequency_penalty=[0.0, 0.4, 0.0, -0.3] * 3,
        presence_penalty=[0.5, 0.0, 0.0, 0.1] * 3,
        token_counts=counts,
        slot=[5, 4, 3, 2, 1, 0, 0, 1, 2, 3, 4, 5],
    )
    check_against_sample("penalized sampling", _logits(m, vocab, seed=8), params)
    # no slots: row i's counts are row i of the table
    own = _params(4, temperature=1.0, frequency_penalty=0.7, top_k=[0, 5, 0, 50], token_counts=counts[:4])
    check_against_sample("penalties without slots", _logits(4, vocab, seed=9), own)


def check_stale_rows_and_next_token() -> None:
    """Rows i >= n_samples are greedy whatever their settings (the penalized argmax) and write no
    next_token; valid rows write theirs at their clamped slot and nowhere else."""
    m, vocab, n_slots, n_samples = 8, 3000, 12, 5
    logits = _logits(m, vocab, seed=10)
    counts = _counts(n_slots, vocab, seed=11)
    params = _params(
        m,
        temperature=[1.0, 0.0, 0.9, 1.2, 0.0, 1.0, 2.0, 0.5],
        top_k=[0, 0, 10, 0, 0, 5, 0, 0],
        top_p=[1.0, 1.0, 1.0, 0.8, 1.0, 0.5, 1.0, 1.0],
        repetition_penalty=[1.0, 1.0, 1.0, 1.0, 1.5, 1.0, 1.4, 1.0],
        token_counts=counts,
        slot=[3, 1, 0, 7, 8, 2, 99, -4],  # stale rows' slots are garbage: clamped into the table
    )
    greedy_token = logits.argmax(1).int()
    got = check_against_sample("stale rows", logits, params, n_samples=n_samples, greedy_token=greedy_token)
    assert got[7] == greedy_token[7]  # stale, neutral penalties: the fast path
    sample_slot = torch.tensor([3, 20, -1, 7, 9, 4, 5, 6], dtype=torch.int32)  # 20 -> 11, -1 -> 0
    next_token = torch.full((n_slots,), -7, dtype=torch.int32)
    n = torch.tensor([n_samples], dtype=torch.int32)
    # as the step gives them: each field a strided view of the RlSampling array, the logits padded
    views = sampling_views(torch.zeros(m * SAMPLING.size // 4, dtype=torch.int32))
    for name, view in views.items():
        view.copy_(getattr(params, name))
    strided = SamplingTensors(params.counter, params.token_counts, params.slot, **views)
    padded = torch.full((m, vocab + 5), 123.0)[:, :vocab].copy_(logits)
    again = sample_rows_triton(padded, strided, n, greedy_token, next_token, sample_slot)
    assert torch.equal(again, got), "strided inputs or next_token changed the draw"
    want = torch.full((n_slots,), -7, dtype=torch.int32)
    for i in range(n_samples):
        want[int(sample_slot[i].clamp(0, n_slots - 1))] = int(got[i])
    assert torch.equal(next_token, want), (next_token, want)


def check_seeds_are_deterministic() -> None:
    """A (seed, counter) pair draws the same token whatever the batch; other seeds draw others."""
    m, vocab = 16, 3000
    logits = _logits(1, vocab, seed=12, scale=1.0).expand(m, vocab).contiguous()
    for values in (dict(temperature=1.0), dict(temperature=1.0, top_k=200, top_p=0.9)):
        params = _params(m, counter=[5] * m, **values)
        n = torch.tensor([m], dtype=torch.int32)
        first = sample_rows_triton(logits, params, n, None)
        assert torch.equal(first, sample_rows_triton(logits, params, n, None))
        assert len(set(first.tolist())) > m // 2, "different seeds drew the same tokens"
        # row 3 alone (another batch) draws what it drew among the sixteen
        alone = _params(1, counter=[5], seed=[int(params.seed[3])], **values)
        assert sample_rows_triton(logits[3:4], alone, torch.tensor([1], dtype=torch.int32), None) == first[3]


def check_small_vocabularies() -> None:
    """Vocabularies below MAX_TOP_K (every token a candidate: no radix pass) and below a chunk;
    one of exactly MAX_TOP_K."""
    for vocab in (700, 300, MAX_TOP_K, 1):
        m = 8
        params = _params(
            m,
            temperature=[0.0, 1.0, 0.8, 1.1] * 2,
            top_k=[0, 0, 20, 0, 0, 999, 5, 0],
            top_p=[1.0, 1.0, 1.0, 0.8, 1.0, 0.9, 1.0, 1.0],
            min_p=[0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.2],
        )
        got = check_against_sample(f"V={vocab}", _logits(m, vocab, seed=vocab), params)
        assert bool(((got >= 0) & (got < vocab)).all())


def check_radix_edges() -> None:
    """The radix select's special cases: exactly K keys in the top digit's bin (it stops after
    one pass), and ties across the K-th key (the lowest indices are the candidates)."""
    m, vocab = 4, 3000
    logits = torch.full((m, vocab), -5.0) - torch.rand(m, vocab, generator=torch.Generator().manual_seed(13))
    gen = torch.Generator().manual_seed(14)
    for i in range(m):  # MAX_TOP_K values in [100, 101): one exponent, one top digit
        logits[i, torch.randperm(vocab, generator=gen)[:MAX_TOP_K]] = 100.0 + torch.rand(
            MAX_TOP_K, generator=gen
        )
    params = _params(
        m, temperature=[1.0, 30.0, 100.0, 100.0], top_k=[10, 0, 1024, 0], top_p=[1.0, 0.5, 1.0, 0.9]
    )
    check_against_sample("radix stops early", logits, params)
    # every logit equal: the candidates are indices [0, K), a top_k of 10 keeps [0, 10)
    flat = torch.zeros(m, vocab)
    params = _params(m, temperature=1.0, top_k=[10, 10, 0, 0], top_p=[1.0, 0.5, 0.3, 0.9])
    got = sample_rows_triton(flat, params, torch.tensor([m], dtype=torch.int32), None)
    assert bool((got[:2] < 10).all()) and bool((got[2:] < MAX_TOP_K).all()), got


# ---- in this process: argument checks, one launch, ahead-of-time compile ------------------------


def _meta_args(m: int = 5, vocab: int = 3000, n_slots: int = 7) -> dict:
    def rows(dtype=torch.float32, n=m):
        return torch.empty(n, device="meta", dtype=dtype)

    params = SamplingTensors(
        rows(torch.int32),
        torch.empty(n_slots, vocab, device="meta", dtype=torch.int32),
        rows(torch.int32),
        temperature=rows(),
        top_k=rows(torch.int32),
        seed=rows(torch.int64),
    )
    return dict(
        logits=torch.empty(m, vocab, device="meta"),
        params=params,
        n_samples=rows(torch.int32, 1),
        greedy_token=rows(torch.int32),
        next_token=rows(torch.int32, n_slots),
        sample_slot=rows(torch.int32),
    )


@needs_triton
def test_one_launch_on_meta():
    args = _meta_args()
    with LaunchRecorder() as rec:
        out = sample_rows_triton(**args)
    assert dict(rec.counts) == {"_sample_row_kernel": 1}
    assert out.shape == (5,) and out.dtype == torch.int64 and out.device.type == "meta"
    with LaunchRecorder() as rec:  # without the optional tensors, and with PDL
        sample_rows_triton(args["logits"], args["params"].replace(), args["n_samples"], None, use_pdl=True)
    assert dict(rec.counts) == {"_sample_row_kernel": 1}


@needs_triton
@pytest.mark.parametrize(
    "change, named",
    [
        (lambda a: a.update(logits=torch.empty(5, 3000, device="meta", dtype=torch.float16)), "logits"),
        (lambda a: a.update(logits=torch.empty(3000, 5, device="meta").t()), "logits"),
        (lambda a: a.update(params=a["params"].replace(top_k=torch.empty(6, device="meta"))), "top_k"),
        (lambda a: a.update(params=a["params"].replace(top_k=torch.empty(5, device="meta"))), "top_k"),
        (lambda a: a.update(params=a["params"].replace(min_p=torch.empty(5, device="meta", dtype=torch.int32))), "min_p"),
        (lambda a: a.update(params=a["params"].replace(temperature=torch.empty(5))), "temperature"),
        (lambda a: a.update(n_samples=torch.empty(1, device="meta", dtype=torch.int64)), "n_samples"),
        (lambda a: a.update(greedy_token=torch.empty(4, device="meta", dtype=torch.int32)), "greedy_token"),
        (lambda a: a.update(sample_slot=None), "sample_slot"),
        (lambda a: a.update(next_token=torch.empty(7, device="meta", dtype=torch.int64)), "next_token"),
        (lambda a: a.update(sample_slot=torch.empty(5, device="meta")), "sample_slot"),
        (lambda a: a.update(params=SamplingTensors(a["params"].counter, torch.empty(7, 2999, device="meta", dtype=torch.int32), a["params"].slot)), "token_counts"),
        (lambda a: a.update(params=SamplingTensors(a["params"].counter, torch.empty(7, 3000, device="meta"), a["params"].slot)), "token_counts"),
        (lambda a: a.update(params=SamplingTensors(a["params"].counter, torch.empty(7, 3000, device="meta", dtype=torch.int32))), "token_counts"),
        (lambda a: a.update(params=SamplingTensors(a["params"].counter, a["params"].token_counts, torch.empty(4, device="meta", dtype=torch.int32))), "slot"),
        (lambda a: a.update(scratch=torch.empty(5, 1000, device="meta", dtype=torch.int64)), "scratch"),
    ],
)  # fmt: skip
def test_bad_arguments_name_what_is_wrong(change, named):
    args = _meta_args()
    change(args)
    with LaunchRecorder() as rec, pytest.raises(ValueError, match=named):
        sample_rows_triton(**args)
    assert not rec.counts


@needs_triton
def test_scratch_may_be_passed_in():
    args = _meta_args()
    scratch = torch.empty(5, candidate_count(3000), device="meta", dtype=torch.int64)
    seen: list = []
    with LaunchRecorder(on_launch=seen.append) as rec:
        sample_rows_triton(**args, scratch=scratch)
    assert dict(rec.counts) == {"_sample_row_kernel": 1} and any(a is scratch for a in seen[0].args)
    assert candidate_count(3000) == MAX_TOP_K and candidate_count(700) == 700


@needs_triton
@pytest.mark.parametrize("arch, use_pdl", [(90, True), (80, False)])
def test_compiles_without_spills(arch, use_pdl):
    """The kernel compiled ahead of time (bench/lab/triton_compile.py, no GPU) for a large
    vocabulary, with counts, greedy tokens and next_token: no spill, and it fits the SM."""
    from ringleader.bench.lab.triton_compile import compile_specialization
    from ringleader.bench.lab.triton_specializations import Specializer

    launches: list = []
    args = _meta_args(m=64, vocab=151936, n_slots=128)
    with LaunchRecorder(on_launch=launches.append):
        sample_rows_triton(**args, use_pdl=use_pdl)
    result = compile_specialization(Specializer(arch).derive(launches[0]))
    assert result["ok"] and result["spills"] == 0, result
