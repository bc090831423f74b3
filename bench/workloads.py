"""What the benchmark sends: prompt and output lengths, prompt tokens, and arrival times.

Everything is drawn from numpy Generators seeded by `--seed`, one independent stream per
purpose (lengths, prompt tokens, arrival gaps), so changing the arrival process does not change
the prompts and the same seed always gives the same requests.

Length distributions (`--length-dist`), each around the requested mean length L:
- fixed:    every request has exactly L tokens.
- uniform:  integers uniform in [L*(1-r), L*(1+r)] with r = `range_ratio` (default 0.5).
- longtail: log-normal with sigma 1.0, scaled so the untruncated mean is L, clipped to
            [1, 8*L]. Most requests are shorter than L, a few are much longer (median ~0.6 L).

Prompt tokens are uniform over an id range [lo, hi) (`WorkloadConfig.prompt_id_range`): 3..255 for
the byte tokenizer of the presets (PRESET_PROMPT_IDS, the default), and for a model with a real
vocabulary (a .gguf file, a checkpoint directory with a tokenizer) its longest run of ordinary
ids, i.e. between special tokens and below the vocabulary size (`prompt_id_range_for(spec)`), so a
prompt never holds BOS/EOS/chat-control tokens and never an id the embedding lacks.

Shared prefixes (`--shared-prefix-len N --prefix-groups G`, WorkloadConfig.shared_prefix_len and
prefix_groups): G distinct prefixes of N random tokens, drawn from their own stream (a fourth
child of the seed's SeedSequence, and within it a `prefix_salt`, so each run of a benchmark can
get fresh ones); request i's prompt is the prefix of group i % G (round robin, so every group is
seen within the first G requests) followed by its own suffix, which is the prompt the options above
make without prefixes (the same lengths and tokens). The groups' first tokens are all different
(when the id range has G ids), so no two groups share a cached token; a suffix that repeats an
earlier one of its group has its last token redrawn until it does not (while that can succeed).
With max_context, the suffix gives way first (down to 1 token), then the output; the prefix is
never cut. A prefix cache that has seen a group's prefix can skip N of its N + suffix tokens:
expected_prefix_hit_rate gives that rate, and the one over the run with each group's first
request a full miss.

The copy-heavy workload (`--workload copy`; `random` is the default above): chat requests
whose answer mostly repeats text of their own prompt, as prompt-lookup (n-gram) speculative
decoding expects. Each asks for one of the passages of bench/data/passages.json (twelve original
paragraphs of 113-130 words) to be repeated exactly, quoted word for word, or rewritten with its
spelling corrected (the passage then has a few adjacent letters swapped: COPY_TASKS). Which
passage, which task and which typos come from a fifth child stream of the seed (COPY_STREAM): a
shuffled order of the passages, drawn anew each cycle, so every passage is seen within the first
P requests. The prompt is the user message rendered by the model's chat template (a model
without one, e.g. a preset's byte tokenizer, gets it as plain text); `max_tokens` is the
passage's own token count (the passage encoded alone, no special tokens: about the length of a
faithful answer), capped by `output_cap` and cut to fit max_context (the prompt is never cut;
a prompt that leaves no room is an error). The prompt-length options do not apply to it.

Arrivals for the open loop (`--request-rate R --burstiness B`): gaps between consecutive
requests are Gamma(shape=B, scale=1/(R*B)), whose mean is 1/R for every B. B = 1 is a Poisson
process; B < 1 is burstier, B > 1 more regular. R = inf sends every request at time 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LENGTH_DISTS = ("fixed", "uniform", "longtail")
LONGTAIL_SIGMA = 1.0
LONGTAIL_CAP = 8.0  # longtail lengths are clipped to this many times the mean
# The presets' prompt tokens are drawn from [FIRST_PROMPT_ID, LAST_PROMPT_ID): plain bytes for
# their byte tokenizer (ids >= 256 hold its BOS/EOS/PAD, so EOS never appears in a prompt). A real
# vocabulary gets its own range (prompt_id_range_for): its low ids are often control tokens.
FIRST_PROMPT_ID = 3
LAST_PROMPT_ID = 256
PRESET_PROMPT_IDS = (FIRST_PROMPT_ID, LAST_PROMPT_ID)
PREFIX_STREAM = 3  # the seed's child streams: 0 lengths, 1 prompt tokens, 2 arrivals, 3 shared prefixes
PREFIX_GROUPING = "round robin: request i uses group i % G"
WORKLOADS = ("random", "copy")  # --workload: random prompt ids (the lengths above), or copy-heavy
COPY_STREAM = 4  # the seed's fifth child stream: the copy workload's passages, tasks and typos
PASSAGES_FILE = Path(__file__).resolve().parent / "data" / "passages.json"
# the copy workload's requests: each puts its passage after one of these instructions; "spelling"
# gets the passage with typos (swapped letters) and is answered by the passage as written
COPY_TASKS = {
    "repeat": "Repeat the following passage exactly, word for word, and add nothing else:\n\n{text}",
    "quote": "Quote the following passage in full, word for word, inside double quotation marks:\n\n{text}",
    "spelling": "Rewrite the following text, correcting only its spelling. Change nothing else:\n\n{text}",
}
TYPO_EVERY = 12  # spelling: about one word in this many (of 4+ letters) gets two letters swapped


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: its prompt token ids and how many tokens to ask for."""

    prompt_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class WorkloadConfig:
    requests: int
    input_len: int
    output_len: int
    length_dist: str = "fixed"
    range_ratio: float = 0.5
    seed: int = 0
    max_context: int | None = None  # prompt + output are trimmed to fit (the server's limit)
    prompt_id_range: tuple[int, int] = PRESET_PROMPT_IDS  # prompt tokens are drawn from [lo, hi)
    shared_prefix_len: int = 0  # > 0: each prompt is its group's prefix of this many tokens + its own
    prefix_groups: int = 1  # distinct shared prefixes; request i uses group i % prefix_groups
    prefix_salt: int = 0  # another salt, other prefixes (same seed, same suffixes)

    def describe(self) -> dict:
        return {
            "requests": self.requests,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "length_dist": self.length_dist,
            "range_ratio": self.range_ratio,
            "seed": self.seed,
            "max_context": self.max_context,
            "prompt_id_range": list(self.prompt_id_range),
            "shared_prefix_len": self.shared_prefix_len,
            "prefix_groups": self.prefix_groups,
            "prefix_salt": self.prefix_salt,
        }


