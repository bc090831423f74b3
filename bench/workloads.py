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
    """The workload's requests, reproducible from cfg.seed."""
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
    return specs


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
