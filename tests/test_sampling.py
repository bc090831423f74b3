"""Counter-based sampling: greedy, determinism independent of batch, top-k/top-p, distribution."""

from __future__ import annotations

import torch

from ringleader.bench.lab.sampler_micro import sorted_reference
from ringleader.device.sampling.sampler import SamplingTensors, _mul32, counter_uniform, sample
from ringleader.ipc.sampling_params import MAX_TOP_K


def _params(n, temperature=1.0, top_k=0, top_p=1.0, seed=0, counter=0):
    full = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    return (
        full(temperature, torch.float32),
        full(top_k, torch.int64),
        full(top_p, torch.float32),
        full(seed, torch.int64),
        full(counter, torch.int64),
    )


def _logits(n, v, seed=0, scale=3.0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax():
    logits = _logits(8, 50)
    for t in (0.0, -1.0):
        temp, top_k, top_p, seed, counter = _params(8, temperature=t)
        out = sample(logits, SamplingTensors(counter, temperature=temp, top_k=top_k, top_p=top_p, seed=seed))
        assert out.dtype == torch.int64 and torch.equal(out, logits.argmax(-1))


def test_seeded_draw_independent_of_batch_composition():
    logits = _logits(6, 100, seed=1, scale=1.0)
    temp = torch.tensor([0.8, 1.0, 0.0, 1.3, 0.7, 1.0])
    top_k = torch.tensor([0, 5, 0, 0, 20, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.95, 1.0])
    seed = torch.tensor([11, -5, 3, 2**40 + 7, 99, 11])
    counter = torch.tensor([0, 3, 1, 17, 2**33, 1])
    batched = sample(logits, SamplingTensors(counter, temperature=temp, top_k=top_k, top_p=top_p, seed=seed))
    for i in range(6):
        row = slice(i, i + 1)
        alone = sample(
            logits[row],
            SamplingTensors(
                counter[row], temperature=temp[row], top_k=top_k[row], top_p=top_p[row], seed=seed[row]
            ),
        )
        assert alone.item() == batched[i].item()
    # permuting the batch permutes the result
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    shuffled = sample(
        logits[perm],
        SamplingTensors(
            counter[perm], temperature=temp[perm], top_k=top_k[perm], top_p=top_p[perm], seed=seed[perm]
        ),
    )
    assert torch.equal(shuffled, batched[perm])


def test_counters_and_seeds_change_draws():
    logits = torch.zeros(64, 1000)  # uniform distribution: draws are just the RNG
    t, k, p, s, _ = _params(64)
    by_counter = sample(logits, SamplingTensors(torch.arange(64), temperature=t, top_k=k, top_p=p, seed=s))
    assert len(set(by_counter.tolist())) > 55
    by_seed = sample(
        logits,
        SamplingTensors(
            torch.zeros(64, dtype=torch.int64), temperature=t, top_k=k, top_p=p, seed=torch.arange(64) * 7919
        ),
    )
    assert len(set(by_seed.tolist())) > 55
    again = sample(logits, SamplingTensors(torch.arange(64), temperature=t, top_k=k, top_p=p, seed=s))
    assert torch.equal(again, by_counter)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(32, 200, seed=2, scale=1.0)
    want = logits.argmax(-1)
    t, _, p, _, _ = _params(32, temperature=1.5)
    seeds, ctrs = torch.arange(32), torch.arange(32) * 3
    assert torch.equal(
        sample(
            logits,
            SamplingTensors(
                ctrs, temperature=t, top_k=torch.ones(32, dtype=torch.int64), top_p=p, seed=seeds
            ),
        ),
        want,
    )
    assert torch.equal(
        sample(
            logits,
            SamplingTensors(
                ctrs,
                temperature=t,
                top_k=torch.zeros(32, dtype=torch.int64),
                top_p=torch.full((32,), 1e-6),
                seed=seeds,
            ),
        ),
        want,
    )
    assert torch.equal(
        sample(
            logits,
            SamplingTensors(
                ctrs,
                temperature=t,
                top_k=torch.zeros(32, dtype=torch.int64),
                top_p=torch.zeros(32),
                seed=seeds,
            ),
        ),
        want,
    )


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    t, _, _, s, _ = _params(2000, temperature=2.0, seed=5)
    ctr = torch.arange(2000)
    out = sample(
        logits,
        SamplingTensors(ctr, temperature=t, top_k=torch.full((2000,), 3), top_p=torch.ones(2000), seed=s),
    )
    assert set(out.tolist()) == {0, 1, 2}
    # probs at T=2: .39 .24 .14 .09 .05 .03 -> top_p 0.7 keeps {0, 1, 2} (mass before 2 is .63)
    out = sample(
        logits,
        SamplingTensors(
            ctr,
            temperature=t,
            top_k=torch.zeros(2000, dtype=torch.int64),
            top_p=torch.full((2000,), 0.7),
            seed=s,
        ),
    )
    assert set(out.tolist()) == {0, 1, 2}


def test_empirical_distribution_matches_softmax():
    v, n = 8, 20000
    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    temp = 0.9
    probs = torch.softmax(base[0] / temp, -1)
    t, k, p, _, _ = _params(n, temperature=temp)
    out = sample(
        base.repeat(n, 1),
        SamplingTensors(torch.arange(n), temperature=t, top_k=k, top_p=p, seed=torch.full((n,), 1234)),
    )
    counts = torch.bincount(out, minlength=v).double()
    expected = probs.double() * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 30.0, (chi2, counts, expected)  # 7 dof: p(chi2 > 30) ~ 1e-4


def test_uniform_range_and_mul32():
    u = counter_uniform(torch.full((100000,), 42), torch.arange(100000))
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    a = torch.tensor([0, 1, 0xFFFFFFFF, 0x12345678, 0xDEADBEEF])
    for c in (0x7FEB352D, 0x846CA68B, 0xFFFFFFFF):
        want = torch.tensor([(int(x) * c) & 0xFFFFFFFF for x in a])
        assert torch.equal(_mul32(a, c), want)


def test_candidates_match_a_full_sort_when_the_kept_set_fits():
    """Over a vocabulary 5x MAX_TOP_K: any top_k up to the bound, and top_p on peaked rows
    (nucleus inside the candidates), draw what sorting the whole vocabulary draws."""
    n, v = 400, 5 * MAX_TOP_K
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(n, v, generator=gen) * torch.linspace(2.0, 9.0, n)[:, None]
    temp = torch.rand(n, generator=gen) * 1.5 + 0.2
    top_k = torch.tensor([1, 7, 50, MAX_TOP_K, 0])[torch.arange(n) % 5]
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.97])[torch.arange(n) % 4]
    top_p = torch.where(top_k == 0, torch.full_like(top_p, 0.6), top_p)  # k off: p binds
    seed, ctr = torch.arange(n) * 31 + 7, torch.arange(n)
    got = sample(logits, SamplingTensors(ctr, temperature=temp, top_k=top_k, top_p=top_p, seed=seed))
    want = sorted_reference(logits, temp, top_k, top_p, seed, ctr)
    # rounding of the cumulative sums may move a draw that lands on a boundary: allow 1 in 100
    assert (got == want).float().mean() >= 0.99, (got != want).sum()


