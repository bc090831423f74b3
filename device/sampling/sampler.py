"""Batched token sampling with a counter-based RNG.

Each row draws from a uniform that is a hash of (seed, counter), counter being the index of
the token within its request. So a seeded request samples the same tokens whatever else is in
the batch, and no torch RNG state is touched. Everything is static-shape tensor math (no
.item(), no boolean indexing, no host syncs), so it can run inside a CUDA graph, and row-wise:
a row's token never depends on the other rows.

Order, as vLLM applies the request's settings: the penalties (repetition, then frequency and
presence; `apply_penalties`) on the raw logits, then greedy rows (temperature <= 0) take the
argmax; the others divide by the temperature, drop the tokens below min_p x the top token's
probability, keep the top_k most likely of the rest, then the smallest prefix of those whose
mass (renormalised over what min_p and top_k kept) reaches top_p, and draw from what remains.
The penalties and the division are one out-of-place step (`penalize_and_scale`), so the raw
logits survive sample(): a token's logprobs are vLLM's default, from the raw logits
(`token_logprobs`, `store_logprobs`).

Draw method: inverse CDF with one hash per row (Gumbel-max would need one per vocab entry).
Nothing sorts the vocabulary. Rows that restrict the draw by rank (top_k > 0 or top_p < 1) draw
from the K = min(vocab, MAX_TOP_K) most likely tokens (`torch.topk`, in descending order): exact
whenever the kept set lies among them, which top_k <= MAX_TOP_K (the protocol's bound) always
does, and top_p does whenever those K tokens hold at least top_p of the (min_p-kept) mass;
otherwise (a very flat distribution) the nucleus is cut at those K, and a top_k above MAX_TOP_K
acts as MAX_TOP_K. Rows that restrict nothing by rank (min_p alone, or nothing) draw from the
whole vocabulary in vocabulary order: exact, no candidates involved. min_p is one mask of the
whole vocabulary (p_i / p_max >= min_p, computed as exp(scaled_i - max)), read by both draws, so
it keeps exactly the same tokens in either; min_p 0 masks nothing and leaves every other
computation, hence every draw, bit for bit what it is without it.

min_tokens (vLLM's MinTokensLogitsProcessor): while a row's counter (the tokens its request has
generated) is below its min_tokens, its end ids (the model's end-of-sequence ids, `end_ids`, and
the request's stop_token_ids, `stop_ids`) are -inf, with the constraint's mask, before any draw,
greedy included (`mask_ends`); a row at or past its min_tokens, or with none, is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ringleader.ipc.layout import LOGPROBS, PROMPT_MARK
from ringleader.ipc.sampling_params import FIELD, MAX_LOGPROBS, MAX_TOP_K, RING_FIELDS

RING_NAMES = tuple(name for name, _ in RING_FIELDS)
# the fields whose non-default value asks for the token counts (the declaration's penalty=True)
PENALTY_NAMES = tuple(name for name in RING_NAMES if FIELD[name].penalty)
# a ring scalar's torch dtype (u64 as int64: the same bits; torch's uint64 lacks most ops)
RING_DTYPES = {"f32": torch.float32, "i32": torch.int32, "u64": torch.int64}

_MASK32 = 0xFFFFFFFF

# an RlLogprobs record (ipc/layout.py LOGPROBS) as int32 words: its length, and each field's first
# word; token_logprobs builds the words in this order
LOGPROBS_WORDS = LOGPROBS.size // 4
LOGPROBS_WORD = {field.name: offset // 4 for field, offset in LOGPROBS.offsets()}
assert LOGPROBS_WORD == {"logprob": 0, "n_top": 1, "top_ids": 2, "top_logprobs": 2 + MAX_LOGPROBS}
assert LOGPROBS_WORDS == 2 + 2 * MAX_LOGPROBS


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 `a` in [0, 2**32) and a 32-bit constant `c`.

    Split into 16-bit halves so no int64 product overflows (signed overflow is not
    something to rely on): a*c = a_lo*c + (a_hi*c_lo mod 2**16) * 2**16   (mod 2**32).
    """
    lo = (a & 0xFFFF) * c
    hi = (((a >> 16) * (c & 0xFFFF)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply, "lowbias32" constants); a bijection with
    good avalanche. x must hold values in [0, 2**32), so >> is a logical shift."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Uniform fp32 in the open interval (0, 1), a pure function of (seed, counter) (int64)."""
    seed = seed.long()
    counter = counter.long()
    # & keeps the two's-complement low 32 bits also for negative seeds
    x = _mix32((seed & _MASK32) ^ 0x9E3779B9)
    x = _mix32(x ^ ((seed >> 32) & _MASK32))
    x = _mix32(x ^ (counter & _MASK32))
    x = _mix32(x ^ ((counter >> 32) & _MASK32) ^ 0x85EBCA6B)
    # 23 bits -> (k + 0.5) / 2**23: exactly representable in fp32, never 0 or 1
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


class SamplingTensors:
    """Per-row sampling settings [N] of one sample() call: a tensor per RlSampling field of the
    declaration (ringleader.ipc.sampling_params.RING_FIELDS: temperature, top_p, top_k, min_p,
    the penalties, seed), read as attributes; `counter`, the index of the token within its
    request (the RNG's); `token_counts`, the token counts the penalties read (ipc/layout.py's
    token_counts rows: output count, plus PROMPT_MARK on prompt tokens): a table [S, V] whose
    row `slot[i]` is row i's (slot None: row i's is row i), or None where no row can have a
    penalty; `grammar` and `mask_at`, structured output's (mask_disallowed): the automata's int32
    words and each row's mask offset in them (-1: no constraint), or None where no row can have
    one; `end_ids` (int [E], the model's end-of-sequence ids) and `stop_ids` (int [N, S], each
    row's stop_token_ids, -1 for none), the ids a row below its min_tokens cannot draw
    (mask_ends), or None where no row can be below it.  Any device and integer/float width;
    sample() converts.  A field not given holds its declared default (so it does nothing)."""

    def __init__(
        self,
        counter: torch.Tensor,
        token_counts: torch.Tensor | None = None,
        slot: torch.Tensor | None = None,
        *,
        grammar: torch.Tensor | None = None,
        mask_at: torch.Tensor | None = None,
        end_ids: torch.Tensor | None = None,
        stop_ids: torch.Tensor | None = None,
        **values: torch.Tensor,
    ):
        unknown = sorted(set(values) - set(RING_NAMES))
        if unknown:
            raise TypeError(
                f"SamplingTensors: unknown field {unknown[0]!r} (fields: {', '.join(RING_NAMES)})"
            )
        self.counter, self.token_counts, self.slot = counter, token_counts, slot
        self.grammar, self.mask_at = (grammar, mask_at) if mask_at is not None else (None, None)
        self.end_ids, self.stop_ids = end_ids, stop_ids
        self.values = {
            name: values[name]
            if name in values
            else torch.full_like(counter, FIELD[name].ring_default, dtype=RING_DTYPES[kind])
            for name, kind in RING_FIELDS
        }

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def replace(self, **values: torch.Tensor) -> SamplingTensors:
        """These settings with some fields' tensors replaced (the masks' too: grammar, mask_at,
        end_ids, stop_ids, each None to drop it)."""
        masks = dict(grammar=self.grammar, mask_at=self.mask_at, end_ids=self.end_ids, stop_ids=self.stop_ids)
        masks.update((name, values.pop(name)) for name in list(masks) if name in values)
        return SamplingTensors(
            self.counter, self.token_counts, self.slot, **masks, **{**self.values, **values}
        )

    def unconstrained(self) -> SamplingTensors:
        """These settings without structured output's masks (no row has a constraint)."""
        return self.replace(grammar=None, mask_at=None)

    def without_min_tokens(self) -> SamplingTensors:
        """These settings without min_tokens' end ids (no row is below its min_tokens)."""
        return self.replace(end_ids=None, stop_ids=None)

    def any_constrained(self) -> bool:
        """Whether some row has a constraint; a host read (the eager step's, of host memory)."""
        return self.mask_at is not None and bool((self.mask_at >= 0).any())

    def any_below_min_tokens(self) -> bool:
        """Whether some row is below its min_tokens (and end ids are known); a host read, as above."""
        return self.has_ends() and bool((self.counter.long() < self.values["min_tokens"].long()).any())

    def has_ends(self) -> bool:
        """Whether these settings carry end ids for min_tokens (end_ids or stop_ids)."""
        return self.end_ids is not None or self.stop_ids is not None

    def row_counts(self) -> torch.Tensor:
        """Each row's token counts [N, V] (a gather when they come as a table and slots)."""
        counts = self.token_counts
        assert counts is not None
        if self.slot is None:
            return counts
        return counts.index_select(0, self.slot.to(counts.device).long().clamp(0, counts.shape[0] - 1))


def any_penalty(params: SamplingTensors) -> bool:
    """Whether some row has a penalty field (the declaration's penalty=True) off its default.
    Reads the values on the host: for the eager step, whose tensors are host memory."""
    return any(bool((getattr(params, name) != FIELD[name].default).any()) for name in PENALTY_NAMES)


def apply_penalties(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """fp32 logits [N, V] with each row's penalties applied (vLLM's definitions), from its
    token_counts row; the logits as they are when params.token_counts is None.

    repetition_penalty r, on every token of the prompt or the output: a positive logit / r, any
    other * r. Then frequency_penalty f and presence_penalty p, on the output's tokens:
    logit -= f * count, logit -= p * (count > 0). Neutral values (r 1, f 0, p 0) return the
    logits exactly, whatever the row's counts hold (x * 1, x / 1 and x - 0 * c are x).
    """
    logits = logits.float()
    if params.token_counts is None:
        return logits
    dev = logits.device
    counts = params.row_counts().to(dev)
    repetition = params.repetition_penalty.to(dev, torch.float32)[:, None]
    frequency = params.frequency_penalty.to(dev, torch.float32)[:, None]
    presence = params.presence_penalty.to(dev, torch.float32)[:, None]
    # a count below PROMPT_MARK is exact in fp32, so f * count is vLLM's product
    output_count = (counts & (PROMPT_MARK - 1)).float()
    in_prompt_or_output = counts != 0
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(in_prompt_or_output, repeated, logits)
    return logits - frequency * output_count - presence * (output_count > 0).float()


def mask_disallowed(logits: torch.Tensor, grammar: torch.Tensor, mask_at: torch.Tensor) -> torch.Tensor:
    """fp32 logits [N, V] with -inf where row i's constraint allows no token: for mask_at[i] >= 0,
    token t is allowed when bit t & 31 of grammar[mask_at[i] + (t >> 5)] is set (ipc/automaton.py's
    bitmasks); a row with mask_at[i] < 0 is left as it is.  Static shapes, no host sync."""
    n, vocab = logits.shape
    dev = logits.device
    words_per_row = (vocab + 31) // 32
    if dev.type == "cpu" and grammar.device.type == "cpu":  # the eager step: numpy unpacks bits faster
        return logits.masked_fill(
            ~_allowed_on_host(grammar.numpy(), mask_at.numpy(), words_per_row, vocab), float("-inf")
        )
    at = mask_at.to(dev, torch.int64)
    grammar = grammar.to(dev)
    # a stale row's offset may be anything: every index stays inside the array
    index = (at.clamp(min=0)[:, None] + torch.arange(words_per_row, device=dev)).clamp(
        max=grammar.numel() - 1
    )
    words = grammar[index].to(torch.int32)
    bits = (words[:, :, None] >> torch.arange(32, device=dev, dtype=torch.int32)) & 1
    allowed = bits.reshape(n, words_per_row * 32)[:, :vocab].bool() | (at < 0)[:, None]
    return logits.masked_fill(~allowed, float("-inf"))


def _allowed_on_host(grammar, mask_at, words_per_row: int, vocab: int) -> torch.Tensor:
    """mask_disallowed's allowed tokens [N, V] (bool) from host arrays, a row at a time."""
    allowed = np.ones((len(mask_at), words_per_row * 32), dtype=bool)
    for i, at in enumerate(mask_at.tolist()):
        if at >= 0:
            if at + words_per_row <= len(grammar):
                words = grammar[at : at + words_per_row]
            else:  # a stale offset: every index clamped into the array, as the tensor form does
                words = grammar[np.minimum(at + np.arange(words_per_row), len(grammar) - 1)]
            allowed[i] = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")
    return torch.from_numpy(allowed[:, :vocab])


def mask_ends(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """fp32 logits [N, V] with -inf at row i's end ids (params.end_ids, the model's, and its
    stop_ids row, -1 entries ignored) where its counter is below its min_tokens; the other rows,
    and every other token, as they are.  A new tensor; static shapes, no host sync."""
    n, vocab = logits.shape
    dev = logits.device
    ids = []
    if params.end_ids is not None:
        ids.append(params.end_ids.to(dev, torch.int64).reshape(1, -1).expand(n, -1))
    if params.stop_ids is not None:
        ids.append(params.stop_ids.to(dev, torch.int64).reshape(n, -1))
    if not ids:
        return logits
    index = torch.cat(ids, dim=1)
    below = params.counter.to(dev, torch.int64) < params.min_tokens.to(dev, torch.int64)
    banned = below[:, None] & (index >= 0) & (index < vocab)
    # +inf leaves a token as it was (amin), so ids that are not banned may point anywhere in range
    fill = torch.full(index.shape, float("inf"), dtype=logits.dtype, device=dev)
    fill.masked_fill_(banned, float("-inf"))
    return logits.scatter_reduce(1, index.clamp(0, vocab - 1), fill, reduce="amin")


def apply_masks(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """`logits` with what params' masks keep out at -inf: structured output's (mask_disallowed)
    where params carry them, then min_tokens' end ids (mask_ends) where they carry those."""
    if params.mask_at is not None:
        logits = mask_disallowed(logits, params.grammar, params.mask_at)
    if params.has_ends():
        logits = mask_ends(logits, params)
    return logits


def penalize_and_scale(logits: torch.Tensor, params: SamplingTensors, divisor: torch.Tensor) -> torch.Tensor:
    """A new fp32 tensor [N, V]: apply_penalties(logits, params), row i divided by divisor[i]
    (fp32 [N]), then params' masks (apply_masks: a row's constraint, its end ids below its
    min_tokens) at -inf; `logits` is left as it was."""
    return apply_masks(apply_penalties(logits, params) / divisor[:, None], params)


def sample(
    logits: torch.Tensor,
    params: SamplingTensors,
    uniform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = counter_uniform,
    valid: torch.Tensor | None = None,
    scale: Callable[[torch.Tensor, SamplingTensors, torch.Tensor], torch.Tensor] = penalize_and_scale,
) -> torch.Tensor:
    """Sampled token ids [N] (int64) from fp32 logits [N, V], row i under params' row i.

    Per row: the penalties (apply_penalties) first, then a constraint's mask (mask_disallowed:
    what it does not allow can never be drawn, in any mode) and, below its min_tokens, its end
    ids' (mask_ends); temperature <= 0 -> argmax of those.
    Otherwise logits / temperature; drop the tokens whose probability is below min_p x the top
    token's (0 = no limit); keep the top_k largest of the rest (0 or -1 = no limit); then the
    smallest prefix whose probability, renormalised over what is kept so far, reaches top_p
    (>= 1.0 = no limit; the top token is always kept); renormalise and draw with the uniform
    counter_uniform(seed, counter) (`uniform`: the same function, e.g. its one-launch Triton
    form). `valid` (bool [N], optional): rows where it is False take the argmax, whatever their
    parameters hold (a stale row's garbage stays in its row: every step is row-wise, and no
    index it makes leaves its bounds). `scale`: penalize_and_scale, or its one-launch Triton
    form; either writes a new tensor, so `logits` comes out as it went in (the raw logits
    token_logprobs reads). See the module docstring for the candidate bound.
    """
    N, V = logits.shape
    dev = logits.device
    temperature = params.temperature.to(dev, torch.float32)
    top_p = params.top_p.to(dev, torch.float32)[:, None]
    top_k = params.top_k.to(dev, torch.int64)[:, None]
    # the declaration bounds min_p to [0, 1]: the top token (relative 1) always stays
    min_p = params.min_p.to(dev, torch.float32)[:, None]
    greedy = temperature <= 0
    if valid is not None:
        greedy = greedy | ~valid.to(dev)
    # greedy rows divide by 1 (x / 1 is x): their argmax below is that of the penalized logits
    divisor = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = scale(logits, params, divisor)
    # contiguous: the step layout's fields are strided views, and a kernel form of `uniform`
    # (triton_sampling) reads its inputs as dense arrays; a uint64 seed as its int64 bits
    seed = params.seed.to(dev, torch.int64).contiguous()
    counter = params.counter.to(dev).contiguous()
    target = uniform(seed, counter)[:, None]  # in (0, 1)

    # the whole distribution, unnormalised (p_i / p_max), in vocabulary order, less what min_p
    # drops: the unrestricted rows' draw, and its total is the mass top_p measures against
    # when top_k is off
    row_max = scaled.amax(-1, keepdim=True)
    relative = torch.exp(scaled - row_max)
    below_min_p = relative < min_p
    cum_all = relative.masked_fill(below_min_p, 0.0).cumsum(dim=-1)
    from_vocab = (cum_all < target * cum_all[:, -1:]).sum(dim=-1).clamp_(max=V - 1)

    # the K most likely tokens, in descending order: the support of every restricted draw
    K = min(V, MAX_TOP_K)
    cand_vals, cand_idx = torch.topk(scaled, K, dim=-1)
    rank = torch.arange(K, device=dev)[None, :]
    # the vocabulary's own min_p verdict, so both draws keep the same tokens to the last ulp
    kept = ~below_min_p.gather(1, cand_idx) & ((top_k <= 0) | (rank < top_k))
    cand_vals = cand_vals.masked_fill(~kept, float("-inf"))
    # top_p measures mass over the kept candidates, or over the whole min_p-kept vocabulary
    # when top_k is off
    log_total = torch.where(top_k > 0, cand_vals.logsumexp(-1, keepdim=True), row_max + cum_all[:, -1:].log())
    probs = torch.exp(cand_vals - log_total)
    cum = probs.cumsum(dim=-1)
    # keep an entry if the mass strictly before it is still below top_p
    in_top_p = ((cum - probs) < top_p) | (top_p >= 1.0) | (rank == 0)
    cum = (probs * in_top_p).cumsum(dim=-1)
    pos = (cum < target * cum[:, -1:]).sum(dim=-1, keepdim=True).clamp_(max=K - 1)
    from_candidates = cand_idx.gather(1, pos).squeeze(1)

    unrestricted = ((top_k <= 0) & (top_p >= 1.0)).squeeze(1)
    drawn = torch.where(unrestricted, from_vocab, from_candidates)
    return torch.where(greedy, scaled.argmax(dim=-1), drawn)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: torch.Tensor) -> torch.Tensor:
    """Each row's RlLogprobs record, int32 [N, LOGPROBS_WORDS], from raw logits [N, V] (fp32),
    the sampled tokens [N] and how many alternatives each row asked for, top_n [N].

    logprob: log_softmax(logits)[i, tokens[i]]; n_top: top_n clamped to [0, min(MAX_LOGPROBS, V)];
    top_ids / top_logprobs: the min(MAX_LOGPROBS, V) most likely tokens, in descending order,
    and their logprobs, whatever n_top says (padded with id 0, logprob -inf, when V is smaller).
    Every row is computed (a row with top_n < 0 too): static shapes and no host sync, so it can
    be captured.
    """
    logits = logits.float()
    vocab = logits.shape[1]
    dev = logits.device
    log_total = logits.logsumexp(-1, keepdim=True)
    token = tokens.to(dev, torch.int64).clamp(0, vocab - 1)[:, None]
    chosen = logits.gather(1, token) - log_total
    k = min(MAX_LOGPROBS, vocab)
    top_values, top_ids = torch.topk(logits, k, dim=-1)
    top_logprobs = top_values - log_total
    if k < MAX_LOGPROBS:
        top_ids = torch.nn.functional.pad(top_ids, (0, MAX_LOGPROBS - k), value=0)
        top_logprobs = torch.nn.functional.pad(top_logprobs, (0, MAX_LOGPROBS - k), value=float("-inf"))
    n_top = top_n.to(dev, torch.int32).clamp(0, k)[:, None]
    words = (chosen.view(torch.int32), n_top, top_ids.to(torch.int32), top_logprobs.view(torch.int32))
    return torch.cat(words, dim=1)


def store_logprobs(
    table: torch.Tensor,
    slot: torch.Tensor,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    top_n: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> None:
    """Writes row i's token_logprobs record into table[slot[i]] (int32 [S, LOGPROBS_WORDS], the
    step's step_logprobs) for every row i with top_n[i] >= 0 and valid[i] (bool [N], optional);
    the other slots' records stay as they were. Slots are clamped into [0, S). No host sync."""
    n_slots = table.shape[0]
    dev = table.device
    records = token_logprobs(logits, tokens, top_n).to(dev)
    asked = top_n.to(dev) >= 0
    if valid is not None:
        asked = asked & valid.to(dev)
    # rows that asked nothing are scattered into a sink row past the table (no boolean indexing)
    target = torch.where(asked, slot.to(dev, torch.int64).clamp(0, n_slots - 1), n_slots)
    with_sink = torch.cat([table, table.new_zeros(1, table.shape[1])])
    with_sink.index_copy_(0, target, records)
    table.copy_(with_sink[:n_slots])
