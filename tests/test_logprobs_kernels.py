"""The sampler's logprobs (sampling.token_logprobs, store_logprobs) and its out-of-place penalties
and temperature (sampling.penalize_and_scale), in torch and as Triton launches
(device/sampling/triton_sampler.py).

torch: a record is log_softmax and topk of the raw logits, and store_logprobs writes only the
rows that asked (and are valid) into their slots. Triton: the kernels run under the interpreter
in a child process started with TRITON_INTERPRET=1 (`run_interpreted_checks`, as
test_triton_fused.py does); penalize_and_scale_triton is bit for bit the torch form, so sample()
draws the same tokens with either; store_logprobs_triton writes what store_logprobs writes
(logprobs within 1e-5, ids equal but among exact ties, which it orders by id) and nothing for a
row that asked nothing or is past n_valid.
"""

from __future__ import annotations

import time

import pytest
import torch

from ringleader.device.sampling.sampler import (
    LOGPROBS_WORD,
    LOGPROBS_WORDS,
    SamplingTensors,
    apply_penalties,
    penalize_and_scale,
    sample,
    store_logprobs,
    token_logprobs,
)
from ringleader.device.sampling.triton_sampler import HAVE_TRITON
from ringleader.device.step.triton_launch import LaunchRecorder
from ringleader.ipc.layout import PROMPT_MARK
from ringleader.ipc.sampling_params import MAX_LOGPROBS
from tests.triton_interpreter import run_interpreted_checks_of

IDS = slice(LOGPROBS_WORD["top_ids"], LOGPROBS_WORD["top_ids"] + MAX_LOGPROBS)
TOP = slice(LOGPROBS_WORD["top_logprobs"], LOGPROBS_WORD["top_logprobs"] + MAX_LOGPROBS)