def sample_lengths(
    dist: str, mean: int, n: int, rng: np.random.Generator, range_ratio: float = 0.5
) -> np.ndarray:
    """n positive integer lengths around `mean` under distribution `dist` (see module doc)."""
    if mean < 1:
        raise ValueError(f"mean length must be >= 1, got {mean}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if dist == "fixed":
        return np.full(n, mean, dtype=np.int64)
    if dist == "uniform":
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
        lo = max(1, math.floor(mean * (1.0 - range_ratio)))
        hi = max(lo, math.ceil(mean * (1.0 + range_ratio)))
        return rng.integers(lo, hi + 1, size=n, dtype=np.int64)
    if dist == "longtail":
        mu = math.log(mean) - LONGTAIL_SIGMA**2 / 2.0
        draws = rng.lognormal(mu, LONGTAIL_SIGMA, size=n)
        cap = max(1, int(LONGTAIL_CAP * mean))
        return np.clip(np.rint(draws), 1, cap).astype(np.int64)
    raise ValueError(f"length distribution must be one of {LENGTH_DISTS}, got {dist!r}")


def make_requests(cfg: WorkloadConfig) -> list[RequestSpec]:
    """The workload's requests, reproducible from cfg.seed (and cfg.prefix_salt): with
    shared_prefix_len, add_shared_prefixes over the requests made without it."""
    root = np.random.SeedSequence(cfg.seed)
    len_seq, tok_seq = root.spawn(2)
    len_rng = np.random.default_rng(len_seq)
    tok_rng = np.random.default_rng(tok_seq)
    lo, hi = cfg.prompt_id_range
    if not 0 <= lo < hi:
        raise ValueError(f"prompt id range must be 0 <= lo < hi, got {cfg.prompt_id_range}")
    ins = sample_lengths(cfg.length_dist, cfg.input_len, cfg.requests, len_rng, cfg.range_ratio)
    outs = sample_lengths(cfg.length_dist, cfg.output_len, cfg.requests, len_rng, cfg.range_ratio)
    specs = []
    for n_in, n_out in zip(ins.tolist(), outs.tolist()):
        if cfg.max_context is not None:
            n_in, n_out = fit_context(n_in, n_out, cfg.max_context)
        prompt = tok_rng.integers(lo, hi, size=n_in).tolist()
        specs.append(RequestSpec(prompt_ids=prompt, max_tokens=n_out))
    if cfg.shared_prefix_len > 0:
        specs = add_shared_prefixes(
            specs,
            cfg.shared_prefix_len,
            cfg.prefix_groups,
            seed=cfg.seed,
            id_range=cfg.prompt_id_range,
            max_context=cfg.max_context,
            salt=cfg.prefix_salt,
        )
    return specs


def shared_prefixes(
    length: int, groups: int, seed: int = 0, id_range: tuple[int, int] = PRESET_PROMPT_IDS, salt: int = 0
) -> list[list[int]]:
    """`groups` prefixes of `length` token ids in [lo, hi), from the seed's prefix stream and
    `salt`; their first tokens differ whenever the range has `groups` ids."""
    if length < 1 or groups < 1:
        raise ValueError(f"shared prefixes need length >= 1 and groups >= 1, got {length}, {groups}")
    return _draw_prefixes(_prefix_rng(seed, salt), length, groups, id_range)


def _prefix_rng(seed: int, salt: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(PREFIX_STREAM, salt)))


