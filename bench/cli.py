"""`ringleader bench`: drive servers over the wire protocol and report what they cost.

With no arguments it runs the quick comparison of the README (QUICK_ARGS): the tiny preset on
the best device here, device vs host vs static scheduling (host vs static on a CPU), closed loop
at concurrency 1 and 16, written under ./ringleader-bench/.

For every variant of `--compare` (or the one server at `--connect`, or the OpenAI-compatible
endpoint at `--http`), for every load point (each `--concurrency`, then each
`--request-rate`), and with `--cpu-interference N` once without and once with N busy
processes, one run: a few warm-up requests, the server's stats, the measured requests, the
stats again. The `gateway` variant runs each point twice against one server: over ZeroMQ
(`native`) and through its HTTP gateway (`gateway`), and reports the difference.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path

from bench import servers as S
from bench.interference import CpuInterference
from bench.loadgen import Load, SendOptions, measure
from bench.report import (
    build_document,
    format_degradation,
    format_overhead,
    format_ratios,
    format_table,
    loadgen_warnings,
    make_run_entry,
    markdown_summary,
    run_label,
    save_json,
    write_json,
)
from bench.workloads import (
    LENGTH_DISTS,
    PRESET_PROMPT_IDS,
    WorkloadConfig,
    arrival_times,
    make_requests,
    parse_rate,
    prompt_id_range_for,
)
from device.engine_config import DEVICES, LAUNCHES, EngineConfig

QUICK_ARGS = [
    "--concurrency",
    "1,16",
    "--requests",
    "48",
    "--input-len",
    "32",
    "--output-len",
    "32",
    "--ignore-eos",
    "--out",
    "ringleader-bench",
]
DEFAULT_COMPARE = "device,host,static"
SERVER_DEFAULTS = EngineConfig()  # what a server started without the option uses
# the server's default --max-ctx on a CPU; the workload keeps to it on CUDA too, where the
# server's default is the longest context that fits in memory (known only once it runs)
DEFAULT_MAX_CTX = SERVER_DEFAULTS.resolved("cpu").max_ctx


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _counts(text: str) -> int | list[int]:
    """--requests: one count (an int, for every load point) or a comma list (one per point)."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or a comma list, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"expected an integer or a comma list, got {text!r}")
    return vals[0] if len(vals) == 1 else vals


