"""The load test of `ringleader bench`: start each target (a `ringleader serve` process, or
transformers in this process), measure every load point at every busy level against it, stop it;
then the results document, its tables and its files.

With --shared-prefix-len each server variant becomes its two arms, prefix caching on and off
(servers.prefix_arms), run one after the other like any two targets; and every pass (a load point
at a busy level) sends its requests behind shared prefixes of its own (SharedPrefix), the same
prompts to every target, so no pass finds another pass's prefixes in the cache."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ringleader.bench import servers as S
from ringleader.bench.client_loadgens import ClientUnavailable
from ringleader.bench.interference import CpuInterference
from ringleader.bench.load_plan import LoadPlan, plan_loads
from ringleader.bench.loadgen import SendOptions, measure
from ringleader.bench.options import (
    DEFAULT_COMPARE,
    DEFAULT_MAX_CTX,
    DEFAULT_PREFIX_COMPARE,
    ENGINE_DEFAULTS,
    copy_output_cap,
    name_list,
    prefix_groups,
)
from ringleader.bench.output import Console, say_results, say_run, write_outputs
from ringleader.bench.report import build_document, make_run_entry
from ringleader.bench.targets import TargetPlan, plan_targets, target_notes, token_count_notes
from ringleader.bench.workloads import (
    PREFIX_GROUPING,
    add_shared_prefixes,
    copy_encoder,
    expected_prefix_hit_rate,
    load_passages,
    make_copy_requests,
    prompt_id_range_for,
)

WARMUP_MAX_TOKENS = 16  # as load_plan's warm-up requests

# --compare clients: (label, how) of its passes at each load point, and the measure of each client
CLIENT_PASSES = (
    ("c", "c"),
    ("python-sync", "python-sync"),
    ("python-async", "python-async"),
    ("pyzmq-raw", "zmq"),
    ("http", "http"),
)
CLIENT_MEASURES = {
    "c": "measure_c",
    "python-sync": "measure_python_sync",
    "python-async": "measure_python_async",
}


@dataclass
class Endpoint:
    """Where one target's requests go: transformers in this process (runner), a ZeroMQ address
    (a server's, also the one behind a gateway, for its stats), an HTTP URL and its model."""

    runner: Any = None  # an HfRunner
    address: str | None = None
    http_url: str | None = None
    http_model: str | None = None


@dataclass
class SharedPrefix:
    """--shared-prefix-len and --prefix-groups: the requests of each pass (a load point at a busy
    level, numbered in the order run_target runs them) behind prefixes of their own (the pass
    number is their salt), the same lists for every target."""

    length: int
    groups: int
    seed: int
    id_range: tuple[int, int]
    max_ctx: int
    _made: dict = field(default_factory=dict)

    def specs(self, specs: list, salt: int) -> list:
        if salt not in self._made:
            self._made[salt] = add_shared_prefixes(
                specs,
                self.length,
                self.groups,
                seed=self.seed,
                id_range=self.id_range,
                max_context=self.max_ctx,
                salt=salt,
            )
        return self._made[salt]

    def expected(self, specs: list) -> dict:
        """{steady, cold}: the hit rates a prefix cache can reach on these (prefixed) requests."""
        return expected_prefix_hit_rate(specs, self.length, self.groups)


def shared_prefix(args, max_ctx: int, id_range: tuple[int, int]) -> SharedPrefix | None:
    if args.shared_prefix_len <= 0:
        return None
    return SharedPrefix(args.shared_prefix_len, prefix_groups(args), args.seed, id_range, max_ctx)


def run_bench(args, command: list[str], say: Console) -> int:
    """Every target at every load point, the tables, the files under --out. Returns 0, 1 when a
    run failed or completed fewer requests than it sent, or 2 when nothing could run."""
    max_ctx = args.max_ctx or DEFAULT_MAX_CTX
    try:
        id_range = prompt_id_range_for(args.model)
    except (OSError, ValueError, ImportError) as exc:
        print(f"ringleader bench: cannot read the vocabulary of {args.model}: {exc}", file=sys.stderr)
        return 2
    load_plan = plan_loads(args, max_ctx, id_range)
    copy_how = None
    if getattr(args, "workload", "random") == "copy":
        try:
            load_plan, copy_how = copy_plan(args, load_plan, max_ctx)
        except (OSError, ValueError, ImportError) as exc:
            print(f"ringleader bench: cannot make the copy workload: {exc}", file=sys.stderr)
            return 2
    prefix = shared_prefix(args, max_ctx, id_range)
    self_hosted = not args.connect and not args.http
    requested = args.compare or name_list(DEFAULT_COMPARE)
    if prefix is not None and self_hosted and not args.compare:  # the default placement's two arms
        requested = [DEFAULT_PREFIX_COMPARE[S.resolve_device(args.device)]]
    target_plan = plan_targets(args, requested, say)
    if target_plan is None:
        return 2
    planned = target_plan.names  # the variants, before they become arms
    if prefix is not None and self_hosted:
        arms = S.prefix_arms(
            [v for _, v in target_plan.targets if v is not None], off_first=args.prefix_off_first
        )
        target_plan = dataclasses.replace(target_plan, targets=[(v.name, v) for v in arms])
    notes = target_plan.skipped + target_notes(args, target_plan, id_range)
    if copy_how is not None:  # its prompts are text, not ids drawn from the range
        notes = [n for n in notes if not n.startswith("prompt token ids drawn")]
        notes.append(_copy_note(args, copy_how))
    if prefix is not None:
        notes.append(_prefix_note(prefix, self_hosted))
    _say_plan(args, target_plan, load_plan, id_range, say, prefix, copy_how)

    runs: list[dict] = []
    t_start = time.perf_counter()
    loadavg_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    for name, variant in target_plan.targets:
        runs += run_target(args, name, variant, target_plan.device, target_plan.model, load_plan, say, prefix)
    notes += token_count_notes(runs)
    if any(r.get("spec_draft_tokens") for r in runs):
        notes.append(SPEC_NOTE)
    device, model = target_plan.device, target_plan.model
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
        variants=target_plan.names,
        skipped=[] if args.connect or args.http else [n for n in requested if n not in planned],
        prefix_groups=prefix_groups(args) if prefix is not None else None,
        prefix_grouping=PREFIX_GROUPING if prefix is not None else None,
        copy_prompt=copy_how,
        copy_output_cap=copy_output_cap(args) if copy_how is not None else None,
        elapsed_s=time.perf_counter() - t_start,
        host_loadavg_at_start=loadavg_start,
    )
    if copy_how is not None:  # the passages set the lengths (the plots' titles then name none)
        settings.update(input_len=None, output_len=copy_output_cap(args), length_dist=None)
    doc = build_document(
        command=command, settings=settings, model=model, device=device, runs=runs, notes=notes
    )
    say_results(say, doc)
    write_outputs(args, doc, say)
    bad = [r for r in runs if r["failed"] or r["completed"] < r["requests"]]
    return 1 if bad else 0


