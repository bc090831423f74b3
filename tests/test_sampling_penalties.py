"""The sampler's penalties, min_p and `valid` rows: against references written from vLLM's
definitions, and against the sampler as it was before them (seeded draws must reproduce)."""

from __future__ import annotations

import math

import torch

from ringleader.device.sampling.sampler import (
    SamplingTensors,
    any_penalty,
    apply_penalties,
    counter_uniform,
    sample,
)
from ringleader.ipc.layout import PROMPT_MARK
from ringleader.ipc.sampling_params import MAX_TOP_K


def reference_sample_before(logits, params, uniform=counter_uniform):
    """sample() as it was before penalties and min_p (the body copied unchanged): rows with
    neutral penalties and min_p 0 must still draw exactly this."""
    N, V = logits.shape
    dev = logits.device
    logits = logits.float()
    temperature = params.temperature.to(dev, torch.float32)
    top_p = params.top_p.to(dev, torch.float32)[:, None]
    top_k = params.top_k.to(dev, torch.int64)[:, None]
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    target = uniform(params.seed.to(dev), params.counter.to(dev))[:, None]  # in (0, 1)

    row_max = scaled.amax(-1, keepdim=True)
    cum_all = torch.exp(scaled - row_max).cumsum(dim=-1)
    from_vocab = (cum_all < target * cum_all[:, -1:]).sum(dim=-1).clamp_(max=V - 1)

    K = min(V, MAX_TOP_K)
    cand_vals, cand_idx = torch.topk(scaled, K, dim=-1)
    rank = torch.arange(K, device=dev)[None, :]
    in_top_k = (top_k <= 0) | (rank < top_k)
    cand_vals = cand_vals.masked_fill(~in_top_k, float("-inf"))
    log_total = torch.where(top_k > 0, cand_vals.logsumexp(-1, keepdim=True), row_max + cum_all[:, -1:].log())
    probs = torch.exp(cand_vals - log_total)
    cum = probs.cumsum(dim=-1)
    in_top_p = ((cum - probs) < top_p) | (top_p >= 1.0) | (rank == 0)
    cum = (probs * in_top_p).cumsum(dim=-1)
    pos = (cum < target * cum[:, -1:]).sum(dim=-1, keepdim=True).clamp_(max=K - 1)
    from_candidates = cand_idx.gather(1, pos).squeeze(1)

    unrestricted = ((top_k <= 0) & (top_p >= 1.0)).squeeze(1)
    drawn = torch.where(unrestricted, from_vocab, from_candidates)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def _full(n, value, dtype=torch.float32):
    return torch.full((n,), value, dtype=dtype)


def _counts_word(prompts, outputs, vocab):
    """The scheduler's token_counts rows: the output's count of each token, plus PROMPT_MARK
    where the token is in the prompt."""
    rows = []
    for prompt, output in zip(prompts, outputs):
        output_count = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab)
        in_prompt = torch.bincount(torch.tensor(prompt, dtype=torch.int64), minlength=vocab) > 0
        rows.append(output_count + PROMPT_MARK * in_prompt)
    return torch.stack(rows).to(torch.int32)


def penalized_reference(logits, prompts, outputs, repetition, frequency, presence):
    """vLLM's penalties written from their definitions, from the token lists themselves."""
    n, vocab = logits.shape
    prompt_mask = torch.zeros(n, vocab, dtype=torch.bool)
    output_count = torch.zeros(n, vocab, dtype=torch.int64)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        prompt_mask[i, torch.tensor(prompt, dtype=torch.int64)] = True
        ids = torch.tensor(output, dtype=torch.int64)
        output_count[i].scatter_add_(0, ids, torch.ones_like(ids))
    out = logits.clone()
    seen = prompt_mask | (output_count > 0)
    r = repetition[:, None].expand_as(out)
    out = torch.where(seen & (out > 0), out / r, out)
    out = torch.where(seen & (logits <= 0), out * r, out)
    out = out - frequency[:, None] * output_count.float()
    return out - presence[:, None] * (output_count > 0).float()


def _token_lists(n, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, vocab, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]
    outputs = [
        torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]
    return prompts, outputs