def _draw_prefixes(
    rng: np.random.Generator, length: int, groups: int, id_range: tuple[int, int]
) -> list[list[int]]:
    lo, hi = id_range
    if not 0 <= lo < hi:
        raise ValueError(f"prompt id range must be 0 <= lo < hi, got {id_range}")
    firsts = rng.choice(np.arange(lo, hi), size=groups, replace=groups > hi - lo)
    rest = rng.integers(lo, hi, size=(groups, length - 1))
    return [[int(f), *row] for f, row in zip(firsts.tolist(), rest.tolist())]


def add_shared_prefixes(
    specs: list[RequestSpec],
    length: int,
    groups: int,
    *,
    seed: int = 0,
    id_range: tuple[int, int] = PRESET_PROMPT_IDS,
    max_context: int | None = None,
    salt: int = 0,
) -> list[RequestSpec]:
    """The requests with the prefix of group i % groups before prompt i (see module doc): the
    prompt becomes the suffix, cut to fit max_context with the prefix; a suffix equal to an
    earlier one of its group gets its last token redrawn."""
    if length < 1 or groups < 1:
        raise ValueError(f"shared prefixes need length >= 1 and groups >= 1, got {length}, {groups}")
    rng = _prefix_rng(seed, salt)  # the prefixes, then the redraws of repeated suffixes
    prefixes = _draw_prefixes(rng, length, groups, id_range)
    room = None
    if max_context is not None:
        room = max_context - length
        if room < 2:
            raise ValueError(
                f"a shared prefix of {length} tokens leaves no room for a prompt token and an output "
                f"token in a context of {max_context}"
            )
    lo, hi = id_range
    seen: list[set[tuple[int, ...]]] = [set() for _ in range(groups)]
    out = []
    for i, spec in enumerate(specs):
        suffix, n_out = list(spec.prompt_ids), spec.max_tokens
        if room is not None:
            n_in, n_out = fit_context(len(suffix), n_out, room)
            suffix = suffix[:n_in]
        group = i % groups
        for _ in range(4 * (hi - lo)):
            if tuple(suffix) not in seen[group]:
                break
            suffix[-1] = int(rng.integers(lo, hi))
        seen[group].add(tuple(suffix))
        out.append(RequestSpec(prompt_ids=prefixes[group] + suffix, max_tokens=n_out))
    return out


def expected_prefix_hit_rate(specs: list[RequestSpec], length: int, groups: int) -> dict:
    """The share of prompt tokens a prefix cache can skip in these requests (made by
    add_shared_prefixes): `steady` once every group's prefix was seen (length / mean prompt
    length), `cold` over the run with each group's first request a full miss. Token-exact: a
    cache that matches whole KV pages skips less (the prefix rounded down to a page). None for
    no requests or no shared prefix."""
    total = sum(len(s.prompt_ids) for s in specs)
    if not specs or length < 1 or total == 0:
        return {"steady": None, "cold": None}
    seen = min(len(specs), max(1, groups))
    return {"steady": len(specs) * length / total, "cold": (len(specs) - seen) * length / total}