def test_unrestricted_rows_reach_the_whole_vocabulary():
    """top_k off and top_p 1: the tail beyond the candidates is drawn, in its true proportion."""
    v, n = 4 * MAX_TOP_K, 8000
    logits = torch.zeros(1, v)
    logits[0, :8] = 3.0  # a head of 8 likely tokens; the rest is the tail
    t, k, p, _, _ = _params(n)
    out = sample(
        logits.repeat(n, 1),
        SamplingTensors(torch.arange(n), temperature=t, top_k=k, top_p=p, seed=torch.full((n,), 77)),
    )
    tail_share = (out >= 8).float().mean().item()
    want = (v - 8) / (v - 8 + 8 * torch.e**3)
    assert abs(tail_share - want) < 0.02, (tail_share, want)
    assert int(out.max()) >= MAX_TOP_K  # beyond any candidate set


def test_flat_top_p_nucleus_is_cut_at_the_candidates():
    """The documented bound: when the K most likely tokens hold less than top_p, the draw stays
    among them."""
    v, n = 4 * MAX_TOP_K, 3000
    logits = torch.linspace(0.0, -0.01, v)[None, :].repeat(n, 1)  # nearly flat, descending
    t, k, _, _, _ = _params(n)
    out = sample(
        logits,
        SamplingTensors(
            torch.arange(n), temperature=t, top_k=k, top_p=torch.full((n,), 0.95), seed=torch.full((n,), 5)
        ),
    )
    assert int(out.max()) < MAX_TOP_K and len(set(out.tolist())) > 500