def test_apply_penalties_matches_vllm_definitions():
    vocab = 64
    # (repetition, frequency, presence): each alone, all together, negative f and p, neutral
    settings = [
        (1.3, 0.0, 0.0),
        (0.7, 0.0, 0.0),
        (1.0, 0.8, 0.0),
        (1.0, 0.0, 1.1),
        (1.2, 0.5, 0.9),
        (0.8, -1.5, -2.0),
        (1.0, -0.3, 0.0),
        (1.0, 0.0, 0.0),
    ]
    n = len(settings)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(4)) * 3
    prompts, outputs = _token_lists(n, vocab, seed=5)
    outputs[1] = []  # a prompt alone still earns the repetition penalty
    repetition, frequency, presence = (torch.tensor(column) for column in zip(*settings))
    counts = _counts_word(prompts, outputs, vocab)
    params = SamplingTensors(
        torch.zeros(n, dtype=torch.int64),
        counts,
        repetition_penalty=repetition,
        frequency_penalty=frequency,
        presence_penalty=presence,
    )
    got = apply_penalties(logits, params)
    want = penalized_reference(logits, prompts, outputs, repetition, frequency, presence)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # every penalized row moved, the neutral one did not
    assert all(not torch.equal(got[i], logits[i]) for i in range(n - 1))
    assert torch.equal(got[n - 1], logits[n - 1])
    # no counts kept: the logits as they are
    assert torch.equal(
        apply_penalties(logits, SamplingTensors(params.counter, None, **params.values)), logits
    )


def test_neutral_rows_with_garbage_counts_are_the_raw_logits():
    n, vocab = 6, 500
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(6)) * 5
    logits[0, :4] = torch.tensor([0.0, -0.0, float("-inf"), 1e-30])
    garbage = torch.randint(-(2**31), 2**31 - 1, (n, vocab), generator=torch.Generator().manual_seed(7))
    params = SamplingTensors(torch.zeros(n, dtype=torch.int64), garbage.to(torch.int32))
    out = apply_penalties(logits, params)
    assert torch.equal(out, logits) and not out.isnan().any()
    assert torch.equal(out[0, :2].signbit(), logits[0, :2].signbit())  # -0.0 stays -0.0


def test_greedy_takes_the_argmax_of_the_penalized_logits():
    vocab = 8
    base = torch.tensor([5.0, 4.9, 1.0, 0.0, -2.0, -3.0, -4.0, -5.0])
    negative = torch.tensor([-1.0, -1.1, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0])
    logits = torch.stack([base, base, base, negative, base])
    prompts = [[3], [0], [3], [0], [0]]
    outputs = [[0, 0, 0], [5], [0], [], [0, 0, 0]]  # the last row: the same counts, neutral
    repetition = torch.tensor([1.0, 1.1, 1.0, 1.2, 1.0])
    frequency = torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0])
    presence = torch.tensor([0.0, 0.0, 0.2, 0.0, 0.0])
    params = SamplingTensors(
        torch.zeros(5, dtype=torch.int64),
        _counts_word(prompts, outputs, vocab),
        temperature=torch.zeros(5),
        repetition_penalty=repetition,
        frequency_penalty=frequency,
        presence_penalty=presence,
    )
    # 5 - 3 * 0.5; 5 / 1.1; 5 - 0.2; -1 * 1.2: each now below token 1's logit
    assert sample(logits, params).tolist() == [1, 1, 1, 1, 0]
    want = penalized_reference(logits, prompts, outputs, repetition, frequency, presence).argmax(-1)
    assert torch.equal(sample(logits, params), want)


def _probs(logits, temperature):
    return torch.softmax(logits.double() / temperature, -1)