def _fields(records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int32 [..., LOGPROBS_WORDS] record table as (logprob, n_top, top_ids, top_logprobs)."""
    words = records.view(-1, LOGPROBS_WORDS)
    return words[:, 0].view(torch.float32), words[:, 1], words[:, IDS], words[:, TOP].view(torch.float32)


# ---- torch --------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [7, 20, 50, 300])
def test_token_logprobs_is_log_softmax_and_topk(vocab):
    gen = torch.Generator().manual_seed(vocab)
    n = 6
    logits = torch.randn(n, vocab, generator=gen) * 4
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    top_n = torch.tensor([-1, 0, 1, 5, 20, 25], dtype=torch.int32)
    records = token_logprobs(logits, tokens, top_n)
    assert records.dtype == torch.int32 and records.shape == (n, LOGPROBS_WORDS)
    logprob, n_top, ids, top_logprobs = _fields(records)

    log_softmax = torch.log_softmax(logits, dim=-1)
    k = min(MAX_LOGPROBS, vocab)
    want_values, want_ids = torch.topk(log_softmax, k, dim=-1)
    torch.testing.assert_close(logprob, log_softmax.gather(1, tokens[:, None]).squeeze(1), atol=1e-5, rtol=0)
    assert n_top.tolist() == top_n.clamp(0, k).tolist()
    assert torch.equal(ids[:, :k], want_ids.int())  # random logits: no ties
    torch.testing.assert_close(top_logprobs[:, :k], want_values, atol=1e-5, rtol=0)
    # a vocabulary under MAX_LOGPROBS: the unused entries are id 0, logprob -inf
    assert (ids[:, k:] == 0).all() and (top_logprobs[:, k:] == float("-inf")).all()


def _store_case(gen: torch.Generator, n_slots: int = 6, vocab: int = 60):
    """Rows [6]: slots (99: stale, clamped to the last), top_n (-1: asked nothing), and a random
    table to write into."""
    slot = torch.tensor([3, 1, 99, 0, 2, 4], dtype=torch.int32)
    top_n = torch.tensor([2, -1, 5, 0, 20, 3], dtype=torch.int32)
    logits = torch.randn(6, vocab, generator=gen) * 3
    tokens = torch.randint(0, vocab, (6,), generator=gen)
    table = torch.randint(-(2**31), 2**31 - 1, (n_slots, LOGPROBS_WORDS), generator=gen, dtype=torch.int32)
    return table, slot, logits, tokens, top_n


def test_store_logprobs_writes_only_the_rows_that_asked():
    gen = torch.Generator().manual_seed(1)
    table, slot, logits, tokens, top_n = _store_case(gen)
    records = token_logprobs(logits, tokens, top_n)
    valid = torch.tensor([True, True, True, True, False, True])
    before = table.clone()
    store_logprobs(table, slot, logits, tokens, top_n, valid)
    # row -> slot: 0 -> 3, 2 -> 5 (clamped), 3 -> 0, 5 -> 4; row 1 asked nothing, row 4 is stale
    for row, s in ((0, 3), (2, 5), (3, 0), (5, 4)):
        assert torch.equal(table[s], records[row]), row
    for s in (1, 2):
        assert torch.equal(table[s], before[s]), s
    # without `valid` every row that asked writes
    store_logprobs(table, slot, logits, tokens, top_n)
    assert torch.equal(table[2], records[4]) and torch.equal(table[1], before[1])


def test_store_logprobs_needs_no_host_sync():
    """It runs on the meta device, where any .item() or boolean indexing would fail."""
    table = torch.zeros(4, LOGPROBS_WORDS, dtype=torch.int32, device="meta")
    int_rows = dict(dtype=torch.int32, device="meta")
    logits = torch.empty(3, 1000, device="meta")
    store_logprobs(
        table,
        torch.empty(3, **int_rows),
        logits,
        torch.empty(3, dtype=torch.int64, device="meta"),
        torch.empty(3, **int_rows),
        torch.empty(3, dtype=torch.bool, device="meta"),
    )
    assert token_logprobs(logits, torch.empty(3, **int_rows), torch.empty(3, **int_rows)).shape == (
        3,
        LOGPROBS_WORDS,
    )


def _mixed_params(gen: torch.Generator, n: int, vocab: int, counts: bool) -> SamplingTensors:
    """Rows cycling greedy, top-k, top-p, min_p and plain temperature; penalties on some rows,
    through slots into a count table when `counts`."""
    kind = torch.arange(n) % 5
    fields = dict(
        temperature=torch.where(kind == 0, 0.0, torch.tensor([0.6, 0.9, 1.3, 0.8, 1.0])[kind]),
        top_k=torch.where(kind == 1, 7, 0).int(),
        top_p=torch.where(kind == 2, 0.8, 1.0),
        min_p=torch.where(kind == 3, 0.1, 0.0),
        seed=torch.arange(n) * 11 + 3,
        repetition_penalty=torch.where(torch.arange(n) % 3 == 0, 1.4, 1.0),
        frequency_penalty=torch.where(torch.arange(n) % 2 == 0, 0.5, 0.0),
        presence_penalty=torch.where(torch.arange(n) % 4 == 1, 0.7, 0.0),
    )
    table = None
    slot = None
    if counts:
        n_slots = n + 2
        table = torch.randint(0, 3, (n_slots, vocab), generator=gen, dtype=torch.int32)
        table |= PROMPT_MARK * (torch.rand(n_slots, vocab, generator=gen) < 0.1).int()
        slot = torch.randperm(n_slots, generator=gen)[:n].int()
    counter = torch.randint(0, 1000, (n,), generator=gen, dtype=torch.int32)
    return SamplingTensors(counter, table, slot, **fields)


def test_sample_leaves_the_logits_raw():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(10, 80, generator=gen) * 3
    raw = logits.clone()
    params = _mixed_params(gen, 10, 80, counts=True)
    tokens = sample(logits, params)
    assert torch.equal(logits, raw)
    greedy = params.temperature <= 0
    assert torch.equal(tokens[greedy], apply_penalties(logits, params)[greedy].argmax(-1))
    divisor = torch.full((10,), 0.5)
    assert torch.equal(penalize_and_scale(logits, params, divisor), apply_penalties(logits, params) / 0.5)


# ---- Triton, on the meta device -----------------------------------------------------------------


def test_each_triton_form_is_one_launch_on_meta():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from ringleader.device.sampling.triton_sampler import penalize_and_scale_triton, store_logprobs_triton

    n, vocab, n_slots = 5, 128256, 9
    meta = dict(device="meta")
    logits = torch.empty(n, vocab, **meta)
    divisor = torch.empty(n, **meta)
    counter = torch.empty(n, dtype=torch.int32, **meta)
    counts = torch.empty(n_slots, vocab, dtype=torch.int32, **meta)
    for params in (SamplingTensors(counter), SamplingTensors(counter, counts, counter)):
        with LaunchRecorder() as rec:
            out = penalize_and_scale_triton(logits, params, divisor)
        assert dict(rec.counts) == {"_penalize_and_scale_kernel": 1}
        assert out.shape == (n, vocab) and out.dtype == torch.float32 and out is not logits
    table = torch.empty(n_slots, LOGPROBS_WORDS, dtype=torch.int32, **meta)
    with LaunchRecorder() as rec:
        store_logprobs_triton(
            table, counter, logits, torch.empty(n, dtype=torch.int64, **meta), counter, counter[:1]
        )
    assert dict(rec.counts) == {"_store_logprobs_kernel": 1}
    with pytest.raises(ValueError):  # the table holds whole records
        store_logprobs_triton(table[:, :40], counter, logits, counter, counter, counter[:1])


# ---- Triton, under the interpreter --------------------------------------------------------------


def test_triton_forms_under_interpreter():
    run_interpreted_checks_of("tests.test_logprobs_kernels", "interpreted checks passed")


def run_interpreted_checks() -> None:
    """Entry point of the child process (TRITON_INTERPRET=1 set before anything imported triton)."""
    from ringleader.device.sampling import triton_sampler as ts

    assert type(ts._store_logprobs_kernel).__name__ == "InterpretedFunction", "triton imported too early"
    t0 = time.perf_counter()
    default_blocks = ts.PENALTY_BLOCK, ts.LOGPROBS_BLOCK
    for blocks in (default_blocks, (64, 32)):  # small blocks: rows of several blocks
        ts.PENALTY_BLOCK, ts.LOGPROBS_BLOCK = blocks
        for vocab in (12, 50, 300):
            check_penalize_and_scale(vocab)
            check_store_logprobs(vocab)
        check_store_logprobs_ties()
        check_sample_with_triton_scale()
    ts.PENALTY_BLOCK, ts.LOGPROBS_BLOCK = default_blocks
    print(f"interpreted checks passed in {time.perf_counter() - t0:.1f} s")


def check_penalize_and_scale(vocab: int) -> None:
    """Bit for bit penalize_and_scale, with a count table (mixed rows: penalized and not, greedy
    divisor 1) and without one (the division alone); the logits are left as they were."""
    from ringleader.device.sampling.triton_sampler import penalize_and_scale_triton

    gen = torch.Generator().manual_seed(vocab)
    n = 8
    logits = torch.randn(n, vocab, generator=gen) * 4
    logits[:, :6] = torch.tensor([0.0, -0.0, 3.0, -3.0, 1e-30, float("-inf")])[: min(6, vocab)]
    raw = logits.clone()
    for counts in (True, False):
        params = _mixed_params(gen, n, vocab, counts)
        divisor = torch.where(params.temperature <= 0, 1.0, params.temperature)
        want = penalize_and_scale(logits, params, divisor)
        got = penalize_and_scale_triton(logits, params, divisor)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (vocab, counts)
        assert torch.equal(logits.view(torch.int32), raw.view(torch.int32)), "the logits were written"
        if not counts:
            assert torch.equal(got.view(torch.int32), (logits / divisor[:, None]).view(torch.int32))


def _assert_records_agree(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor, what: str) -> None:
    """Records of the rows `logits` [n, V] (one each): logprob within 1e-5, n_top equal, the first
    n_top ids equal but among exact ties (the same logit), their logprobs within 1e-5."""
    g_logprob, g_n, g_ids, g_top = _fields(got)
    w_logprob, w_n, w_ids, w_top = _fields(want)
    torch.testing.assert_close(g_logprob, w_logprob, atol=1e-5, rtol=0, msg=what)
    assert torch.equal(g_n, w_n), what
    for row in range(logits.shape[0]):
        k = int(w_n[row])
        same_logit = logits[row, g_ids[row, :k].long()] == logits[row, w_ids[row, :k].long()]
        assert bool(same_logit.all()), (what, row)
        torch.testing.assert_close(g_top[row, :k], w_top[row, :k], atol=1e-5, rtol=0, msg=what)


def check_store_logprobs(vocab: int) -> None:
    """store_logprobs_triton writes what store_logprobs writes, for the rows that asked and are
    below n_valid, and only the record's first n_top entries; other slots stay as they were."""
    from ringleader.device.sampling.triton_sampler import store_logprobs_triton

    gen = torch.Generator().manual_seed(vocab + 1)
    table, slot, logits, tokens, top_n = _store_case(gen, vocab=vocab)
    logits[1, : vocab // 2] = float("-inf")  # a row with masked tokens (it asked nothing)
    logits[4, vocab // 3 :] = float("-inf")  # fewer finite entries than it asks for at vocab 50
    n_valid = torch.tensor([5], dtype=torch.int32)  # row 5 is stale
    valid = torch.arange(6) < 5
    want = table.clone()
    store_logprobs(want, slot, logits, tokens, top_n, valid)
    got = table.clone()
    store_logprobs_triton(got, slot, logits, tokens, top_n, n_valid)
    # row -> slot: 0 -> 3, 2 -> 5 (clamped), 3 -> 0 (n_top 0), 4 -> 2; row 1 asked nothing, row 5
    # is past n_valid: slots 1 and 4 untouched
    for s in (1, 4):
        assert torch.equal(got[s], table[s]), (vocab, s)
    rows, slots = [0, 2, 3, 4], [3, 5, 0, 2]
    _assert_records_agree(got[slots], want[slots], logits[rows], f"vocab {vocab}")
    for row, s in zip(rows, slots):  # entries past n_top: as they were
        k = int(got[s, 1])
        assert torch.equal(got[s, IDS][k:], table[s, IDS][k:]), (vocab, row)
        assert torch.equal(got[s, TOP][k:], table[s, TOP][k:]), (vocab, row)
    # nobody asking, or nothing valid: the table is not touched at all
    untouched = table.clone()
    store_logprobs_triton(untouched, slot, logits, tokens, torch.full_like(top_n, -1), n_valid)
    store_logprobs_triton(untouched, slot, logits, tokens, top_n, torch.zeros(1, dtype=torch.int32))
    assert torch.equal(untouched, table)


def check_store_logprobs_ties() -> None:
    """Integer logits (many exact ties): the alternatives in (logit descending, id ascending)
    order, a stable sort's, and the logprobs those of store_logprobs; top_n as a strided view
    (the step layout's sample entries) and int64 tokens."""
    from ringleader.device.sampling.triton_sampler import store_logprobs_triton

    gen = torch.Generator().manual_seed(7)
    n, vocab = 4, 90
    logits = torch.randint(-4, 5, (n, vocab), generator=gen).float()
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    top_n = torch.tensor([[20, 0], [7, 0], [1, 0], [0, 0]], dtype=torch.int32)[:, 0]
    assert top_n.stride(0) == 2
    slot = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    table = torch.zeros(n, LOGPROBS_WORDS, dtype=torch.int32)
    want = table.clone()
    store_logprobs(want, slot, logits, tokens, top_n)
    store_logprobs_triton(table, slot, logits, tokens, top_n, torch.tensor([n], dtype=torch.int32))
    _assert_records_agree(table, want, logits, "ties")
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    _, n_top, ids, _ = _fields(table)
    for row in range(n):
        k = int(n_top[row])
        assert ids[row, :k].tolist() == order[row, :k].tolist(), row


def check_sample_with_triton_scale() -> None:
    """sample() draws the same tokens with the Triton scale as with the torch one, with and
    without a count table, and with stale rows (valid False)."""
    from ringleader.device.sampling.triton_sampler import penalize_and_scale_triton

    gen = torch.Generator().manual_seed(11)
    n, vocab = 15, 200
    logits = torch.randn(n, vocab, generator=gen) * 2
    valid = torch.arange(n) < 12
    for counts in (True, False):
        params = _mixed_params(gen, n, vocab, counts)
        for v in (None, valid):
            want = sample(logits, params, valid=v)
            got = sample(logits, params, valid=v, scale=penalize_and_scale_triton)
            assert torch.equal(got, want), (counts, v is None)
