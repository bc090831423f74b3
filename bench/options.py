"""The options of `ringleader bench`: their defaults, their argument types, and the checks that
look across several of them (bench/cli.py builds the parser from these)."""

from __future__ import annotations

import argparse

from ringleader.bench import servers as S
from ringleader.bench.load_plan import load_points
from ringleader.bench.workloads import parse_rate
from ringleader.device.engine_config import EngineConfig
from ringleader.device.null.null_options import NULL_MODEL
from ringleader.hostctl.serving.config import ServerConfig

DEFAULT_COMPARE = "device,host,static"
# with --shared-prefix-len and no --compare: the server's default placement only (its two arms)
DEFAULT_PREFIX_COMPARE = {"cuda": "device", "cpu": "host"}
ENGINE_DEFAULTS = EngineConfig()  # what a server started without the option uses: its engine
SERVER_DEFAULTS = ServerConfig()  # and its server
# the server's default --max-ctx on a CPU; the workload keeps to it on CUDA too, where the
# server's default is the longest context that fits in memory (known only once it runs)
DEFAULT_MAX_CTX = ENGINE_DEFAULTS.resolved("cpu").max_ctx


def int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def busy_list(text: str) -> list[int]:
    """--cpu-interference: busy-process counts, each run beside a quiet run (`1,2`: 0, 1 and 2)."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"--cpu-interference must be >= 0, got {text!r}")
    return vals


def count_list(text: str) -> int | list[int]:
    """--requests: one count (an int, for every load point) or a comma list (one per point)."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or a comma list, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"expected an integer or a comma list, got {text!r}")
    return vals[0] if len(vals) == 1 else vals


def rate_list(text: str) -> list[float]:
    try:
        return [parse_rate(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# `ringleader bench --model null`: the runtime's own cost through every client, at 1 and 256
# streams (each stream its own slot); each applies only when its option was not given
NULL_MODEL_DEFAULTS = {"compare": ["clients"], "concurrency": [1, 256], "slots": 256}
NULL_MODEL_REQUESTS = [256, 2048]  # at the default loads: 256 in a row, 8 rounds of 256


class DefaultCount(int):
    """A default left as it is (an int argparse leaves untyped), told from a value the user gave:
    --requests' (apply_model_defaults) and --output-len's (the copy workload's cap)."""


DEFAULT_REQUESTS = DefaultCount(48)
DEFAULT_OUTPUT_LEN = DefaultCount(32)


def copy_output_cap(args) -> int | None:
    """The copy workload's cap on max_tokens: --output-len when given, else None (each request's
    max_tokens is its passage's token count)."""
    return None if isinstance(args.output_len, DefaultCount) else int(args.output_len)


def apply_model_defaults(args) -> None:
    """Fills the options left unset (None) by the model's defaults: NULL_MODEL_DEFAULTS for
    --model null, and --requests left at its default NULL_MODEL_REQUESTS at the null model's
    default loads."""
    null = args.model == NULL_MODEL
    default_loads = args.concurrency is None and args.request_rate is None
    if null:
        for name, value in NULL_MODEL_DEFAULTS.items():
            if getattr(args, name) is None and not (name == "concurrency" and not default_loads):
                setattr(args, name, value)
    if isinstance(args.requests, DefaultCount) and null and default_loads:
        args.requests = list(NULL_MODEL_REQUESTS)


def check_options(args) -> list[str]:
    """What is wrong with the parsed options, one message each; raises ValueError on an --http URL
    that is not http(s) or an unknown --compare variant."""
    out = []
    counts = args.requests if isinstance(args.requests, list) else [args.requests]
    if any(n < 1 for n in counts):
        out.append("--requests must be >= 1")
    if len(counts) > 1 and len(counts) != len(load_points(args)):
        out.append(
            f"--requests has {len(counts)} counts for {len(load_points(args))} load points "
            "(--concurrency values, then --request-rate values)"
        )
    if args.input_len < 1 or args.output_len < 1:
        out.append("--input-len and --output-len must be >= 1")
    if args.burstiness <= 0:
        out.append("--burstiness must be > 0")
    if args.warmup < 0:
        out.append("--warmup must be >= 0")
    out += _prefix_problems(args)
    if getattr(args, "workload", "random") == "copy" and args.shared_prefix_len > 0:
        out.append("--shared-prefix-len goes with the random workload, not --workload copy")
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
        from ringleader.bench.http_loadgen import base_url

        base_url(args.http)  # raises ValueError on a URL that is not http(s)
    if args.compare is not None:
        S.plan_variants(args.compare, "cuda")  # raises on unknown names
        if "clients" in args.compare and args.request_rate:
            out.append("--compare clients runs closed loop only: give --concurrency, not --request-rate")
    if args.c_bench and "clients" not in (args.compare or []):
        out.append("--c-bench goes with --compare clients")
    return out


def prefix_groups(args) -> int:
    """--prefix-groups, 1 when not given."""
    return 1 if args.prefix_groups is None else args.prefix_groups


def _prefix_problems(args) -> list[str]:
    """What is wrong with --shared-prefix-len and --prefix-groups."""
    out = []
    if args.shared_prefix_len < 0:
        out.append("--shared-prefix-len must be >= 0")
    if args.prefix_groups is not None and args.prefix_groups < 1:
        out.append("--prefix-groups must be >= 1")
    if args.prefix_groups is not None and args.shared_prefix_len <= 0:
        out.append("--prefix-groups goes with --shared-prefix-len")
    if args.shared_prefix_len > 0:
        max_ctx = args.max_ctx or DEFAULT_MAX_CTX
        if args.shared_prefix_len > max_ctx - 2:
            out.append(
                f"--shared-prefix-len {args.shared_prefix_len} leaves no room in a context of {max_ctx} "
                "(--max-ctx) for a prompt token and an output token after the prefix"
            )
        if "gateway" in (args.compare or []):
            out.append(
                "--shared-prefix-len does not go with --compare gateway (its native and gateway passes "
                "would share one server's cache)"
            )
    return out