def copy_plan(args, load_plan: LoadPlan, max_ctx: int) -> tuple[LoadPlan, str]:
    """The load plan with the copy workload's requests in place of the random ones (the same
    loads and counts; the warm-up from seed + 1, max_tokens at most WARMUP_MAX_TOKENS), and how
    its prompts were encoded ("chat" or "plain")."""
    encode, count, how = copy_encoder(args.model)
    passages, cap = load_passages(), copy_output_cap(args)
    made: dict[int, list] = {}
    points = []
    for load, specs in load_plan.points:
        n = len(specs)
        if n not in made:  # one list per count, as plan_loads (a shorter one is a prefix)
            made[n] = make_copy_requests(
                n, encode, count, seed=args.seed, max_context=max_ctx, output_cap=cap, passages=passages
            )
        points.append((load, made[n]))
    warm_cap = min(cap or WARMUP_MAX_TOKENS, WARMUP_MAX_TOKENS)
    warm = make_copy_requests(
        len(load_plan.warm),
        encode,
        count,
        seed=args.seed + 1,
        max_context=max_ctx,
        output_cap=warm_cap,
        passages=passages,
    )
    return dataclasses.replace(load_plan, points=points, warm=warm), how


def _copy_note(args, how: str) -> str:
    cap = copy_output_cap(args)
    return (
        f"copy workload: each request asks to repeat, quote or spell-correct one of "
        f"{len(load_passages())} passages (bench/data/passages.json; passage, task and typos from "
        f"--seed), as a user message through the model's "
        + ("chat template" if how == "chat" else "tokenizer as plain text (it has no chat template)")
        + "; max_tokens = the passage's token count"
        + (f", capped at {cap} (--output-len)" if cap is not None else "")
        + "; --input-len and --length-dist do not apply"
    )


