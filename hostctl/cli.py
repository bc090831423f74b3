"""`ringleader` command line: serve, gateway, generate, stats, bench, build-kernel, doctor, keygen."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
import traceback
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

log = logging.getLogger("ringleader.cli")


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
        "a preset (tiny, llama-1b, llama-8b: random weights), a GGUF file (*.gguf: F32, F16, BF16, "
        "Q8_0, Q4_0, Q4_1, Q5_x, Q2_K..Q6_K) or a local Hugging Face checkpoint directory "
        "(default: %(default)s)",
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
    "threads": ({"type": int}, "torch CPU threads (default: torch's, one per core it may use)"),
    "trace_path": (
        {},
        "CUDA: write the device timeline as Chrome-trace JSON to this file at shutdown",
    ),
    "run_budget_s": (
        {"type": float},
        "CUDA: the scheduler kernel exits on its own after this many seconds, and the server "
        "reports engine_dead (default: no limit; for timed runs that must never leave a kernel behind)",
    ),
    "chat_template": (
        {"metavar": "FILE"},
        "a Jinja chat template (as tokenizer_config.json's chat_template is written) that replaces "
        "the model's own, for a model whose template is missing or wrong; the template text itself "
        "is taken too when it is no file and holds {{ or {%% (default: the model's template)",
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
        "--default-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="a request without max_tokens (an OpenAI chat request without it, too) generates up "
        "to the rest of the model's context, at most N tokens (default: no cap)",
    )
    p.add_argument(
        "--watchdog-s",
        type=float,
        default=None,
        help="heartbeat stall that declares the engine dead (default 2 on cuda, 60 on cpu)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in ENGINE_OPTIONS})


def open_configured_backend(config: EngineConfig) -> Backend:
    from device.backends import open_backend  # the one place hostctl reaches into device/

    return open_backend(config)


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
    """Everything that can fail fast (options, the model's path, every address and port, the
    optional packages asked for) is checked and bound before the model loads; a start-up
    failure is one line naming the fault (the traceback too under --log-level debug)."""
    from hostctl.frontend_socket import FrontendSocket
    from hostctl.http_fronts import HttpFronts
    from hostctl.server import Server
    from ipc.backend import EngineDead

    opened: list[Callable[[], None]] = []  # closed if the start fails
    try:
        curve = server_curve_from_args(args)
        config = engine_config_from_args(args).resolved()
        _check_model_and_device(config)
        fronts = HttpFronts(args.http, args.metrics, curve=bool(args.curve_secret_key))
        opened.append(fronts.close)
        try:
            frontend = FrontendSocket(args.bind, curve=curve)
        except ValueError as exc:
            raise ValueError(f"--bind: {exc}") from None
        opened.append(lambda: frontend.close(0))
        _limit_malloc_arenas()
        log.info("loading %s on %s", config.model, config.device)
        backend = open_configured_backend(config)
        server = Server(
            backend,
            frontend,
            max_queued=args.max_queue,
            watchdog_s=args.watchdog_s,
            drain_timeout_s=args.drain_timeout,
            max_inflight_per_client=args.max_inflight_per_client,
            max_queue_ms=args.max_queue_ms,
            default_max_tokens=args.default_max_tokens,
        )
        opened = [fronts.close]  # the server owns the frontend socket from here
        fronts.start(server, served_model_name=args.served_model_name, api_key=args.api_key)
    except Exception as exc:
        for close in reversed(opened):
            close()
        return cannot_start(exc)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.request_stop())

    def announce() -> None:  # the line a script may wait for: requests are served from now on
        print(
            f"ringleader: serving {backend.model.name} on {server.address} ({json.dumps(backend.description)})",
            file=sys.stderr,
            flush=True,
        )

    try:
        server.serve_forever(on_serving=announce)
    except EngineDead as exc:
        print(f"ringleader: the engine did not stop cleanly: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if server.serving.is_set():
            raise  # a fault while serving is a bug: its traceback matters
        return cannot_start(exc)  # the backend failed to start
    finally:
        fronts.close()
    log.info("exited")
    return 0


def _check_model_and_device(config: EngineConfig) -> None:
    """ValueError unless --model can name a model and --device can run here (no weights read)."""
    from device.engine_config import cuda_unavailable_reason
    from device.model.model_spec import check_model_spec

    check_model_spec(config.model)
    if config.device == "cuda":
        if config.scheduler == "device":  # settings that hang a persistent kernel, named first
            from device.backends.cuda_preflight import refuse_unsafe_environment

            refuse_unsafe_environment()
        reason = cuda_unavailable_reason()
        if reason:
            raise ValueError(reason)


# Exceptions whose message is the whole story (they name the fault and, where there is one, the
# fix); any other type gets its name in the line, since it is likely a bug.
CLEAN_ERRORS = (ValueError, OSError, ImportError, RuntimeError, KeyError, MemoryError, CurveError)


def cannot_start(exc: BaseException, what: str = "cannot start") -> int:
    """One line on stderr naming the fault; exit code 2.  Under --log-level debug the traceback
    is printed first."""
    if log.isEnabledFor(logging.DEBUG):
        traceback.print_exception(exc)
    if isinstance(exc, KeyError) and exc.args:
        message = str(exc.args[0])  # str(KeyError) quotes its message
    elif isinstance(exc, OSError) and exc.strerror and exc.filename is None:
        message = exc.strerror  # without the "[Errno N]" prefix; ours name the address
    else:
        message = str(exc) or type(exc).__name__
    if not isinstance(exc, CLEAN_ERRORS):
        message = f"{type(exc).__name__}: {message} (--log-level debug shows where)"
    print(f"ringleader: {what}: {message}", file=sys.stderr, flush=True)
    return 2


def cmd_gateway(args) -> int:
    try:
        from hostctl.gateway import GatewayConfig, run_gateway
    except ImportError as exc:
        print(f"ringleader gateway: {exc}", file=sys.stderr)
        return 2

    from hostctl.http_fronts import parse_listen

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
        "max_tokens": dict(type=int),
        "seed": dict(type=int),
        "stop_token_ids": dict(type=_int_list, default=()),
        "ignore_eos": dict(action="store_true"),
    }
    for f in dataclasses.fields(SamplingParams):
        options = {"default": f.default, "type": type(f.default), **special.get(f.name, {})}
        if options.get("action"):
            options.pop("type")
        p.add_argument("--" + f.name.replace("_", "-"), help=SAMPLING_HELP[f.name], **options)


SAMPLING_HELP = {
    "max_tokens": "most tokens to generate (default: the rest of the model's context, at most the "
    "server's --default-max-tokens)",
    "temperature": "0 picks the most likely token (greedy); higher samples more freely",
    "top_p": "sample from the smallest set of tokens whose probability adds up to this; 1 is off",
    "top_k": "sample from this many of the most likely tokens; 0 is off",
    "seed": "the same seed and settings give the same tokens, under any load (default: the server draws one)",
    "stop_token_ids": "comma-separated token ids that end the answer, besides the model's end token "
    "(default: none)",
    "ignore_eos": "go on past the model's end token, up to --max-tokens",
}


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    fields = {name: getattr(args, name) for name in SAMPLING_FIELDS}
    return SamplingParams(**{**fields, "stop_token_ids": tuple(fields["stop_token_ids"])})


def cmd_generate(args) -> int:
    try:
        sampling_from_args(args)  # a value no server takes fails here, in one line
    except ValueError as exc:
        print(f"ringleader generate: {exc}", file=sys.stderr)
        return 2
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
    except KeyboardInterrupt:  # Ctrl-C: end the request on the server too, then exit 130
        stream.abort()
        stream.wait(timeout=5)
        interrupted = True
    else:
        interrupted = False
    done = stream.done
    print()
    if done is None:  # interrupted, and the server did not confirm the abort in time
        print("[interrupted]", file=sys.stderr)
        return 130, "".join(text)
    print(
        f"[{done.finish_reason}: {done.prompt_tokens} prompt + {done.completion_tokens} "
        f"completion tokens]" + (f" {done.error_code}: {done.error_message}" if done.error_code else ""),
        file=sys.stderr,
    )
    if interrupted:
        return 130, "".join(text)
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


def cmd_wait_ready(args) -> int:
    """Waits until a server answers at --connect: it answers once its model has loaded and it
    serves (`serve` binds first, so requests sent while it loads wait for it, not fail)."""
    from ipc.client import Client

    # no liveness checks: a server that is still starting is neither connected nor answering
    with Client(
        args.connect, connect_timeout=None, reply_timeout=None, curve=client_curve_from_args(args)
    ) as client:
        started = time.monotonic()
        try:
            stats = client.stats(timeout=args.timeout)
        except TimeoutError:
            print(
                f"ringleader wait-ready: no ringleader server served at {args.connect} within {args.timeout:g} s",
                file=sys.stderr,
            )
            return 1
    dead = stats.get("engine_dead")
    if dead:
        print(f"ringleader wait-ready: the server at {args.connect} answers, but its engine is dead: {dead}")
        return 1
    if not args.quiet:
        print(
            f"ready: {stats.get('model')} at {args.connect} (waited {time.monotonic() - started:.1f} s)",
            file=sys.stderr,
        )
    return 0


def cmd_build_kernel(args) -> int:
    from device.sched.build import NVRTC_ENV, compile_kernel, nvrtc_library

    if args.nvrtc:
        os.environ[NVRTC_ENV] = args.nvrtc  # read at the process's first NVRTC call, below

    try:
        build = compile_kernel(args.arch, threads=args.threads)
    except Exception as exc:  # no NVRTC, a wrong --nvrtc, a compile error: one line
        return cannot_start(exc, "build-kernel")
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
    p.add_argument("--connect", default=DEFAULT_ADDRESS, help="the server's ZeroMQ address")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds to wait for each reply")
    p.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds to wait for a connection to the server"
    )
    add_curve_client_options(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringleader", description=__doc__, formatter_class=DefaultsFormatter
    )
    parser.add_argument("--version", action="version", version=version_line())
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default=None,
        help="default: INFO for serve and gateway (a line per finished request), else WARNING; "
        "DEBUG also prints the traceback of a start-up error",
    )
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
        "--startup-timeout", type=float, default=60.0, help="seconds to wait for the upstream to answer"
    )
    add_curve_client_options(p)

    p = sub.add_parser("generate", help="stream one completion from a running server")
    p.add_argument("prompt", nargs="?", help="the prompt text (with --chat: the user's turn)")
    p.add_argument("--prompt-ids", type=_int_list, help="the prompt as comma-separated token ids")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send chat messages, rendered by the model's chat template; without a prompt, "
        "a conversation with one user turn per line of stdin",
    )
    p.add_argument("--system", help="with --chat: a system turn first")
    add_sampling_options(p)
    p.add_argument("--priority", type=int, default=0, help="under serve --policy priority: higher goes first")
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

    p = sub.add_parser(
        "wait-ready",
        help="wait until a server serves (its model loaded); exit 1 if none does in --timeout seconds",
    )
    p.add_argument("--connect", default=DEFAULT_ADDRESS, help="the server's ZeroMQ address")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait")
    p.add_argument("--quiet", action="store_true", help="print nothing when ready")
    add_curve_client_options(p)

    p = sub.add_parser("build-kernel", help="compile the scheduler kernel with NVRTC (no GPU needed)")
    p.add_argument("--arch", default="sm_90", help="the GPU architecture to compile for (sm_90: H100/H200)")
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
    for command in sub.choices.values():
        command.formatter_class = DefaultsFormatter
    return parser


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help shows its default, unless the help says it already or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in help.lower()
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or isinstance(action, argparse._VersionAction)
        ):
            return help
        return f"{help} (default: %(default)s)" if help else "(default: %(default)s)"


def version_line() -> str:
    from importlib import metadata

    from ipc.protocol import PROTOCOL_REVISION

    try:
        version = metadata.version("ringleader")
    except metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    return f"ringleader {version} (wire protocol revision {PROTOCOL_REVISION})"


LONG_RUNNING = ("serve", "gateway")  # log at info by default (one line per request, the stop)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] == ["bench"]:
        logging.basicConfig(level="WARNING")
        return cmd_bench(None, argv[1:])
    args = parser.parse_args(argv)
    level = args.log_level or ("INFO" if args.command in LONG_RUNNING else "WARNING")
    output = None
    if args.command in LONG_RUNNING:
        from hostctl.log_output import LogOutput

        output = LogOutput(level)  # a stalled stderr must not stall the server
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers = {
        "serve": cmd_serve,
        "gateway": cmd_gateway,
        "generate": cmd_generate,
        "stats": cmd_stats,
        "wait-ready": cmd_wait_ready,
        "build-kernel": cmd_build_kernel,
        "doctor": cmd_doctor,
        "keygen": cmd_keygen,
    }
    try:
        return handlers[args.command](args)
    except CurveError as exc:  # the message names the option or file
        print(f"ringleader: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a handler of its own took over
        print(file=sys.stderr)
        return 130
    finally:
        if output is not None:
            output.stop()


if __name__ == "__main__":
    sys.exit(main())
