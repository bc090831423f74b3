"""`ringleader` command line: serve, gateway, generate, stats, bench, build-kernel, doctor, keygen."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from device.engine_config import DEVICES, LAUNCHES, POLICIES, SCHEDULERS, SERVE_FLAGS, EngineConfig
from ipc.backend import Backend
from ipc.curve import (
    CurveError,
    add_curve_client_options,
    add_curve_server_options,
    client_curve_from_args,
    server_curve_from_args,
)
from ipc.sampling_params import WIRE_FIELDS as SAMPLING_FIELDS
from ipc.sampling_params import SamplingParams

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# The EngineConfig fields `serve` takes: field -> (argparse options, help); the flag is
# SERVE_FLAGS[field].  Each default comes from the field (EngineConfig's, written once); None
# there means "per device", which EngineConfig.resolved() fills in and the help says.
ENGINE_OPTIONS: dict[str, tuple[dict[str, Any], str]] = {
    "model": (
        {},
        "preset (tiny, llama-1b, llama-8b) or a local Hugging Face checkpoint directory (default: %(default)s)",
    ),
    "device": ({"choices": DEVICES}, "auto: cuda when torch sees a GPU, else cpu"),
    "scheduler": (
        {"choices": SCHEDULERS},
        "CUDA: where sched_step runs (default device); the CPU backend is host-only",
    ),
    "launch": (
        {"choices": LAUNCHES},
        "CUDA launch mode of the device scheduler: resident (one WHILE graph; "
        "fails start-up if it cannot run), pump, or auto (resident, else pump; the "
        "mode that runs is in the log and in stats)",
    ),
    "policy": (
        {"choices": POLICIES},
        "admission: fifo, priority with aging, or static batching (a baseline)",
    ),
    "n_slots": ({"type": int}, "batch slots (max concurrent sequences)"),
    "max_ctx": (
        {"type": int},
        "tokens of KV cache per slot (default: %s on cpu; on cuda the longest that fits "
        "--gpu-memory-fraction, up to the model's limit)" % EngineConfig().resolved("cpu").max_ctx,
    ),
    "gpu_memory_fraction": (
        {"type": float},
        "CUDA: share of device memory for weights, KV cache and workspace",
    ),
    "token_budget": ({"type": int}, "max token rows per step"),
    "aging_steps": (
        {"type": int},
        "priority policy: a waiting request gains one level per this many steps",
    ),
    "seed": ({"type": int}, "seed of the preset's random weights"),
    "threads": ({"type": int}, "torch CPU threads"),
    "trace_path": (
        {},
        "CUDA: write the device timeline as Chrome-trace JSON to this file at shutdown",
    ),
    "run_budget_s": (
        {"type": float},
        "CUDA: the scheduler kernel exits on its own after this many seconds, and the server "
        "reports engine_dead (default: no limit; for timed runs that must never leave a kernel behind)",
    ),
}


def add_server_options(p: argparse.ArgumentParser) -> None:
    """Options that shape a server; `bench` reuses them for the servers it starts.  The engine's
    (ENGINE_OPTIONS) land on args under their EngineConfig field names."""
    defaults = EngineConfig()
    for name, (options, help) in ENGINE_OPTIONS.items():
        flag = SERVE_FLAGS[name]
        if "choices" not in options:
            options = {"metavar": flag[2:].upper().replace("-", "_"), **options}
        p.add_argument(flag, dest=name, default=getattr(defaults, name), help=help, **options)
    p.add_argument(
        "--max-queue",
        type=int,
        default=4096,
        help="requests held on the host when the rings are full; beyond: overloaded",
    )
    p.add_argument(
        "--max-inflight-per-client",
        type=int,
        default=1024,
        help="requests one client may have in flight; beyond: overloaded (0: no cap)",
    )
    p.add_argument(
        "--max-queue-ms",
        type=float,
        default=60_000,
        help="a request without its first token this long after arrival ends with "
        "error code timeout (0: no limit)",
    )
    p.add_argument(
        "--watchdog-s",
        type=float,
        default=None,
        help="heartbeat stall that declares the engine dead (default 2 on cuda, 60 on cpu)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in ENGINE_OPTIONS})


def open_configured_backend(args: argparse.Namespace) -> Backend:
    from device.backends import open_backend  # the one place hostctl reaches into device/

    return open_backend(engine_config_from_args(args))


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives every thread that allocates its own arena and keeps the peak of each; a
    serving process with a few busy threads then holds tens of MB more than it uses (a soak
    measured about 21 MB less RSS with 2 arenas, at no CPU cost).  Other libcs: no-op."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def cmd_serve(args) -> int:
    from device.backends.cuda_preflight import UnsafeEnvironment
    from hostctl.server import Server
    from ipc.backend import EngineDead

    curve = server_curve_from_args(args)  # before the (slow) backend: a bad key fails at once
    try:
        engine_config_from_args(args)  # a bad engine option fails at once too, in one line
    except ValueError as exc:
        print(f"ringleader: cannot start: {exc}", file=sys.stderr)
        return 2
    _limit_malloc_arenas()
    try:
        backend = open_configured_backend(args)
    except (UnsafeEnvironment, MemoryError) as exc:  # the message says what to change
        print(f"ringleader: cannot start: {exc}", file=sys.stderr)
        return 2
    server = Server(
        backend,
        args.bind,
        max_queued=args.max_queue,
        watchdog_s=args.watchdog_s,
        drain_timeout_s=args.drain_timeout,
        max_inflight_per_client=args.max_inflight_per_client,
        max_queue_ms=args.max_queue_ms,
        curve=curve,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.request_stop())
    print(
        f"ringleader: serving {backend.model.name} on {server.address} ({json.dumps(backend.description)})",
        file=sys.stderr,
        flush=True,
    )
    closers: list[Callable[[], None]] = []  # what --metrics / --http started, closed after
    try:
        _start_http_fronts(args, server, closers)
    except (ImportError, OSError, ValueError) as exc:
        for close in reversed(closers):
            close()
        print(f"ringleader: cannot start: {exc}", file=sys.stderr)
        return 2
    try:
        server.serve_forever()
    except EngineDead as exc:
        print(f"ringleader: the engine did not stop cleanly: {exc}", file=sys.stderr)
        return 1
    finally:
        for close in reversed(closers):
            close()
    return 0


def parse_listen(text: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _start_http_fronts(args, server, closers: list[Callable[[], None]]) -> None:
    """The metrics endpoint and the OpenAI gateway of `serve --metrics` / `serve --http`; each
    one started appends its close to `closers`.  Their packages (prometheus_client, aiohttp) are
    imported only when asked for: a plain install serves without them."""
    if args.metrics:
        from hostctl.prometheus import MetricsExporter

        exporter = MetricsExporter(server, *parse_listen(args.metrics))
        exporter.start()
        closers.append(exporter.close)
        print(f"ringleader: metrics at {exporter.url}", file=sys.stderr, flush=True)
    if args.http:
        if args.curve_secret_key:
            raise ValueError("--http with CURVE keys: run `ringleader gateway` with a client's keys instead")
        from hostctl.gateway import BackgroundGateway

        model = server.backend.model
        host, port = parse_listen(args.http)
        gateway = BackgroundGateway(
            server.address,
            host,
            port,
            served_model_name=args.served_model_name or model.name,
            max_model_len=model.max_context,
            has_tokenizer=model.tokenizer is not None,
            api_key=args.api_key,
            process_metrics=not args.metrics,  # the server's endpoint has the process already
        ).start()
        closers.append(gateway.stop)
        print(f"ringleader: openai gateway at {gateway.url}", file=sys.stderr, flush=True)


def cmd_gateway(args) -> int:
    try:
        from hostctl.gateway import GatewayConfig, run_gateway
    except ImportError as exc:
        print(f"ringleader gateway: {exc}", file=sys.stderr)
        return 2

    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        print(f"ringleader gateway: --listen: {exc}", file=sys.stderr)
        return 2
    config = GatewayConfig(
        upstream=args.upstream,
        host=host,
        port=port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        curve=client_curve_from_args(args),
        default_max_tokens=args.default_max_tokens,
        startup_timeout_s=args.startup_timeout,
    )
    return run_gateway(config)


def add_http_options(p: argparse.ArgumentParser) -> None:
    """What the OpenAI gateway takes, in `serve --http` and in `gateway`."""
    p.add_argument("--served-model-name", help="the model name clients send (default: the server's model)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("RINGLEADER_API_KEY"),
        help="generation routes then need 'Authorization: Bearer KEY' (default $RINGLEADER_API_KEY)",
    )


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """One option per SamplingParams field, named after it, with the field's default."""
    special: dict[str, dict[str, Any]] = {
        "max_tokens": dict(type=int, default=64),
        "seed": dict(type=int, default=None),
        "stop_token_ids": dict(type=_int_list, default=()),
        "ignore_eos": dict(action="store_true"),
    }
    for f in dataclasses.fields(SamplingParams):
        options = special.get(f.name) or dict(type=type(f.default), default=f.default)
        p.add_argument("--" + f.name.replace("_", "-"), **options)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    fields = {name: getattr(args, name) for name in SAMPLING_FIELDS}
    return SamplingParams(**{**fields, "stop_token_ids": tuple(fields["stop_token_ids"])})