def _rates(text: str) -> list[float]:
    try:
        return [parse_rate(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringleader bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("servers")
    g.add_argument(
        "--connect", metavar="ADDR", help="benchmark the server at ADDR instead of starting servers"
    )
    g.add_argument(
        "--http",
        metavar="URL",
        help="benchmark the OpenAI-compatible endpoint at URL (streaming /v1/completions, e.g. "
        "http://127.0.0.1:8000) instead of starting servers",
    )
    g.add_argument(
        "--http-model",
        metavar="NAME",
        help="with --http: the `model` field to send (default: the first id of GET URL/v1/models)",
    )
    g.add_argument(
        "--label",
        help="with --connect: the scheduler name to report (default: from its stats); "
        "with --http: the name of its rows (default http)",
    )
    g.add_argument(
        "--compare",
        type=_names,
        default=None,
        help=f"variants to run, of device, host, static, hf, gateway (default {DEFAULT_COMPARE}); hf = "
        "transformers' continuous batching (generate_batch's engine) in this process; gateway = one "
        "server with its OpenAI HTTP gateway (serve --http), each load point measured over ZeroMQ "
        "(native) and over HTTP (gateway), with the gateway's overhead",
    )
    g.add_argument(
        "--model",
        default=SERVER_DEFAULTS.model,
        help="preset, checkpoint directory or .gguf file (default %(default)s)",
    )
    g.add_argument("--device", default=SERVER_DEFAULTS.device, choices=DEVICES)
    g.add_argument(
        "--launch",
        choices=LAUNCHES,
        help=f"CUDA launch mode of the device scheduler (the server's default: {SERVER_DEFAULTS.launch}); "
        "the mode that ran is in each run's backend.launch",
    )
    g.add_argument("--slots", type=int, help=f"server batch slots (server default {SERVER_DEFAULTS.n_slots})")
    g.add_argument(
        "--max-ctx", type=int, help=f"server KV tokens per slot (server default {DEFAULT_MAX_CTX})"
    )
    g.add_argument(
        "--token-budget",
        type=int,
        help=f"server max token rows per step (server default {SERVER_DEFAULTS.token_budget})",
    )
    g.add_argument("--threads", type=int, help="server torch CPU threads")
    g.add_argument("--max-queue", type=int, help="server host queue bound")
    g.add_argument("--weights-seed", type=int, help="seed of the preset's random weights (server --seed)")
    g.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `ringleader serve` (repeat for several)",
    )

    g = p.add_argument_group("workload")
    g.add_argument(
        "--concurrency",
        type=_ints,
        help="closed loop: requests in flight, comma list sweeps "
        "(default 1,16 when no --request-rate is given)",
    )
    g.add_argument(
        "--request-rate", type=_rates, help="open loop: requests/s (inf: all at once), comma list sweeps"
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma inter-arrival gaps; 1.0 = Poisson, lower = burstier",
    )
    g.add_argument(
        "--requests",
        type=_counts,
        default=48,
        help="measured requests per run (default 48); a comma list gives one per load point, "
        "in the order of --concurrency then --request-rate (e.g. --concurrency 1,8,32 --requests 8,24,64)",
    )
    g.add_argument("--input-len", type=int, default=32, help="mean prompt length in tokens (default 32)")
    g.add_argument("--output-len", type=int, default=32, help="mean max_tokens (default 32)")
    g.add_argument("--length-dist", choices=LENGTH_DISTS, default="fixed")
    g.add_argument("--range-ratio", type=float, default=0.5, help="uniform: lengths in L*(1 +- ratio)")
    g.add_argument("--seed", type=int, default=0, help="workload seed (lengths, prompts, arrivals)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (no EOS stop)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default greedy)")
    g.add_argument("--warmup", type=int, default=4, help="warm-up requests before each run, not measured")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take before it is cut")
    g.add_argument(
        "--cpu-interference",
        type=int,
        default=0,
        metavar="N",
        help="also run each point with N busy processes and report the degradation",
    )

    g.add_argument(
        "--roofline",
        action="store_true",
        help="instead of the load test: --model's decode step (1 and --slots rows, default 32, at "
        "context --max-ctx, default 512) against its memory roofline on --device (bench/roofline.py)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--out", metavar="DIR", help="write results.json, summary.md, console.txt and PNGs here")
    g.add_argument("--json", metavar="FILE", help="write the JSON here (default DIR/results.json)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--quiet", action="store_true", help="print only the final table")
    return p


class Console:
    """print() that also keeps the text for console.txt."""

    def __init__(self, quiet: bool):
        self.quiet, self.lines = quiet, []

    def __call__(self, text: str = "", *, always: bool = False) -> None:
        self.lines.append(text)
        if always or not self.quiet:
            print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv or list(QUICK_ARGS)
    args = build_parser().parse_args(command)
    say = Console(args.quiet)
    try:
        problems = _check(args)
    except ValueError as exc:
        problems = [str(exc)]
    if problems:
        for msg in problems:
            print(f"ringleader bench: {msg}", file=sys.stderr)
        return 2
    if args.roofline:
        return _roofline(args, say)
    previous = signal.signal(signal.SIGTERM, _raise_exit) if _main_thread() else None
    try:
        return _run(args, command, say)
    except S.ServerError as exc:
        print(f"ringleader bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ringleader bench: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _check(args) -> list[str]:
    out = []
    counts = args.requests if isinstance(args.requests, list) else [args.requests]
    if any(n < 1 for n in counts):
        out.append("--requests must be >= 1")
    if len(counts) > 1 and len(counts) != len(_load_points(args)):
        out.append(
            f"--requests has {len(counts)} counts for {len(_load_points(args))} load points "
            "(--concurrency values, then --request-rate values)"
        )
    if args.input_len < 1 or args.output_len < 1:
        out.append("--input-len and --output-len must be >= 1")
    if args.burstiness <= 0:
        out.append("--burstiness must be > 0")
    if args.cpu_interference < 0:
        out.append("--cpu-interference must be >= 0")
    if args.warmup < 0:
        out.append("--warmup must be >= 0")
    if args.connect and args.compare:
        out.append("--connect benchmarks one running server; --compare starts servers (choose one)")
    if args.http and (args.connect or args.compare):
        out.append(
            "--http benchmarks one running HTTP endpoint; --connect and --compare are other targets "
            "(choose one)"
        )
    if args.http_model and not args.http:
        out.append("--http-model goes with --http")
    if args.http:
        from bench.http_loadgen import base_url

        base_url(args.http)  # raises ValueError on a URL that is not http(s)
    if args.compare is not None:
        S.plan_variants(args.compare, "cuda")  # raises on unknown names
    return out


def _load_points(args) -> list[tuple[str, float]]:
    """("concurrency", c) for each --concurrency value, then ("rate", r) for each rate."""
    concurrency = args.concurrency if args.concurrency or args.request_rate else [1, 16]
    return [("concurrency", c) for c in concurrency or []] + [("rate", r) for r in args.request_rate or []]


def request_counts(args) -> list[int]:
    """Measured requests of each load point (--requests: one for all, or one each)."""
    n_points = len(_load_points(args))
    return list(args.requests) if isinstance(args.requests, list) else [args.requests] * n_points


def _loads(args) -> list[tuple[Load, int]]:
    out = []
    for (kind, value), n in zip(_load_points(args), request_counts(args)):
        if kind == "concurrency":
            out.append((Load(concurrency=value), n))
        else:
            times = arrival_times(n, value, args.burstiness, args.seed)
            out.append((Load(request_rate=value, arrival_s=times.tolist()), n))
    return out


def _run(args, command: list[str], say: Console) -> int:
    notes: list[str] = []
    max_ctx = args.max_ctx or DEFAULT_MAX_CTX
    try:
        id_range = prompt_id_range_for(args.model)
    except (OSError, ValueError, ImportError) as exc:
        print(f"ringleader bench: cannot read the vocabulary of {args.model}: {exc}", file=sys.stderr)
        return 2
    # one workload per request count, from the same seed (with fixed lengths a shorter one is a
    # prefix of a longer one)
    workloads: dict[int, list] = {}
    points = []
    for load, n in _loads(args):
        if n not in workloads:
            wl = WorkloadConfig(
                n,
                args.input_len,
                args.output_len,
                args.length_dist,
                args.range_ratio,
                args.seed,
                max_context=max_ctx,
                prompt_id_range=id_range,
            )
            workloads[n] = make_requests(wl)
        points.append((load, workloads[n]))
    warm = (
        make_requests(
            WorkloadConfig(
                args.warmup,
                min(args.input_len, 64),
                min(args.output_len, 16),
                "fixed",
                seed=args.seed + 1,
                max_context=max_ctx,
                prompt_id_range=id_range,
            )
        )
        if args.warmup
        else []
    )
    options = SendOptions(temperature=args.temperature, ignore_eos=args.ignore_eos, seed=args.seed)
    busy_levels = [0, args.cpu_interference] if args.cpu_interference else [0]

    requested = args.compare or _names(DEFAULT_COMPARE)
    if args.http:
        from bench.http_loadgen import list_models

        device, model = "?", args.http_model
        if model is None:
            try:
                served = list_models(args.http)
            except Exception as exc:
                print(
                    f"ringleader bench: cannot list the models at {args.http} ({exc}); give --http-model",
                    file=sys.stderr,
                )
                return 2
            if not served:
                print(
                    f"ringleader bench: {args.http}/v1/models lists no model; give --http-model",
                    file=sys.stderr,
                )
                return 2
            model = served[0]
        targets = [(args.label or "http", None)]
    elif args.connect:
        device, model = "?", args.model
        targets = [("connected", None)]
    else:
        device = S.resolve_device(args.device)
        variants, skipped = S.plan_variants(requested, device)
        for note in skipped:
            say(f"note: {note}", always=True)
        notes += skipped
        if not variants:
            print("ringleader bench: nothing to run on this device", file=sys.stderr)
            return 2
        model = args.model
        targets = [(v.name, v) for v in variants]
    if "hf" in [name for name, _ in targets]:
        notes.append(
            "hf: transformers' continuous batching (ContinuousBatchingManager, the engine of "
            "generate_batch) in the benchmark process, on the same prompt ids and output lengths; "
            "its CPU figure is the whole benchmark process (model, scheduling and load generation "
            "together) and loadgen CPU is not separable"
            + ("" if device == "cpu" else "; unverified on a GPU")
        )
    if id_range != PRESET_PROMPT_IDS:
        notes.append(
            f"prompt token ids drawn uniformly from [{id_range[0]}, {id_range[1]}): the model's "
            "longest run of ordinary ids (no BOS/EOS/control tokens)"
        )
    notes.append(
        "queue time comes from the server's done.timing.queue_ms; ttft_after_queue_ms is "
        "TTFT minus it (prefill + transport), decode_ms is E2E - TTFT"
    )
    if any(v is not None and v.kind == "gateway" for _, v in targets):
        notes.append(
            "gateway: one server started with its OpenAI-compatible HTTP gateway in the same process "
            "(serve --http); each load point runs twice against it, back to back: native = the ZeroMQ "
            "load generator, gateway = streaming POST /v1/completions through the gateway (aiohttp, "
            "SSE). The gateway rows' server CPU includes the gateway (same process). The two load "
            "generators do not cost the same CPU (HTTP, SSE framing and one JSON parse per chunk "
            "against a msgpack frame through zmq.asyncio and its I/O thread): compare their loadgen "
            "CPU per 1k tokens; on a CPU host both share the cores with the server, so part of a "
            "difference can be the client's"
        )
    if args.http:
        notes.append(
            f"http: {args.http}, streaming /v1/completions with the prompt as token ids, model "
            f"{model!r}; an HTTP endpoint has no stats, so server CPU and device figures are empty"
        )
    if not args.connect and not args.http and device == "cpu":
        notes.append(
            "CPU backend: the server's CPU time includes the model's compute, and the load "
            "generator shares the host's cores with the server"
        )
    say(
        f"ringleader bench: model {model}, device {device}, variants {', '.join(n for n, _ in targets)}; "
        f"{len(points)} load point(s) x {'/'.join(str(len(sp)) for _, sp in points)} requests, "
        f"prompt ids in [{id_range[0]}, {id_range[1]})"
        + (f", with and without {args.cpu_interference} busy processes" if args.cpu_interference else "")
    )

    runs: list[dict] = []
    t_start = time.perf_counter()
    loadavg_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    for name, variant in targets:
        runs += _run_target(args, name, variant, device, model, points, warm, options, busy_levels, say)
    notes += _token_count_notes(runs)
    if args.connect and runs:
        device = (runs[0].get("backend") or {}).get("device", "?")
        model = runs[0]["model"]
        for r in runs:
            r["device"] = device

    settings = dict(vars(args))
    settings.update(
        resolved_device=device,
        max_context=max_ctx,
        prompt_id_range=list(id_range),
        variants=[n for n, _ in targets],
        skipped=[]
        if args.connect or args.http
        else [n for n in requested if n not in [t[0] for t in targets]],
        elapsed_s=time.perf_counter() - t_start,
        host_loadavg_at_start=loadavg_start,
    )
    doc = build_document(
        command=command, settings=settings, model=model, device=device, runs=runs, notes=notes
    )
    say()
    say(format_table(runs), always=True)
    ratios = format_ratios(doc["ratios_vs_hf"])
    if ratios:
        say(ratios, always=True)
    overhead = format_overhead(doc["gateway_overhead"])
    if overhead:
        say(overhead, always=True)
    deg = format_degradation(doc["degradation"])
    if deg:
        say(deg, always=True)
    for w in loadgen_warnings(runs):
        say(w, always=True)
    _write_outputs(args, doc, say)
    bad = [r for r in runs if r["failed"] or r["completed"] < r["requests"]]
    return 1 if bad else 0


def _run_target(args, name, variant, device, model, points, warm, options, busy_levels, say) -> list[dict]:
    runs = []
    server = runner = None
    http_url = http_model = address = None
    try:
        if variant is None and args.http:
            http_url, http_model = args.http, model
        elif variant is None:
            address = args.connect
        elif variant.kind == "hf":
            from bench.hf_baseline import HfRunner, build_hf_model

            say(f"[{name}] building the transformers model ...")
            import torch

            if args.threads:  # as the servers get it
                torch.set_num_threads(args.threads)
            t0 = time.perf_counter()
            hf_model, _ = build_hf_model(args.model, device, args.weights_seed or 0)
            # the servers' batch limits and KV capacity (their defaults when not given; CUDA sizes
            # its KV from free memory, the workload keeps to DEFAULT_MAX_CTX), so both batch alike
            slots = args.slots or SERVER_DEFAULTS.n_slots
            budget = max(args.token_budget or SERVER_DEFAULTS.token_budget, slots)
            max_ctx = args.max_ctx or DEFAULT_MAX_CTX  # the context the workload keeps to
            runner = HfRunner(
                hf_model,
                slots=slots,
                token_budget=budget,
                kv_tokens=slots * max_ctx,
                options=options,
                timeout_s=args.timeout,
            )
            say(
                f"[{name}] transformers model up in {time.perf_counter() - t0:.1f} s: "
                f"{type(hf_model).__name__} {hf_model.dtype} on {device}, max_requests_per_batch "
                f"{slots}, max_batch_tokens {budget}, KV cache {slots} x {max_ctx} tokens, "
                f"torch threads {torch.get_num_threads()}, in this process"
            )
        else:
            opts = S.ServerOptions(
                model=args.model,
                device=device,
                launch=args.launch,
                slots=args.slots,
                max_ctx=args.max_ctx,
                token_budget=args.token_budget,
                threads=args.threads,
                weights_seed=args.weights_seed,
                max_queue=args.max_queue,
                extra=list(args.server_arg),
            )
            gateway = variant.kind == "gateway"
            server = S.ServerProcess(opts.args() + list(variant.server_args), http=gateway)
            t0 = time.perf_counter()
            address = server.start()
            launch = (server.stats().get("backend") or {}).get("launch")
            say(
                f"[{name}] server up at {address}"
                + (f" with its gateway at {server.http_url}" if gateway else "")
                + f" in {time.perf_counter() - t0:.1f} s"
                + (f", launch {launch}" if launch else "")
                + f": {' '.join(server.serve_args)}"
            )
            if gateway:
                from bench.http_loadgen import list_models

                http_url = server.http_url
                try:
                    http_model = (list_models(http_url) or [None])[0]
                except Exception as exc:
                    raise S.ServerError(f"the gateway at {http_url} did not list its models: {exc}") from exc
        # (label, how): the zmq load generator, the HTTP one, or both against one gateway server
        if runner is not None:
            passes = [(name, "hf")]
        elif variant is not None and variant.kind == "gateway":
            passes = [("native", "zmq"), ("gateway", "http")]
        elif http_url is not None:
            passes = [(name, "http")]
        else:
            passes = [(name if variant is not None else None, "zmq")]
        for load, specs in points:
            for busy in busy_levels:
                for label, how in passes:
                    with CpuInterference(busy) as spinners:
                        result = _measure_pass(
                            args, how, runner, address, http_url, http_model, specs, load, warm, options
                        )
                    after = result.stats_after
                    entry = make_run_entry(
                        scheduler=label or args.label or _label_from(after),
                        device=device,
                        model=after.get("model") or getattr(result, "model", None) or model,
                        load=load,
                        result=result,
                        burstiness=args.burstiness,
                        busy=spinners.describe(),
                        backend=after.get("backend"),
                    )
                    if how == "http":
                        entry["transport"] = "http"
                        entry["token_count"] = result.token_count
                    runs.append(entry)
                    _say_run(say, entry)
    finally:
        if server is not None:
            code = server.stop()
            if code not in (0, None, -signal.SIGTERM):
                say(f"[{name}] server exited with code {code}:\n{server.output_tail()}", always=True)
        if runner is not None:
            runner.close()
    return runs


def _measure_pass(args, how, runner, address, http_url, http_model, specs, load, warm, options):
    """One measured run: transformers in this process (hf), the ZeroMQ generator, or the HTTP one."""
    if how == "hf":
        return runner.measure(specs, load, warm)
    if how == "http":
        from bench.http_loadgen import measure_http

        return measure_http(
            http_url,
            specs,
            load,
            warmup=warm,
            options=options,
            timeout_s=args.timeout,
            model=http_model,
            stats_address=address,  # the ringleader server behind a gateway, else None
        )
    return measure(address, specs, load, warmup=warm, options=options, timeout_s=args.timeout)


def _say_run(say: Console, entry: dict) -> None:
    say(
        f"  {run_label(entry):<28} {entry['completed']}/{entry['requests']} ok, "
        f"{_fmt(entry['output_tokens_per_s'], '{:.0f}')} tok/s, "
        f"TTFT p50 {_fmt(entry['ttft_ms']['p50'], '{:.1f}')} ms, "
        f"TPOT p50 {_fmt(entry['tpot_ms']['p50'], '{:.2f}')} ms, "
        f"CPU {_fmt(entry['cpu_s_per_1k_tokens'], '{:.3f}')} s/1k tok, "
        f"loadgen {_fmt(entry['loadgen_cpu_s'], '{:.2f}')} s CPU in {entry['wall_s']:.1f} s"
    )
    if entry["failed"]:
        say(f"    failures: {entry['errors']}", always=True)


def _token_count_notes(runs: list[dict]) -> list[str]:
    """How the HTTP runs counted tokens per SSE chunk."""
    seen = {r.get("token_count") for r in runs if r.get("transport") == "http"} - {None}
    if not seen:
        return []
    from bench.http_loadgen import TEXT_CHUNKS, TOKEN_IDS

    out = []
    if any(TOKEN_IDS in c for c in seen):
        out.append(
            "http runs: the tokens of each SSE chunk are counted from choices[].token_ids "
            "(return_token_ids); completion_tokens from the final usage chunk"
        )
    if any(TEXT_CHUNKS in c for c in seen):
        out.append(
            "http runs: the server returned no token_ids (return_token_ids unsupported), so each "
            "non-empty text chunk counts as one token: a chunk carrying several tokens counts once, "
            "and TPOT/ITL are then per chunk (see token_count in each run)"
        )
    return out


def _label_from(stats: dict) -> str:
    backend = stats.get("backend") or {}
    if backend.get("policy") == "static":
        return "static"
    sched = str(backend.get("scheduler", "connected"))
    return "host" if sched.startswith("host") else sched


def _roofline(args, say: Console) -> int:
    from bench import roofline

    cuda = args.device == "cuda"
    result = roofline.measure(
        args.model,
        "cuda" if cuda else "cpu",
        "bfloat16" if cuda else "float32",
        rows_list=tuple(sorted({1, args.slots or 32})),
        ctx=args.max_ctx or 512,
        repeats=50 if cuda else 5,
        copy_bytes=(1 << 30) if cuda else (256 << 20),
    )
    say(roofline.format_table(result), always=True)
    json_path = Path(args.json) if args.json else (Path(args.out) / "roofline.json" if args.out else None)
    if json_path is not None:
        save_json(result, json_path)
        say(f"wrote {json_path}", always=True)
    return 0


def _write_outputs(args, doc: dict, say: Console) -> None:
    out_dir = Path(args.out) if args.out else None
    json_path = Path(args.json) if args.json else (out_dir / "results.json" if out_dir else None)
    if json_path is not None:
        write_json(doc, json_path)
        say(f"wrote {json_path}", always=True)
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: list[str] = []
    if not args.no_plots:
        try:
            from bench.plots import write_all

            plots = write_all(doc, out_dir)
        except ImportError as exc:  # matplotlib is an optional dependency (pip install .[bench])
            say(f"note: no plots ({exc}); install matplotlib", always=True)
    (out_dir / "summary.md").write_text(markdown_summary(doc, plots))
    say(f"wrote {out_dir / 'summary.md'}" + (f" and {len(plots)} plots" if plots else ""), always=True)
    (out_dir / "console.txt").write_text("\n".join(say.lines) + "\n")


def _fmt(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
