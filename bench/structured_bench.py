"""Structured output's cost on the real model: enforcement, compile time and table bytes.

    python -m ringleader.bench.structured_bench --out DIR [--quick] [--model PATH.gguf]

One in-process server (the CPU backend, SmolLM2-135M-Instruct by default, 16 slots) and three parts:

1. Enforcement cost.  The same chat prompts, greedy, `ignore_eos` and a fixed max_tokens, so every
   request makes exactly max_tokens tokens, sent in arms: `none` (unconstrained), `json` (a JSON
   string, whose inside loops on one state) and `regex` (a pattern allowing any text, the mask's
   bare cost).  Interleaved rounds (each round runs every arm once, in an order rotated by one a
   round) at 1 stream and at 16 concurrent streams, quiet and beside a busy neighbour (one spin
   process, bench/interference.py).  Per arm: output tok/s (tokens over the arm's summed wall
   time), TPOT p50/p90 (bench/metrics.py: from the streamed chunks' arrival times), ms/step (a
   wave's wall time over the server's steps in it, median of the waves), and the arm's ratios to
   `none`: tok/s ratio (below 1 is a cost), TPOT p50 ratio (above 1 is a cost), and "paired",
   the median of each round's own tok/s ratio (robust to a shared machine's drift).  The compile
   cache is warm before timing.  "short" counts requests that ended before max_tokens (the model
   closed its JSON string; the prompts were chosen so it does not): their arm's tok/s is low.
2. Compile time and table bytes per constraint, the compiler called directly with the model's
   token bytes: cold (a fresh ConstraintCompiler each time: the first compile a server makes of
   a constraint), cached (the host's work for a request whose constraint is cached: the wire
   value read and the cache looked up), and the automaton's bytes, states, distinct masks and
   token classes (ipc/automaton.py).  A fresh compiler's first compile also builds its vocabulary
   (once a server): that is timed apart, as first_compile_ms, with a one-token choice.  Then the
   eager step's token choice alone (device/step/eager_step.py), where part 1's cost comes from
   on the CPU: the argmax of unconstrained greedy rows, the mask and argmax of constrained greedy
   rows, and sample() with the mask (the path of sampled rows, temperature > 0).
3. End to end: TTFT of the first request with a constraint the server has never seen (it waits
   for the compile) against a second one with the same constraint, and the same prompt
   unconstrained; each constraint gets a fresh `title`, so it is new to the server's cache.
   Beside them streams one unconstrained request, the bystander: its longest gap between
   tokens during each shows what a cold compile, a thread of the server's process, costs others.

Writes DIR/structured.json (everything, with the machine: CPU model and AVX2/AVX-512 VNNI/BF16
flags, torch threads, the commit) and DIR/structured.md (the tables, also printed).  `--quick`
is a smoke run with tiny counts (the tests run it).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ringleader.bench.interference import CpuInterference
from ringleader.bench.metrics import RequestRecord, summarize
from ringleader.bench.report import environment

# a JSON string's inside loops on one state, so it need not end before max_tokens
JSON_STRING = {"type": "string"}
# any text at all: the mask and the state's advance cost without narrowing the model's choice
ANY_TEXT = r"[\s\S]*"
ARMS = {"none": None, "json": {"json": JSON_STRING}, "regex": {"regex": ANY_TEXT}}

TOPICS = (
    "a dragon", "a lighthouse", "a lost robot", "a city under the sea", "a clockmaker", "a runaway balloon",
    "a forest fire", "a desert caravan", "a paper boat", "a chess prodigy", "a mountain rescue",
    "a pirate library", "a snow leopard", "a time-travelling cat", "an island volcano", "a jazz band",
)  # fmt: skip

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {
            "type": "object",
            "properties": {field: {"type": "string"} for field in ("street", "city", "zip")},
            "required": ["city"],
        },
        "phones": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[0-9 +-]{6,15}$"},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "address"],
}
ORDER = {
    "type": "object",
    "properties": {
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "total": {"type": "number"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                    "qty": {"type": "integer"},
                },
                "required": ["sku", "qty"],
            },
            "minItems": 1,
            "maxItems": 4,
        },
        "gift": {"type": "boolean"},
    },
    "required": ["status", "items"],
}
_COLOURS = ("red", "green", "blue", "amber", "violet", "grey", "white", "black", "teal", "gold")
_ANIMALS = ("fox", "owl", "bear", "wolf", "hare", "lynx", "crow", "seal", "moth", "newt")
# every constraint kind, small to large: what part 2 compiles
CONSTRAINTS: dict[str, dict] = {
    "json: nested person": {"json": PERSON},
    "json: order (array, enum, number, pattern)": {"json": ORDER},
    "json: string (the json arm)": {"json": JSON_STRING},
    "json_object": {"json_object": True},
    "regex: phone": {"regex": r"\(\d{3}\) \d{3}-\d{4}"},
    "regex: date": {"regex": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"},
    "regex: any text (the regex arm)": {"regex": ANY_TEXT},
    "choice of 3": {"choice": ["yes", "no", "maybe"]},
    "choice of 100": {"choice": [f"{c} {a}" for c in _COLOURS for a in _ANIMALS]},
}
TABLE_COUNTS = ("n_states", "n_masks", "n_classes", "n_exceptions")
# what warms a fresh compiler (its vocabulary) before a cold compile is timed
TRIVIAL = {"choice": ["ok"]}
QUICK_CONSTRAINTS = ("regex: date", "choice of 3", "json: string (the json arm)")
E2E_SCHEMAS = {"person": PERSON, "order": ORDER}
LABELS = ("cold", "cached", "none")
BYSTANDER_TOKENS = 768  # part 3's: outlasts the three requests it watches, aborted once they end


@dataclass
class Plan:
    rounds: int
    max_tokens: int
    streams: tuple[int, ...]
    neighbours: int
    single_stream_requests: int = 4  # one after another, per arm and round, at 1 stream
    cold_repeats: int = 3
    cached_calls: int = 5000
    e2e_repeats: int = 2
    sampler_calls: int = 200
    constraints: tuple[str, ...] = tuple(CONSTRAINTS)


def plan_for(args: argparse.Namespace) -> Plan:
    full = Plan(args.rounds, args.max_tokens, (1, args.slots), args.neighbours)
    if not args.quick:
        return full
    # a few seconds: one round of 8 tokens at 1 and 4 streams, the small constraints
    return dataclasses.replace(
        full,
        rounds=1,
        max_tokens=8,
        streams=(1, 4),
        single_stream_requests=1,
        cold_repeats=1,
        cached_calls=200,
        e2e_repeats=1,
        sampler_calls=5,
        constraints=QUICK_CONSTRAINTS,
    )


# ---------------------------------------------------------------- 1. enforcement


def _story(i: int) -> list[dict[str, str]]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Write a long story about {topic}, as one JSON string."}]


def _one_request(client, i: int, structured: dict | None, max_tokens: int, rec=None, held=None):
    """rec: the record to fill (another thread reads its chunk times); held: gets the stream."""
    rec = rec or RequestRecord(i, 0, max_tokens)
    rec.send_t = time.perf_counter()
    stream = client.generate(
        messages=_story(i), structured=structured, max_tokens=max_tokens, ignore_eos=True, temperature=0.0
    )
    if held is not None:
        held.append(stream)  # another thread may abort it
    for chunk in stream:
        rec.chunk_t.append(time.perf_counter())
        rec.chunk_n.append(len(chunk.token_ids))
    done = stream.done
    rec.done_t = time.perf_counter()
    rec.finish_reason, rec.completion_tokens = done.finish_reason, done.completion_tokens
    rec.error_code, rec.error_message = done.error_code, done.error_message
    return rec


def run_wave(client, structured: dict | None, streams: int, n: int, max_tokens: int) -> list[RequestRecord]:
    """n requests, `streams` in flight at once (one thread each)."""
    records: list[RequestRecord | None] = [None] * n
    indices = iter(range(n))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(indices, None)
            if i is None:
                return
            records[i] = _one_request(client, i, structured, max_tokens)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(streams, n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in records if r is not None]


def _steps(client) -> int:
    return int(client.stats()["device"]["steps"])


def _wave_figures(records: list[RequestRecord], steps: int) -> dict:
    ok = [r for r in records if r.ok]
    wall = max(r.done_t for r in ok) - min(r.send_t for r in ok) if ok else 0.0
    tokens = sum(r.output_tokens for r in ok)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "failed": len(records) - len(ok),
        "tok_per_s": tokens / wall if wall > 0 else None,
        "steps": steps,
        # the wave's wall time over its steps: the step's cost as the server paid it, all in
        "ms_per_step": 1e3 * wall / steps if steps else None,
    }


def enforcement(client, plan: Plan, condition: str) -> list[dict]:
    """Rows (streams, arm) of one condition: every arm once a round, the order rotated a round."""
    rows = []
    arms = list(ARMS)
    for streams in plan.streams:
        n = plan.single_stream_requests if streams == 1 else streams
        waves: dict[str, list[dict]] = {arm: [] for arm in arms}
        records: dict[str, list[RequestRecord]] = {arm: [] for arm in arms}
        for r in range(plan.rounds):
            for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                steps_before = _steps(client)
                wave = run_wave(client, ARMS[arm], streams, n, plan.max_tokens)
                waves[arm].append(_wave_figures(wave, _steps(client) - steps_before))
                records[arm].extend(wave)
        base = _arm_row(condition, streams, "none", waves["none"], records["none"], plan.max_tokens)
        for arm in arms:
            row = _arm_row(condition, streams, arm, waves[arm], records[arm], plan.max_tokens)
            row["tok_per_s_ratio"] = _ratio(row["tok_per_s"], base["tok_per_s"])
            row["tpot_p50_ratio"] = _ratio(row["tpot_ms"]["p50"], base["tpot_ms"]["p50"])
            paired = [_ratio(w["tok_per_s"], b["tok_per_s"]) for w, b in zip(waves[arm], waves["none"])]
            row["tok_per_s_ratio_paired"] = _median([p for p in paired if p is not None])
            rows.append(row)
    return rows


def _arm_row(condition, streams, arm, waves, records, max_tokens) -> dict:
    wall = sum(w["wall_s"] for w in waves)
    tokens = sum(w["tokens"] for w in waves)
    return {
        "condition": condition,
        "streams": streams,
        "arm": arm,
        "structured": ARMS[arm],
        "requests": len(records),
        "failed": sum(w["failed"] for w in waves),
        "short": sum(1 for r in records if r.ok and r.completion_tokens < max_tokens),
        "output_tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall if wall > 0 else None,
        "tpot_ms": summarize((r.tpot() for r in records if r.ok), 1e3),
        "ttft_ms": summarize((r.ttft() for r in records if r.ok), 1e3),
        "ms_per_step": _median([w["ms_per_step"] for w in waves]),
        "waves": waves,
    }


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------- 2. compile time and bytes


def compile_table(model, max_words: int, plan: Plan) -> list[dict]:
    """Per constraint: cold compile (a fresh compiler each time), cached lookup, automaton size.
    model: the server's ModelInfo (its tokenizer, EOS ids and logits' width)."""
    from ringleader.device.text.token_bytes import token_bytes
    from ringleader.hostctl.serving.constraint_compiler import ConstraintCompiler
    from ringleader.ipc.structured import structured_from_wire

    vocabulary = token_bytes(model.tokenizer)
    rows = []
    for name in plan.constraints:
        wire = CONSTRAINTS[name]
        cold, setup = [], []
        for _ in range(plan.cold_repeats):
            compiler = ConstraintCompiler(
                vocabulary, model.eos_token_ids, model.vocab_size, max_words=max_words
            )
            # a compiler's first compile also builds its outlines vocabulary: paid apart, once a server
            t0 = time.perf_counter()
            compiler.compile(structured_from_wire(TRIVIAL))
            setup.append(time.perf_counter() - t0)
            spec = structured_from_wire(wire)
            t0 = time.perf_counter()
            automaton = compiler.compile(spec)
            cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(plan.cached_calls):
            hit = compiler.cached(structured_from_wire(wire))
        cached_s = (time.perf_counter() - t0) / plan.cached_calls
        assert hit is not None, f"{name}: not cached after its compile"
        rows.append(
            {
                "constraint": name,
                "structured": wire,
                "cold_ms": [1e3 * s for s in cold],
                "cold_ms_median": 1e3 * statistics.median(cold),
                "first_compile_ms": [1e3 * s for s in setup],
                "cached_us": 1e6 * cached_s,
                "nbytes": automaton.nbytes,
                # the table's shape, as the automaton format of the day counts it
                **{k: getattr(automaton, k) for k in TABLE_COUNTS if hasattr(automaton, k)},
                "compiler_stats": dict(getattr(compiler, "stats", None) or {}),
            }
        )
    return rows


def sampler_cost(model, rows: tuple[int, ...], calls: int) -> list[dict]:
    """The eager step's token choice alone, on fp32 logits [rows, vocab], in µs per step: the
    argmax (unconstrained greedy rows), the json arm's mask and the argmax (constrained greedy
    rows), and sample() with the mask (constrained sampled rows; greedy ones here take argmax)."""
    import torch

    from ringleader.device.sampling.sampler import SamplingTensors, sample
    from ringleader.device.text.token_bytes import token_bytes
    from ringleader.hostctl.serving.constraint_compiler import ConstraintCompiler
    from ringleader.ipc.automaton import Walker
    from ringleader.ipc.structured import structured_from_wire

    compiler = ConstraintCompiler(
        token_bytes(model.tokenizer), model.eos_token_ids, model.vocab_size, max_words=1 << 24
    )
    words = compiler.compile(structured_from_wire(ARMS["json"])).words
    grammar = torch.from_numpy(words.copy())
    offset = Walker(words).mask_offset(Walker(words).initial)
    out = []
    for n in rows:
        logits = torch.randn(n, model.vocab_size)
        mask_at = torch.full((n,), offset, dtype=torch.int32)
        params = SamplingTensors(
            torch.zeros(n, dtype=torch.int64), grammar=grammar, mask_at=mask_at, temperature=torch.zeros(n)
        )
        row = {
            "rows": n,
            "argmax_us": _median_us(calls, torch.argmax, logits, -1),
            "mask_argmax_us": _median_us(calls, _masked_argmax, logits, grammar, mask_at),
            "sample_masked_us": _median_us(calls, sample, logits, params),
        }
        out.append(row)
    return out


def _masked_argmax(logits, grammar, mask_at):
    from ringleader.device.sampling.sampler import mask_disallowed

    return mask_disallowed(logits, grammar, mask_at).argmax(dim=-1)


def _median_us(calls: int, fn, *args) -> float:
    fn(*args)  # torch's first call of each op, untimed
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


# ---------------------------------------------------------------- 3. end to end


def first_vs_cached(client, plan: Plan) -> list[dict]:
    """TTFT of a constraint new to the server, the same again, and no constraint (two tokens),
    beside one unconstrained stream (the bystander): its longest gap between tokens during each
    (a cold compile runs on a thread of the server's process, and shares its GIL)."""
    rows = []
    for name, schema in E2E_SCHEMAS.items():
        for k in range(plan.e2e_repeats):
            titled = {"json": {**schema, "title": f"bench-{name}-{time.time_ns()}-{k}"}}
            row: dict = {"schema": name, "repeat": k}
            bystander, held = RequestRecord(k + 1, 0, BYSTANDER_TOKENS), []
            args = (client, k + 1, None, BYSTANDER_TOKENS, bystander, held)
            thread = threading.Thread(target=_one_request, args=args)
            thread.start()
            while len(bystander.chunk_t) < 4 and thread.is_alive():  # it streams before we ask
                time.sleep(0.005)
            windows = {}
            for label, structured in zip(LABELS, (titled, titled, None)):
                rec = _one_request(client, k, structured, 2)
                if not rec.ok:
                    raise RuntimeError(f"{name} ({label}): {rec.error_code} {rec.error_message}")
                row[f"ttft_{label}_ms"] = 1e3 * (rec.ttft() or float("nan"))
                windows[label] = (rec.send_t, rec.done_t)
            if held:
                held[0].abort()  # its tokens past the windows are not read
            thread.join()
            times = bystander.token_times()
            for label, (start, end) in windows.items():
                gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
                row[f"bystander_gap_{label}_ms"] = 1e3 * max(gaps) if gaps else None
            rows.append(row)
    return rows


# ---------------------------------------------------------------- the run and its report


def machine(backend) -> dict:
    import torch

    env = environment()
    env["loadavg_at_start"] = env.pop("loadavg_at_end", None)
    flags = env.get("cpu_flags") or {}
    have, lacks = [k for k, v in flags.items() if v], [k for k, v in flags.items() if not v]
    cpu = f"{env.get('cpu_model')} with {', '.join(have) or 'none of the flags'}"
    return {
        **env,
        "cpu": cpu + (f", without {', '.join(lacks)}" if lacks else ""),
        "torch_threads": torch.get_num_threads(),
        "backend": dict(backend.description),
    }


def run(args: argparse.Namespace) -> dict:
    from ringleader.device.backends.cpu import CpuBackend
    from ringleader.hostctl.serving.background_server import BackgroundServer
    from ringleader.hostctl.serving.server import Server
    from ringleader.ipc.client import Client

    plan = plan_for(args)
    slots = max(plan.streams)
    backend = CpuBackend(
        args.model, n_slots=slots, max_ctx=args.max_ctx, token_budget=args.token_budget, threads=args.threads
    )
    doc: dict = {
        "command": [sys.executable, "-m", "ringleader.bench.structured_bench", *sys.argv[1:]],
        "plan": dataclasses.asdict(plan),
        "model": Path(args.model).name,
        "server": {"n_slots": slots, "max_ctx": args.max_ctx, "token_budget": args.token_budget},
        "machine": machine(backend),
    }
    with BackgroundServer(Server(backend, "tcp://127.0.0.1:0", drain_timeout_s=0.5)) as bg:
        doc["compile"] = compile_table(backend.model, backend.rings.grammar.capacity_words, plan)
        doc["sampler_cost"] = sampler_cost(backend.model, plan.streams, plan.sampler_calls)
        with Client(bg.address, timeout=600) as client:
            for structured in ARMS.values():  # the compile cache and torch's first calls warm
                run_wave(client, structured, slots, slots, plan.max_tokens)
            doc["enforcement"], doc["neighbour"] = enforcement(client, plan, "quiet"), None
            if plan.neighbours:
                with CpuInterference(plan.neighbours) as busy:
                    doc["enforcement"] += enforcement(client, plan, f"busy ({plan.neighbours} spinning)")
                doc["neighbour"] = busy.describe()
            doc["first_request"] = first_vs_cached(client, plan)
            doc["server_structured_stats"] = client.stats().get("structured")
    doc["machine"]["loadavg_at_end"] = environment().get("loadavg_at_end")
    return doc


def _loads(values) -> str:
    return " ".join(f"{v:.1f}" for v in values) if values else "-"


def _f(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [
        "# Structured output: enforcement cost, compile time, table bytes",
        "",
        f"Machine: {m['cpu']}, {m.get('cpu_count')} CPUs, torch {m.get('torch')} with "
        f"{m['torch_threads']} threads; Python {m.get('python')}; load average "
        f"{_loads(m.get('loadavg_at_start'))} at the start, {_loads(m.get('loadavg_at_end'))} at the end; commit "
        f"{(m.get('git') or {}).get('commit') or '-'}{' (dirty tree)' if (m.get('git') or {}).get('dirty') else ''}.",
        f"Model {doc['model']}, {doc['server']['n_slots']} slots, max_ctx {doc['server']['max_ctx']}, "
        f"token budget {doc['server']['token_budget']}; max_tokens {doc['plan']['max_tokens']} with "
        f"ignore_eos, greedy; {doc['plan']['rounds']} interleaved rounds.",
        "",
        "## Enforcement cost (ratios to `none`: tok/s below 1 and TPOT above 1 are a cost)",
        "",
        "| condition | streams | arm | tok/s | TPOT p50 ms | TPOT p90 ms | tok/s ratio | paired | TPOT p50 ratio "
        "| ms/step | short |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["enforcement"]:
        lines.append(
            f"| {r['condition']} | {r['streams']} | {r['arm']} | {_f(r['tok_per_s'])} | {_f(r['tpot_ms']['p50'], '.2f')} "
            f"| {_f(r['tpot_ms']['p90'], '.2f')} | {_f(r['tok_per_s_ratio'], '.3f')} | {_f(r['tok_per_s_ratio_paired'], '.3f')} "
            f"| {_f(r['tpot_p50_ratio'], '.3f')} | {_f(r['ms_per_step'], '.2f')} "
            f"| {r['short']}/{r['requests']} |"
        )
    if doc.get("neighbour"):
        nb = doc["neighbour"]
        lines.append(
            f"\nBusy neighbour: {nb['busy_processes']} spin process(es), {_f(nb['busy_cpu_s'])} CPU-s over "
            f"{_f(nb['busy_wall_s'])} s."
        )
    counts = [k for k in TABLE_COUNTS if k in doc["compile"][0]]
    lines += [
        "",
        "## Compile time and table bytes (the compiler alone, the model's vocabulary)",
        "",
        "| constraint | cold ms (median) | cached µs | bytes | "
        + " | ".join(k.removeprefix("n_") for k in counts)
        + " |",
        "|---|---:|---:|---:|" + "---:|" * len(counts),
    ]
    for r in doc["compile"]:
        lines.append(
            f"| {r['constraint']} | {_f(r['cold_ms_median'])} | {_f(r['cached_us'], '.1f')} | {r['nbytes']:,} | "
            + " | ".join(f"{r[k]:,}" for k in counts)
            + " |"
        )
    firsts = [ms for r in doc["compile"] for ms in r["first_compile_ms"]]
    lines.append(
        f"\nA fresh compiler's first compile (its vocabulary built, once a server): median "
        f"{_f(_median(firsts))} ms, max {_f(max(firsts))} ms."
    )
    lines += [
        "",
        "## The step's token choice alone (fp32 logits [rows, vocab], µs p50 per step)",
        "",
        "| rows | argmax (unconstrained greedy) | mask + argmax (constrained greedy) | sample() with the mask |",
        "|---:|---:|---:|---:|",
        *(
            f"| {r['rows']} | {_f(r['argmax_us'])} | {_f(r['mask_argmax_us'])} | {_f(r['sample_masked_us'])} |"
            for r in doc["sampler_cost"]
        ),
        "",
        "## First request with a new schema vs the same again, beside one unconstrained stream (ms)",
        "",
        "| schema | repeat | TTFT: cold | cached | none | bystander's longest gap: cold | cached | none |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["first_request"]:
        lines.append(
            f"| {r['schema']} | {r['repeat']} | "
            + " | ".join(
                _f(r[f"{kind}_{label}_ms"]) for kind in ("ttft", "bystander_gap") for label in LABELS
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ringleader.bench.structured_bench", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--out", required=True, type=Path, help="folder for structured.json and .md")
    p.add_argument("--quick", action="store_true", help="a smoke run of tiny counts")
    p.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens every request makes (default 64)")
    p.add_argument("--slots", type=int, default=16, help="slots, and the streams at once (default 16)")
    p.add_argument("--max-ctx", type=int, default=1024)
    p.add_argument("--token-budget", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--neighbours", type=int, default=1, help="busy processes in the busy pass (default 1)")
    args = p.parse_args(argv)
    if args.model is None:
        from ringleader.bench import smollm2

        args.model = str(smollm2.smollm2_path())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    text = markdown(doc)
    (args.out / "structured.md").write_text(text)
    print(text)
    failed = sum(r["failed"] for r in doc["enforcement"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