def ordinary_id_range(vocab_size: int, special_ids) -> tuple[int, int]:
    """[lo, hi): the longest run of ids below vocab_size holding no special id (the first such
    run on a tie). SmolLM2 (controls 0..16 of 49152) gives (17, 49152); Llama-3 (specials from
    128000 of 128256) gives (0, 128000); Llama-2 (unk, bos, eos = 0, 1, 2) gives (3, 32000)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    cuts = sorted({i for i in special_ids if 0 <= i < vocab_size})
    best, start = (0, 0), 0
    for cut in [*cuts, vocab_size]:
        if cut - start > best[1] - best[0]:
            best = (start, cut)
        start = cut + 1
    if best[1] <= best[0]:
        raise ValueError(f"no ordinary token ids below {vocab_size}")
    return best


def prompt_id_range_for(spec: str) -> tuple[int, int]:
    """The prompt id range for a model spec as `ringleader serve --model` takes it: the presets'
    byte range, else the longest run of ordinary ids of its tokenizer's vocabulary (capped at
    the checkpoint's config vocab_size when it has one). A checkpoint without a tokenizer keeps
    the byte range (ordinary ids of any real vocabulary past the first few)."""
    from ringleader.device.model.presets import PRESETS, tokenizer_for

    if spec in PRESETS:
        return PRESET_PROMPT_IDS
    tokenizer = tokenizer_for(spec)
    if tokenizer is None:
        return PRESET_PROMPT_IDS
    vocab = int(tokenizer.vocab_size)
    config = Path(spec) / "config.json"
    if config.is_file():
        vocab = min(vocab, int(json.loads(config.read_text()).get("vocab_size") or vocab))
    return ordinary_id_range(vocab, tokenizer.special_token_ids())


def fit_context(n_in: int, n_out: int, max_context: int) -> tuple[int, int]:
    """Shrinks the prompt first (keeping at least 1 token), then the output, to fit max_context."""
    if max_context < 2:
        raise ValueError("max_context must be >= 2")
    if n_in + n_out <= max_context:
        return n_in, n_out
    n_in = max(1, max_context - n_out)
    n_out = min(n_out, max_context - n_in)
    return n_in, n_out


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times (seconds from the start, non-decreasing) of n requests of an open loop.

    The first request goes at t = 0 and each later one after a Gamma gap (see module doc).
    """
    if n <= 0:
        return np.zeros(0)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    return np.concatenate(([0.0], np.cumsum(gamma_gaps(n - 1, rate, burstiness, seed))))


def gamma_gaps(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """n inter-arrival gaps, Gamma(shape=burstiness, scale=1/(rate*burstiness)); mean 1/rate."""
    # a third child stream, so arrivals never share draws with lengths or prompt tokens
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[2])
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def parse_rate(text: str) -> float:
    """'4' -> 4.0, 'inf' -> inf; used for comma lists of --request-rate."""
    value = float(text)
    if math.isnan(value) or value <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {text!r}")
    return value


# ---------------------------------------------------------------- the copy-heavy workload


@dataclass(frozen=True)
class CopyChoice:
    """What one copy request asks: passage `passage` (its index) under task `task`; `text` is the
    passage as the prompt shows it (with typos for "spelling"), `message` the user message."""

    passage: int
    task: str
    text: str
    message: str


def load_passages(path: str | Path | None = None) -> list[str]:
    """The copy workload's passages (bench/data/passages.json, or the file at `path`)."""
    doc = json.loads(Path(path or PASSAGES_FILE).read_text(encoding="utf-8"))
    texts = [p["text"] if isinstance(p, dict) else p for p in doc["passages"]]
    if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise ValueError(f"{path or PASSAGES_FILE}: expected a non-empty list of passages")
    return texts