def test_min_p_alone_draws_exactly_the_tokens_above_its_threshold():
    """Over twice MAX_TOP_K tokens (min_p alone draws from the whole vocabulary): every draw is
    at or above min_p x the top probability, every clearly kept token with real mass is drawn,
    and the draws follow the distribution renormalised over the kept tokens."""
    n, vocab, temperature, min_p = 4000, 2 * MAX_TOP_K, 0.9, 0.05
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(8)) * 3
    probs = _probs(logits, temperature)[0]
    threshold = min_p * probs.max()
    params = SamplingTensors(
        torch.arange(n),
        temperature=_full(n, temperature),
        min_p=_full(n, min_p),
        seed=_full(n, 99, torch.int64),
    )
    out = sample(logits.repeat(n, 1), params)
    assert bool((probs[out] >= threshold).all())
    kept = probs >= threshold
    renormalised = torch.where(kept, probs, 0.0) / probs[kept].sum()
    clearly_kept = (probs >= 1.05 * threshold) & (renormalised * n >= 10)
    assert int(clearly_kept.sum()) >= 5 and int(kept.sum()) < vocab // 10
    drawn = torch.bincount(out, minlength=vocab)
    assert bool((drawn[clearly_kept] > 0).all())
    # the kept tokens' counts against the renormalised distribution (pooled below 5 expected)
    expected = renormalised[kept] * n
    observed = drawn[kept].double()
    big = expected >= 5
    chi2 = (((observed[big] - expected[big]) ** 2) / expected[big]).sum()
    rest_expected, rest_observed = expected[~big].sum(), observed[~big].sum()
    if rest_expected > 0:
        chi2 += (rest_observed - rest_expected) ** 2 / rest_expected
    dof = int(big.sum())  # categories - 1, plus the pooled rest
    assert chi2.item() < dof + 6 * math.sqrt(2 * dof), (chi2, dof)


def test_min_p_one_draws_the_argmax_at_any_temperature():
    n, vocab = 64, 3 * MAX_TOP_K
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(9)) * 2
    want = logits.argmax(-1)
    for top_k, top_p in ((0, 1.0), (0, 0.9), (10, 1.0), (50, 0.95)):
        params = SamplingTensors(
            torch.arange(n),
            temperature=_full(n, 1.5),
            min_p=_full(n, 1.0),
            top_k=_full(n, top_k, torch.int32),
            top_p=_full(n, top_p),
            seed=torch.arange(n) * 13,
        )
        assert torch.equal(sample(logits, params), want), (top_k, top_p)


def kept_support(scaled, min_p, top_k, top_p):
    """The tokens vLLM's order keeps, in float64: min_p, then top_k, then top_p, each measured
    on what the previous ones kept."""
    probs = torch.softmax(scaled.double(), -1)
    order = torch.argsort(probs, descending=True)
    kept = [int(t) for t in order if probs[t] >= min_p * probs.max()]
    if top_k > 0:
        kept = kept[:top_k]
    mass = sum(float(probs[t]) for t in kept)
    support, before = [], 0.0
    for t in kept:
        if before >= top_p * mass and support:
            break
        support.append(t)
        before += float(probs[t])
    return set(support)


def test_min_p_top_k_and_top_p_each_measure_what_the_previous_kept():
    # relative probabilities at T=1: 1, .82, .61, .37, .30, .22, .05, .02 (vocabulary order
    # shuffled, so nothing relies on it)
    ordered = torch.tensor([0.0, -0.2, -0.5, -1.0, -1.2, -1.5, -3.0, -4.0])
    shuffle = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    logits = torch.empty(8)
    logits[shuffle] = ordered  # token shuffle[i] has the i-th largest logit
    n = 3000
    cases = [
        # (min_p, top_k, top_p): the ranks kept
        (0.25, 4, 0.8, {0, 1, 2}),  # min_p 5 ranks, top_k 4, top_p over those 4: 3
        (0.25, 0, 0.85, {0, 1, 2, 3}),  # top_p over the 5 min_p keeps (the whole mass: 5)
        (0.0, 0, 0.85, {0, 1, 2, 3, 4}),  # no min_p: the same top_p keeps 5
        (0.25, 0, 1.0, {0, 1, 2, 3, 4}),  # min_p alone
        (0.5, 0, 1.0, {0, 1, 2}),
        (0.5, 2, 1.0, {0, 1}),
        (0.5, 4, 1.0, {0, 1, 2}),  # min_p binds below top_k
    ]
    for min_p, top_k, top_p, ranks in cases:
        want = {int(shuffle[r]) for r in ranks}
        assert kept_support(logits, min_p, top_k, top_p) == want  # the reference agrees
        params = SamplingTensors(
            torch.arange(n),
            temperature=_full(n, 1.0),
            min_p=_full(n, min_p),
            top_k=_full(n, top_k, torch.int32),
            top_p=_full(n, top_p),
            seed=_full(n, 17, torch.int64),
        )
        assert set(sample(logits.repeat(n, 1), params).tolist()) == want, (min_p, top_k, top_p)