def cmd_generate(args) -> int:
    if args.chat:
        if args.prompt_ids is not None:
            print("--chat takes text (a user turn), not --prompt-ids", file=sys.stderr)
            return 2
    elif (args.prompt is None) == (args.prompt_ids is None):
        print("give a prompt or --prompt-ids (one of them)", file=sys.stderr)
        return 2
    with _client(args) as client:
        if not args.chat:
            return _print_stream(client, args, prompt=args.prompt, prompt_ids=args.prompt_ids)[0]
        turns = [{"role": "system", "content": args.system}] if args.system else []
        if args.prompt is not None:  # one question, one answer
            return _print_stream(client, args, messages=turns + [{"role": "user", "content": args.prompt}])[0]
        return _chat_loop(client, args, turns)


def _chat_loop(client, args, turns: list[dict[str, str]]) -> int:
    """A conversation on stdin: each line is a user turn; the answers join the history."""
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        turns.append({"role": "user", "content": line.rstrip("\n")})
        rc, answer = _print_stream(client, args, messages=turns)
        if rc:
            return rc
        turns.append({"role": "assistant", "content": answer})


def _print_stream(client, args, **inputs) -> tuple[int, str]:
    """Streams one request to stdout, its end to stderr; (exit code, the text streamed)."""
    stream = client.generate(
        **inputs, sampling=sampling_from_args(args), priority=args.priority, timeout_ms=args.timeout_ms
    )
    show_ids = inputs.get("prompt_ids") is not None or args.ids
    text: list[str] = []
    try:
        for chunk in stream:
            if show_ids or chunk.text is None:
                if chunk.token_ids:
                    print(" ".join(map(str, chunk.token_ids)), end=" ", flush=True)
            else:
                text.append(chunk.text)
                print(chunk.text, end="", flush=True)
    except KeyboardInterrupt:
        stream.abort()
        stream.wait(timeout=5)
    done = stream.done
    print()
    print(
        f"[{done.finish_reason}: {done.prompt_tokens} prompt + {done.completion_tokens} "
        f"completion tokens]" + (f" {done.error_code}: {done.error_message}" if done.error_code else ""),
        file=sys.stderr,
    )
    return (0 if done.finish_reason != "error" else 1), "".join(text)