def add_typos(text: str, rng: np.random.Generator, every: int = TYPO_EVERY) -> str:
    """`text` with about one word in `every` of 4+ letters misspelt: two adjacent inner letters
    swapped (never two equal ones, so the word really changes); at least one when it can."""
    words = text.split(" ")
    candidates = [
        i for i, w in enumerate(words) if sum(c.isalpha() for c in w) >= 4 and _swappable(w) is not None
    ]
    if not candidates:
        return text
    n = max(1, round(len(candidates) / every))
    for i in sorted(rng.choice(candidates, size=min(n, len(candidates)), replace=False).tolist()):
        w = words[i]
        spots = _swappable(w) or []
        j = spots[int(rng.integers(len(spots)))]
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def _swappable(word: str) -> list[int] | None:
    """Positions j where word[j] and word[j + 1] are distinct letters inside the word (not its
    first letter), or None."""
    spots = [
        j
        for j in range(1, len(word) - 2)
        if word[j].isalpha() and word[j + 1].isalpha() and word[j] != word[j + 1]
    ]
    return spots or None


def copy_choices(
    n: int, seed: int = 0, passages: list[str] | None = None, tasks: tuple[str, ...] = tuple(COPY_TASKS)
) -> list[CopyChoice]:
    """The passages, tasks and typos of n copy requests, from the seed's copy stream: passages in
    a shuffled order drawn anew each cycle through them, a task uniform over `tasks`."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    unknown = [t for t in tasks if t not in COPY_TASKS]
    if unknown or not tasks:
        raise ValueError(f"copy tasks must be among {', '.join(COPY_TASKS)}, got {tasks}")
    passages = load_passages() if passages is None else passages
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(COPY_STREAM,)))
    order: list[int] = []
    out = []
    for _ in range(n):
        if not order:
            order = rng.permutation(len(passages)).tolist()
        index = order.pop(0)
        task = tasks[int(rng.integers(len(tasks)))]
        text = passages[index]
        if task == "spelling":
            text = add_typos(text, rng)
        out.append(CopyChoice(index, task, text, COPY_TASKS[task].format(text=text)))
    return out


def make_copy_requests(
    n: int,
    encode,
    count,
    *,
    seed: int = 0,
    max_context: int | None = None,
    output_cap: int | None = None,
    passages: list[str] | None = None,
    tasks: tuple[str, ...] = tuple(COPY_TASKS),
) -> list[RequestSpec]:
    """n copy requests (see module doc), reproducible from `seed`. `encode(message)`: the prompt
    ids of a user message (copy_encoder); `count(text)`: the token count of a text alone, which
    sets max_tokens (the passage as written, capped by output_cap, cut to fit max_context)."""
    passages = load_passages() if passages is None else passages
    lengths = [max(1, int(count(p))) for p in passages]
    specs = []
    for choice in copy_choices(n, seed, passages, tasks):
        prompt = [int(i) for i in encode(choice.message)]
        n_out = lengths[choice.passage]
        if output_cap is not None:
            n_out = min(n_out, output_cap)
        if max_context is not None:
            if len(prompt) >= max_context:
                raise ValueError(
                    f"the copy prompt of passage {choice.passage} ({choice.task}) has {len(prompt)} tokens, "
                    f"leaving no room for output in a context of {max_context} (--max-ctx)"
                )
            n_out = min(n_out, max_context - len(prompt))
        specs.append(RequestSpec(prompt_ids=prompt, max_tokens=max(1, n_out)))
    return specs


def copy_encoder(spec: str):
    """(encode, count, how) for a model spec as `ringleader serve --model` takes it: encode(message)
    gives the prompt ids of a one-message chat through the model's chat template (how = "chat"), or
    of the message as plain text when it has none (how = "plain": the presets' byte tokenizer);
    count(text) the token count of a text alone. ValueError for a model without a tokenizer."""
    from ringleader.device.model.presets import tokenizer_for

    tokenizer = tokenizer_for(spec)
    if tokenizer is None:
        raise ValueError(f"the copy workload needs a tokenizer; {spec} has none")

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    if getattr(tokenizer, "chat_template", None) is not None:
        return (lambda m: tokenizer.encode_chat([{"role": "user", "content": m}])), count, "chat"
    return (lambda m: tokenizer.encode(m)), count, "plain"