def test_min_p_top_k_top_p_random_rows_stay_in_the_reference_support():
    n, vocab = 300, 400
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(n, vocab, generator=gen) * 2.5
    temperature = torch.rand(n, generator=gen) + 0.3
    min_p = torch.tensor([0.0, 0.02, 0.1, 0.3])[torch.arange(n) % 4]
    top_k = torch.tensor([0, 5, 40])[torch.arange(n) % 3].to(torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.6, 0.97, 0.8])[torch.arange(n) % 5]
    params = SamplingTensors(
        torch.arange(n),
        temperature=temperature,
        min_p=min_p,
        top_k=top_k,
        top_p=top_p,
        seed=torch.arange(n) + 5,
    )
    out = sample(logits, params)
    for i in range(n):
        support = kept_support(logits[i] / temperature[i], float(min_p[i]), int(top_k[i]), float(top_p[i]))
        assert int(out[i]) in support, i


def _mixed_batch(n, vocab, seed):
    """A seeded batch mixing greedy, plain temperature, top_k, top_p and both, over a
    vocabulary beyond MAX_TOP_K."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen) * torch.linspace(0.5, 6.0, n)[:, None]
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.5, 2.0])[torch.arange(n) % 6]
    top_k = torch.tensor([0, 0, 20, 1, MAX_TOP_K, 0, 300])[torch.arange(n) % 7].to(torch.int32)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.99])[torch.arange(n) % 5]
    seed_ = torch.randint(-(2**62), 2**62, (n,), generator=gen)
    counter = torch.randint(0, 2**20, (n,), generator=gen)
    return logits, dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed_), counter


def test_neutral_rows_draw_what_the_sampler_drew_before():
    n, vocab = 210, 3 * MAX_TOP_K + 17
    logits, fields, counter = _mixed_batch(n, vocab, seed=11)
    before = reference_sample_before(logits, SamplingTensors(counter, **fields))
    assert len(set(before.tolist())) > 100  # the batch really samples
    garbage = torch.randint(-(2**31), 2**31 - 1, (n, vocab), generator=torch.Generator().manual_seed(12))
    neutral = dict(min_p=torch.zeros(n), presence_penalty=torch.zeros(n), repetition_penalty=torch.ones(n))
    for counts in (None, garbage.to(torch.int32)):
        params = SamplingTensors(counter, counts, **fields, **neutral)
        assert torch.equal(sample(logits, params), before)
        assert torch.equal(sample(logits, params, valid=torch.ones(n, dtype=torch.bool)), before)


def _penalized_batch(n, vocab, seed):
    logits, fields, counter = _mixed_batch(n, vocab, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    prompts, outputs = _token_lists(n, vocab, seed + 2)
    fields.update(
        min_p=torch.tensor([0.0, 0.05, 0.2])[torch.arange(n) % 3],
        repetition_penalty=torch.tensor([1.0, 1.3, 0.8, 1.1])[torch.arange(n) % 4],
        frequency_penalty=(torch.rand(n, generator=gen) - 0.5) * 2,
        presence_penalty=torch.tensor([0.0, 1.5, -0.5])[torch.arange(n) % 3],
    )
    return logits, fields, counter, _counts_word(prompts, outputs, vocab)


def test_batch_invariance_with_min_p_and_penalties():
    n, vocab = 24, 2 * MAX_TOP_K
    logits, fields, counter, counts = _penalized_batch(n, vocab, seed=13)
    batched = sample(logits, SamplingTensors(counter, counts, **fields))
    for i in range(n):
        row = slice(i, i + 1)
        alone = SamplingTensors(counter[row], counts[row], **{k: v[row] for k, v in fields.items()})
        assert sample(logits[row], alone).item() == batched[i].item()
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(14))
    shuffled = SamplingTensors(counter[perm], counts[perm], **{k: v[perm] for k, v in fields.items()})
    assert torch.equal(sample(logits[perm], shuffled), batched[perm])
    # the penalties do change draws
    assert not torch.equal(sample(logits, SamplingTensors(counter, None, **fields)), batched)


def test_invalid_rows_take_their_argmax_and_leave_the_others_alone():
    n, vocab = 12, 2 * MAX_TOP_K
    logits, fields, counter, counts = _penalized_batch(n, vocab, seed=15)
    valid = torch.tensor([True, False] * (n // 2))
    want_valid = sample(
        logits[valid],
        SamplingTensors(counter[valid], counts[valid], **{k: v[valid] for k, v in fields.items()}),
    )
    nan, inf = float("nan"), float("inf")
    stale = ~valid
    count = int(stale.sum())
    poison = {
        "temperature": torch.tensor([nan, inf, -inf, 1e-45, nan, 3.0]),
        "top_p": torch.tensor([nan, -1.0, inf, 0.0, 2.0, nan]),
        "top_k": torch.tensor([-7, 2**31 - 1, 0, -(2**31), 5, 1], dtype=torch.int32),
        "min_p": torch.tensor([nan, 5.0, -1.0, inf, 1.0, -inf]),
        "repetition_penalty": torch.tensor([nan, 0.0, inf, -3.0, 1e-45, nan]),
        "frequency_penalty": torch.tensor([inf, nan, -inf, 1e30, 0.0, nan]),
        "presence_penalty": torch.tensor([-inf, inf, nan, -1e30, nan, 0.0]),
    }
    for name, values in poison.items():
        fields[name] = fields[name].clone()
        fields[name][stale] = values[:count].to(fields[name].dtype)
    counts = counts.clone()
    counts[stale] = torch.randint(
        -(2**31), 2**31 - 1, (count, vocab), generator=torch.Generator().manual_seed(16)
    ).to(torch.int32)
    poisoned = SamplingTensors(counter, counts, **fields)
    out = sample(logits, poisoned, valid=valid)
    assert bool(((out >= 0) & (out < vocab)).all())
    # the argmax of whatever its own garbage made of its row: nothing leaves the row
    assert torch.equal(out[stale], apply_penalties(logits, poisoned)[stale].argmax(-1))
    assert torch.equal(out[valid], want_valid)


def test_any_penalty_reads_the_declared_penalty_fields():
    n = 4
    counter = torch.zeros(n, dtype=torch.int32)
    assert not any_penalty(SamplingTensors(counter))
    # non-penalty fields off their defaults are no penalty
    assert not any_penalty(SamplingTensors(counter, temperature=_full(n, 0.7), min_p=_full(n, 0.3)))
    for name, value in (("presence_penalty", -0.5), ("frequency_penalty", 0.1), ("repetition_penalty", 1.2)):
        column = SamplingTensors(counter).values[name].clone()
        column[2] = value
        assert any_penalty(SamplingTensors(counter, **{name: column})), name


def test_uniform_gets_dense_int64_seeds_from_strided_views():
    """The step layout hands strided views (a uint64 seed among them); a kernel form of the
    uniform reads dense arrays, so sample() passes them dense, the seed as its int64 bits."""
    n, vocab = 6, 50
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(17))
    seeds = torch.tensor([2**63 + 5, 1, 2**64 - 1, 7, 2**40, 3], dtype=torch.uint64)
    interleaved = torch.zeros(2 * n, dtype=torch.uint64)
    interleaved[::2] = seeds
    counter = torch.arange(2 * n, dtype=torch.int32)[::2]
    seen = []

    def dense_uniform(seed, ctr):
        seen.append((seed.dtype, seed.is_contiguous(), ctr.is_contiguous()))
        return counter_uniform(seed, ctr)

    strided = SamplingTensors(counter, temperature=_full(n, 1.0), seed=interleaved[::2])
    dense = SamplingTensors(counter.contiguous().long(), temperature=_full(n, 1.0), seed=seeds.long())
    assert torch.equal(sample(logits, strided, uniform=dense_uniform), sample(logits, dense))
    assert seen == [(torch.int64, True, True)]
    assert seeds.long()[0].item() == -(2**63) + 5  # the bits, wrapped