def _client(args):
    from ipc.client import Client

    return Client(
        args.connect,
        timeout=args.timeout,
        connect_timeout=args.connect_timeout,
        curve=client_curve_from_args(args),
    )


def cmd_stats(args) -> int:
    with _client(args) as client:
        print(json.dumps(client.stats(), indent=2, sort_keys=True))
    return 0


def cmd_build_kernel(args) -> int:
    from device.sched.build import NVRTC_ENV, compile_kernel, nvrtc_library

    if args.nvrtc:
        os.environ[NVRTC_ENV] = args.nvrtc  # read at the process's first NVRTC call, below

    build = compile_kernel(args.arch, threads=args.threads)
    library = nvrtc_library()
    print(
        f"{len(build.cubin)} bytes of CUBIN for {build.arch} from NVRTC "
        f"{build.nvrtc_version[0]}.{build.nvrtc_version[1]} ({library}), PTX ISA {build.ptx_isa}; "
        f"the scheduler kernel runs {args.threads} threads/block"
    )
    for name, r in build.resources.items():
        print(
            f"  {name}: {r.registers} registers/thread, {r.shared_bytes} bytes shared memory, "
            f"{r.spill_bytes} bytes spilled, {r.stack_bytes} bytes stack"
        )
    if args.verbose:
        print(build.log)
    if args.output:
        with open(args.output, "wb") as f:
            f.write(build.cubin)
    if args.json:
        report = {
            "arch": build.arch,
            "threads": args.threads,
            "nvrtc": "%d.%d" % build.nvrtc_version,
            "nvrtc_library": library,
            "ptx_isa": build.ptx_isa,
            "cubin_bytes": len(build.cubin),
            "functions": {name: vars(r) for name, r in build.resources.items()},
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def cmd_doctor(args) -> int:
    from device.doctor import Doctor, format_report

    report = Doctor(args.arch).run()
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0 if report["cuda_ready"] else 1


def cmd_keygen(args) -> int:
    from ipc.curve import generate_keypair

    try:
        public, secret = generate_keypair(args.directory, args.name)
    except (CurveError, OSError) as exc:
        print(f"ringleader: keygen: {exc}", file=sys.stderr)
        return 2
    print(
        f"public key: {public}\nsecret key: {secret}  (keep it private, on this machine only)\n\n"
        f"For the server:  ringleader serve --curve-secret-key {secret} --authorized-keys DIR\n"
        f"  and give clients {public} for their --curve-server-key.\n"
        f"For a client:  copy {public} into the server's --authorized-keys DIR (read when the "
        f"server starts), then\n  ringleader generate ... --curve-server-key SERVER.key "
        f"--curve-secret-key {secret}"
    )
    return 0


def cmd_bench(args, rest: list[str]) -> int:
    from bench.cli import main as bench_main

    return bench_main(rest)


def add_client_options(p: argparse.ArgumentParser, timeout: float) -> None:
    p.add_argument("--connect", default=DEFAULT_ADDRESS)
    p.add_argument("--timeout", type=float, default=timeout, help="seconds to wait for each reply")
    p.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds to wait for a connection to the server"
    )
    add_curve_client_options(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringleader", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the server")
    add_server_options(p)
    p.add_argument(
        "--bind",
        default=DEFAULT_ADDRESS,
        help="ZeroMQ address; a non-loopback one "
        "without CURVE keys is open to anyone who reaches it (a warning says so)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=5.0,
        help="on SIGINT/SIGTERM, seconds to let in-flight requests finish (the whole "
        "stop takes at most this + 5 s)",
    )
    add_curve_server_options(p)
    p.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API here (the gateway, in this process)",
    )
    p.add_argument(
        "--metrics", metavar="HOST:PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics"
    )
    add_http_options(p)

    p = sub.add_parser(
        "gateway", help="an OpenAI-compatible HTTP API in front of a running ringleader server"
    )
    p.add_argument("--upstream", default=DEFAULT_ADDRESS, help="the ringleader server (ZeroMQ address)")
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="HTTP address")
    add_http_options(p)
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="chat requests without max_tokens (at most half the model's context)",
    )
    p.add_argument(
        "--startup-timeout", type=float, default=60.0, help="seconds to wait for the upstream to answer"
    )
    add_curve_client_options(p)

    p = sub.add_parser("generate", help="stream one completion from a running server")
    p.add_argument("prompt", nargs="?", help="the prompt text (with --chat: the user's turn)")
    p.add_argument("--prompt-ids", type=_int_list)
    p.add_argument(
        "--chat",
        action="store_true",
        help="send chat messages, rendered by the model's chat template; without a prompt, "
        "a conversation with one user turn per line of stdin",
    )
    p.add_argument("--system", help="with --chat: a system turn first")
    add_sampling_options(p)
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--ids", action="store_true", help="print token ids even when text is available")
    p.add_argument(
        "--timeout-ms",
        type=int,
        default=None,
        help="the server ends the request with error code timeout after this long",
    )
    add_client_options(p, timeout=120.0)

    p = sub.add_parser("stats", help="print a running server's stats")
    add_client_options(p, timeout=10.0)

    p = sub.add_parser("build-kernel", help="compile the scheduler kernel with NVRTC (no GPU needed)")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--threads", type=int, default=256, help="threads per block of the kernel")
    p.add_argument("--output", help="write the CUBIN here")
    p.add_argument("--verbose", action="store_true", help="print the full ptxas log")
    p.add_argument(
        "--nvrtc",
        metavar="LIBNVRTC",
        help="compile with this libnvrtc.so (default: $RINGLEADER_NVRTC, else the one cuda-bindings finds)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the build's versions and resources here")

    p = sub.add_parser(
        "doctor",
        help="versions, GPU, scheduler kernel build; exits 1 when a CUDA run would fail here, naming why",
    )
    p.add_argument("--arch", default=None, help="compile for this arch (default: the GPU's, else sm_90)")
    p.add_argument("--json", help="also write the report here")

    p = sub.add_parser(
        "keygen", help="create a CURVE keypair: NAME.key (public) and NAME.key_secret; never overwrites"
    )
    p.add_argument("directory", help="where to write the keys (created if missing)")
    p.add_argument("--name", default="ringleader", help="file name stem (default: ringleader)")

    sub.add_parser("bench", help="benchmark (see `ringleader bench --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] == ["bench"]:
        logging.basicConfig(level="WARNING")
        return cmd_bench(None, argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    handlers = {
        "serve": cmd_serve,
        "gateway": cmd_gateway,
        "generate": cmd_generate,
        "stats": cmd_stats,
        "build-kernel": cmd_build_kernel,
        "doctor": cmd_doctor,
        "keygen": cmd_keygen,
    }
    try:
        return handlers[args.command](args)
    except CurveError as exc:  # the message names the option or file
        print(f"ringleader: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