SPEC_NOTE = (
    "speculative decoding: spec_acceptance_rate = the server's spec_accepted_tokens / "
    "spec_draft_tokens over the run (draft tokens the target model agreed with), "
    "spec_accepted_per_draft = spec_accepted_tokens / spec_drafts (verification steps in which a "
    "request had a draft); null where its stats lack the counters or it drafted nothing"
)


def _say_plan(
    args,
    target_plan: TargetPlan,
    load_plan: LoadPlan,
    id_range: tuple[int, int],
    say: Console,
    prefix: SharedPrefix | None = None,
    copy_how: str | None = None,
) -> None:
    say(
        f"ringleader bench: model {target_plan.model}, device {target_plan.device}, variants {', '.join(target_plan.names)}; "
        f"{len(load_plan.points)} load point(s) x {'/'.join(str(len(sp)) for _, sp in load_plan.points)} requests, "
        + (
            f"prompt ids in [{id_range[0]}, {id_range[1]})"
            if copy_how is None
            else f"copy workload ({copy_how} prompts, max_tokens "
            + "/".join(str(sum(s.max_tokens for s in sp) // max(1, len(sp))) for _, sp in load_plan.points)
            + " on average)"
        )
        + (
            f", quiet and beside {' or '.join(map(str, busy))} busy processes"
            if (busy := [n for n in args.cpu_interference if n])
            else ""
        )
    )
    if prefix is None:
        return
    n_busy = len(load_plan.busy_levels)
    rates = [
        prefix.expected(prefix.specs(specs, i * n_busy)) for i, (_, specs) in enumerate(load_plan.points)
    ]
    say(
        f"shared prefixes: {prefix.groups} group(s) of {prefix.length} tokens, {PREFIX_GROUPING}, "
        f"fresh ones for every load point and busy level; expected prefix-cache hit rate "
        f"{_pct(rates[0]['steady'])} once each group's prefix was seen, "
        f"{'/'.join(_pct(r['cold']) for r in rates)} over each run with each group's first request a miss",
        always=True,
    )


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _prefix_note(prefix: SharedPrefix, self_hosted: bool) -> str:
    text = (
        f"shared prefixes: {prefix.groups} random prefix(es) of {prefix.length} tokens ({PREFIX_GROUPING}), "
        "each followed by the request's own suffix as --input-len and --length-dist make it (cut "
        "first when prefix + suffix + output exceed the context); every load point and busy level "
        "gets prefixes of its own, the same for every target, and the warm-up requests have none, so "
        "each run starts with none of its prefixes cached. expected_prefix_hit_rate = prefix / prompt "
        "tokens (once each group's prefix was seen), _cold = with each group's first request a miss; "
        "prefix_cache_hit_rate = the server's prefix_cache_hits / prefix_cache_queries over the run "
        "(null when its stats lack them)"
    )
    if self_hosted:
        return text + (
            "; each server variant ran twice, one server after the other (bench runs its targets in "
            "turn, not interleaved): <variant>/prefix-on with serve --prefix-caching, "
            "<variant>/prefix-off with serve --no-prefix-caching"
        )
    return text + "; one running server, whose prefix caching bench cannot switch: no on / off comparison"


def run_target(
    args, name, variant, device, model, load_plan: LoadPlan, say: Console, prefix: SharedPrefix | None = None
) -> list[dict]:
    """Every run of one target: start it (variant None: --http or --connect, already running),
    measure each load point at each busy level (behind its shared prefixes, with `prefix`), stop it."""
    runs = []
    server = runner = None
    http_url = http_model = address = None
    try:
        if variant is None and args.http:
            http_url, http_model = args.http, model
        elif variant is None:
            address = args.connect
        elif variant.kind == "hf":
            runner = _start_hf(args, name, device, load_plan.options, say)
        else:
            gateway = variant.kind in ("gateway", "clients")
            serve_args = _server_options(args, device).args() + list(variant.server_args)
            server = S.ServerProcess(serve_args, http=gateway)
            address, http_url, http_model = _start_server(server, name, gateway, say, variant)
        endpoint = Endpoint(runner, address, http_url, http_model)
        passes = _passes(name, variant, endpoint)
        salt = 0
        for load, point_specs in load_plan.points:
            for busy in load_plan.busy_levels:
                specs = point_specs if prefix is None else prefix.specs(point_specs, salt)
                expected = None if prefix is None else prefix.expected(specs)
                salt += 1
                for label, how in passes:
                    try:
                        with CpuInterference(busy) as spinners:
                            result = _measure_pass(args, how, endpoint, specs, load, load_plan)
                    except ClientUnavailable as exc:  # one client cannot run here: the others do
                        say(f"[{name}] skipping {label} at {load.label}: {exc}", always=True)
                        continue
                    entry = _run_entry(
                        args, label, how, device, model, load, result, spinners.describe(), variant, expected
                    )
                    runs.append(entry)
                    say_run(say, entry)
    finally:
        if server is not None:
            code = server.stop()
            if code not in (0, None, -signal.SIGTERM):
                say(f"[{name}] server exited with code {code}:\n{server.output_tail()}", always=True)
        if runner is not None:
            runner.close()
    return runs


def _start_hf(args, name, device, options: SendOptions, say: Console):
    """transformers' continuous batching in this process, with the servers' batch limits."""
    from ringleader.bench.hf_baseline import HfRunner, build_hf_model

    say(f"[{name}] building the transformers model ...")
    import torch

    if args.threads:  # as the servers get it
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    hf_model, _ = build_hf_model(args.model, device, args.weights_seed or 0)
    # the servers' batch limits and KV capacity (their defaults when not given; CUDA sizes
    # its KV from free memory, the workload keeps to DEFAULT_MAX_CTX), so both batch alike
    slots = args.slots or ENGINE_DEFAULTS.n_slots
    budget = max(args.token_budget or ENGINE_DEFAULTS.token_budget, slots)
    max_ctx = args.max_ctx or DEFAULT_MAX_CTX  # the context the workload keeps to
    kv_tokens = slots * max_ctx
    if device == "cpu":  # ringleader's default page pool on the CPU, in tokens of this model
        per_token = 2 * hf_model.config.num_hidden_layers * hf_model.config.num_key_value_heads
        per_token *= getattr(hf_model.config, "head_dim", None) or (
            hf_model.config.hidden_size // hf_model.config.num_attention_heads
        )
        kv_tokens = min(kv_tokens, ENGINE_DEFAULTS.resolved("cpu").kv_cache_memory // (4 * per_token))
    runner = HfRunner(
        hf_model,
        slots=slots,
        token_budget=budget,
        kv_tokens=kv_tokens,
        options=options,
        timeout_s=args.timeout,
    )
    say(
        f"[{name}] transformers model up in {time.perf_counter() - t0:.1f} s: "
        f"{type(hf_model).__name__} {hf_model.dtype} on {device}, max_requests_per_batch "
        f"{slots}, max_batch_tokens {budget}, KV cache {kv_tokens} tokens, "
        f"torch threads {torch.get_num_threads()}, in this process"
    )
    return runner


def _server_options(args, device) -> S.ServerOptions:
    return S.ServerOptions(
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


def _start_server(server: S.ServerProcess, name, gateway: bool, say: Console, variant=None):
    """Starts `server`; returns its address, and with a gateway the gateway's URL and the first
    model it lists (else None, None)."""
    t0 = time.perf_counter()
    try:
        address = server.start()
    except S.ServerError as exc:
        text = str(exc)
        if variant is not None and variant.prefix_caching is not None and "unrecognized arguments" in text:
            raise S.ServerError(
                "this `ringleader serve` may not take --prefix-caching / --no-prefix-caching, which "
                f"--shared-prefix-len needs to compare the two: {text}"
            ) from exc
        raise
    launch = (server.stats().get("backend") or {}).get("launch")
    say(
        f"[{name}] server up at {address}"
        + (f" with its gateway at {server.http_url}" if gateway else "")
        + f" in {time.perf_counter() - t0:.1f} s"
        + (f", launch {launch}" if launch else "")
        + f": {' '.join(server.serve_args)}"
    )
    http_url = http_model = None
    if gateway:
        from ringleader.bench.http_loadgen import list_models

        http_url = server.http_url
        try:
            http_model = (list_models(http_url) or [None])[0]
        except Exception as exc:
            raise S.ServerError(f"the gateway at {http_url} did not list its models: {exc}") from exc
    return address, http_url, http_model


def _passes(name, variant, endpoint: Endpoint) -> list[tuple[str | None, str]]:
    """(label, how) of each run at a load point: the zmq load generator, the HTTP one, or both
    against one gateway server."""
    if endpoint.runner is not None:
        return [(name, "hf")]
    if variant is not None and variant.kind == "gateway":
        return [("native", "zmq"), ("gateway", "http")]
    if variant is not None and variant.kind == "clients":
        return list(CLIENT_PASSES)
    if endpoint.http_url is not None:
        return [(name, "http")]
    return [(name if variant is not None else None, "zmq")]


def _measure_pass(args, how, endpoint: Endpoint, specs, load, load_plan: LoadPlan):
    """One measured run: transformers in this process (hf), the ZeroMQ generator, or the HTTP one."""
    warm, options = load_plan.warm, load_plan.options
    if how == "hf":
        return endpoint.runner.measure(specs, load, warm)
    if how in CLIENT_MEASURES:
        from ringleader.bench import client_loadgens as C

        kw: dict = dict(warmup=warm, options=options, timeout_s=args.timeout)
        if how == "c":
            kw["binary"] = C.c_bench_binary(args.c_bench)
        return getattr(C, CLIENT_MEASURES[how])(endpoint.address, specs, load, **kw)
    if how == "http":
        from ringleader.bench.http_loadgen import measure_http

        return measure_http(
            endpoint.http_url,
            specs,
            load,
            warmup=warm,
            options=options,
            timeout_s=args.timeout,
            model=endpoint.http_model,
            stats_address=endpoint.address,  # the ringleader server behind a gateway, else None
            decode=_prompt_decoder(args) if getattr(args, "http_prompt_text", False) else None,
            min_tokens=getattr(args, "http_min_tokens", False),
        )
    return measure(endpoint.address, specs, load, warmup=warm, options=options, timeout_s=args.timeout)


def _prompt_decoder(args):
    """--http-prompt-text: the --model's tokenizer, decoding a prompt's ids to its text."""
    from ringleader.device.model.presets import tokenizer_for

    tokenizer = tokenizer_for(args.model)
    if tokenizer is None:
        raise ValueError(
            f"--http-prompt-text needs --model with a tokenizer (a .gguf file); {args.model} has none"
        )
    return tokenizer.decode


def _run_entry(
    args, label, how, device, model, load, result, busy: dict, variant=None, expected: dict | None = None
) -> dict:
    """One run's entry of the results, named by its label (or --label, or the server's stats);
    `variant` None for --connect and --http; `expected`: its shared prefixes' hit rates."""
    after = result.stats_after
    entry = make_run_entry(
        scheduler=label or args.label or _label_from(after),
        device=device,
        model=after.get("model") or getattr(result, "model", None) or model,
        load=load,
        result=result,
        burstiness=args.burstiness,
        busy=busy,
        backend=after.get("backend"),
        variant=variant.variant if variant is not None else None,
        prefix_caching=variant.prefix_caching if variant is not None else None,
        expected_prefix_hit_rate=expected,
    )
    if how == "http":
        entry["transport"] = "http"
        entry["token_count"] = result.token_count
    if variant is not None and variant.kind == "clients":
        entry["client"] = label
    return entry


def _label_from(stats: dict) -> str:
    backend = stats.get("backend") or {}
    if backend.get("policy") == "static":
        return "static"
    sched = str(backend.get("scheduler", "connected"))
    return "host" if sched.startswith("host") else sched
