"""What one `ringleader bench` invocation measures: the endpoint at --http, the server at
--connect, or the --compare variants that run on this device; and the notes that tell a reader of
its results how each was measured."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from ringleader.bench import servers as S
from ringleader.bench.workloads import PRESET_PROMPT_IDS


@dataclass
class TargetPlan:
    """The device and model the results name (device "?" when it is not known before the runs),
    and each target as (name, variant): variant None for --connect and --http."""

    device: str
    model: str | None
    targets: list[tuple[str, S.Variant | None]]
    skipped: list[str] = field(default_factory=list)  # a note for each variant this device cannot run

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.targets]


def plan_targets(args, requested: list[str], say) -> TargetPlan | None:
    """The targets to measure, or None (after saying why on stderr) when there is none."""
    if args.http:
        from ringleader.bench.http_loadgen import list_models

        device, model = "?", args.http_model
        if model is None:
            try:
                served = list_models(args.http)
            except Exception as exc:
                print(
                    f"ringleader bench: cannot list the models at {args.http} ({exc}); give --http-model",
                    file=sys.stderr,
                )
                return None
            if not served:
                print(
                    f"ringleader bench: {args.http}/v1/models lists no model; give --http-model",
                    file=sys.stderr,
                )
                return None
            model = served[0]
        return TargetPlan(device, model, [(args.label or "http", None)])
    if args.connect:
        return TargetPlan("?", args.model, [("connected", None)])
    device = S.resolve_device(args.device)
    variants, skipped = S.plan_variants(requested, device)
    for note in skipped:
        say(f"note: {note}", always=True)
    if not variants:
        print("ringleader bench: nothing to run on this device", file=sys.stderr)
        return None
    return TargetPlan(device, args.model, [(v.name, v) for v in variants], skipped)


def target_notes(args, plan: TargetPlan, id_range: tuple[int, int]) -> list[str]:
    """How the targets were measured, for the results' notes (after the skipped variants')."""
    device, model, targets = plan.device, plan.model, plan.targets
    notes: list[str] = []
    if "hf" in plan.names:
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
    if any(v is not None and v.kind == "clients" for _, v in targets):
        notes.append(
            "clients: one server with its HTTP gateway (serve --http); each load point runs through "
            "every client back to back, in this order: c (clients/c's ringleader-c-bench, a "
            "subprocess), python-sync (the bundled Client, a thread per request in flight), "
            "python-async (AsyncClient, a task per request), pyzmq-raw (bench/loadgen.py) and http "
            "(the gateway), with prefix caching off (the passes send the same prompts). Chunks are "
            "stamped as the client hands them over; each client's CPU is its own process's over the "
            "run (the C tool's getrusage, this process's for the rest), on the same cores as the "
            "server on a CPU host"
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
    return notes


def token_count_notes(runs: list[dict]) -> list[str]:
    """How the HTTP runs counted tokens per SSE chunk."""
    seen = {r.get("token_count") for r in runs if r.get("transport") == "http"} - {None}
    if not seen:
        return []
    from ringleader.bench.http_loadgen import TEXT_CHUNKS, TOKEN_IDS

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
