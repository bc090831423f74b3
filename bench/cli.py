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

`--model null` (no weights, no arithmetic: `serve --model null`) measures the runtime's own cost:
by default `--compare clients` at concurrency 1 and 256 with 256 slots, every load point run
through the C client, the bundled sync and async Python clients, the raw pyzmq generator and the
HTTP gateway, and a table of what each costs (client_costs in the JSON). Its options go to the
server with --server-arg (--null-step-us, --null-step-wait, --null-vocab, --null-pattern).

`--workload copy` sends chat requests whose answers mostly repeat their prompts (repeat, quote or
spell-correct a shipped passage), prompt-lookup speculative decoding's case; where a server
counts speculative drafts (its `stats`), each run reports their acceptance rate.

`--shared-prefix-len N` puts one of `--prefix-groups G` shared prefixes before every prompt, and
runs each server variant (default: device on CUDA, host on a CPU) twice, as two servers started
one after the other: `<variant>/prefix-on` (serve --prefix-caching) and `<variant>/prefix-off`
(serve --no-prefix-caching), with a table of the two (TTFT, throughput, the server's prefix-cache
hit rate, and the ratios).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from ringleader.bench import servers as S
from ringleader.bench.options import (
    DEFAULT_COMPARE,
    DEFAULT_MAX_CTX,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_REQUESTS,
    ENGINE_DEFAULTS,
    SERVER_DEFAULTS,
    apply_model_defaults,
    busy_list,
    check_options,
    count_list,
    int_list,
    name_list,
    rate_list,
)
from ringleader.bench.output import Console
from ringleader.bench.report import save_json
from ringleader.bench.run_driver import run_bench
from ringleader.bench.workloads import LENGTH_DISTS, WORKLOADS
from ringleader.device.engine_config import DEVICES, LAUNCHES

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
        type=name_list,
        default=None,
        help=f"variants to run, of device, host, static, hf, gateway, clients (default {DEFAULT_COMPARE}; "
        "with --model null: clients); a server "
        "variant may add :WEIGHTS (host:quantized, host:fp32: serve --weights, side by side); hf = "
        "transformers' continuous batching (generate_batch's engine) in this process; gateway = one "
        "server with its OpenAI HTTP gateway (serve --http), each load point measured over ZeroMQ "
        "(native) and over HTTP (gateway), with the gateway's overhead; clients = one such server, "
        "each load point through the C client, the bundled sync and async Python clients, the raw "
        "pyzmq generator and the HTTP gateway, side by side (closed loop)",
    )
    g.add_argument(
        "--c-bench",
        metavar="PATH",
        help="with --compare clients: the C client's ringleader-c-bench (default: clients/c/build/ of "
        "this checkout, built with make when missing)",
    )
    g.add_argument(
        "--model",
        default=ENGINE_DEFAULTS.model,
        help="preset, checkpoint directory or .gguf file (default %(default)s)",
    )
    g.add_argument("--device", default=ENGINE_DEFAULTS.device, choices=DEVICES)
    g.add_argument(
        "--launch",
        choices=LAUNCHES,
        help=f"CUDA launch mode of the device scheduler (the server's default: {ENGINE_DEFAULTS.launch}); "
        "the mode that ran is in each run's backend.launch",
    )
    g.add_argument(
        "--slots",
        type=int,
        help=f"server batch slots (server default {ENGINE_DEFAULTS.n_slots}; with --model null 256)",
    )
    g.add_argument(
        "--max-ctx",
        type=int,
        help=f"server longest context of one request (server default {DEFAULT_MAX_CTX})",
    )
    g.add_argument(
        "--token-budget",
        type=int,
        help=f"server max token rows per step (server default {ENGINE_DEFAULTS.token_budget})",
    )
    g.add_argument("--threads", type=int, help="server torch CPU threads")
    g.add_argument(
        "--max-queue", type=int, help=f"server host queue bound (server default {SERVER_DEFAULTS.max_queued})"
    )
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
        type=int_list,
        help="closed loop: requests in flight, comma list sweeps "
        "(default 1,16 when no --request-rate is given; 1,256 with --model null)",
    )
    g.add_argument(
        "--request-rate", type=rate_list, help="open loop: requests/s (inf: all at once), comma list sweeps"
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma inter-arrival gaps; 1.0 = Poisson, lower = burstier",
    )
    g.add_argument(
        "--requests",
        type=count_list,
        default=DEFAULT_REQUESTS,
        help="measured requests per run (default 48; with --model null 256,2048 at its default loads); a comma list gives one per load point, "
        "in the order of --concurrency then --request-rate (e.g. --concurrency 1,8,32 --requests 8,24,64)",
    )
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="random: prompts of random token ids (the length options below); copy: chat requests "
        "to repeat, quote or spell-correct a passage shipped with the bench (bench/data/passages.json), "
        "whose output mostly repeats the prompt (prompt-lookup speculative decoding's case); max_tokens "
        "= the passage's token count, capped by --output-len when given; needs --model's tokenizer "
        "(default random)",
    )
    g.add_argument("--input-len", type=int, default=32, help="mean prompt length in tokens (default 32)")
    g.add_argument(
        "--output-len",
        type=int,
        default=DEFAULT_OUTPUT_LEN,
        help="mean max_tokens (default 32); with --workload copy a cap on max_tokens (default none)",
    )
    g.add_argument("--length-dist", choices=LENGTH_DISTS, default="fixed")
    g.add_argument("--range-ratio", type=float, default=0.5, help="uniform: lengths in L*(1 +- ratio)")
    g.add_argument("--seed", type=int, default=0, help="workload seed (lengths, prompts, arrivals)")
    g.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        metavar="N",
        help="put a shared prefix of N random tokens before every prompt (the prompt-length options "
        "then make the suffix); with servers started here, run each variant twice, serve "
        "--prefix-caching and --no-prefix-caching, and compare them (default 0: no prefix)",
    )
    g.add_argument(
        "--prefix-groups",
        type=int,
        default=None,
        metavar="G",
        help="with --shared-prefix-len: G distinct prefixes, request i uses prefix i %% G (default 1)",
    )
    g.add_argument(
        "--prefix-off-first",
        action="store_true",
        help="with --shared-prefix-len: run each variant's prefix-off arm before its prefix-on arm "
        "(the arms run in turn; swapping them between two runs shows the order's own drift)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (no EOS stop)")
    g.add_argument(
        "--http-prompt-text",
        action="store_true",
        help="with --http: send each prompt as text, decoded from its ids by --model's tokenizer, "
        "for servers that take no token ids (llama.cpp's); the server re-tokenizes it",
    )
    g.add_argument(
        "--http-min-tokens",
        action="store_true",
        help="with --http and --ignore-eos: send min_tokens = max_tokens too, for servers without "
        "ignore_eos (llama-cpp-python's; ringleader's gateway refuses the field)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default greedy)")
    g.add_argument("--warmup", type=int, default=4, help="warm-up requests before each run, not measured")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take before it is cut")
    g.add_argument(
        "--cpu-interference",
        type=busy_list,
        default=[],
        metavar="N[,N...]",
        help="also run each point beside N busy processes (a comma list: each count in turn) and "
        "report what each keeps of the quiet run",
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv or list(QUICK_ARGS)
    args = build_parser().parse_args(command)
    apply_model_defaults(args)
    say = Console(args.quiet)
    try:
        problems = check_options(args)
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
        return run_bench(args, command, say)
    except S.ServerError as exc:
        print(f"ringleader bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ringleader bench: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _roofline(args, say: Console) -> int:
    from ringleader.bench import roofline

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


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
