"""The servers under test: which variants to run, and a `ringleader serve` subprocess per variant.

Variants (`--compare`):
- device: the product, `--scheduler device` (persistent scheduler kernel; CUDA only).
- host:   `--scheduler host`, the scheduler on a host thread (the only placement of the CPU
          backend, which gets no `--scheduler` flag and schedules on its engine thread).
- static: `--policy static`, classic static batching: a batch is admitted only when the
          previous one has fully drained. It keeps the server's default placement (device on
          CUDA, host thread on CPU).
- hf:     transformers' continuous batching (the engine of `generate_batch`) on the same model
          and workload, in this process (bench/hf_baseline.py); on the CPU and on CUDA.
- gateway: one server (the default placement, fifo) started with `--http 127.0.0.1:<port>`, its
          OpenAI-compatible gateway in the same process; every load point runs twice against
          it, back to back: `native` over ZeroMQ (bench/loadgen.py), then `gateway` over HTTP
          (bench/http_loadgen.py), and the report shows what the gateway adds.
- clients: one such server, every load point run through each client a user links, back to
          back: the C client (clients/c's ringleader-c-bench), the bundled sync Client and
          AsyncClient, the raw pyzmq generator and the HTTP gateway (bench/client_loadgens.py);
          closed loop only, prefix caching off (the passes send the same prompts). With `--model null` it is the default: the runtime's own cost.

With `--shared-prefix-len` every server variant runs as two arms (prefix_arms), one server each,
started one after the other: `<name>/prefix-on` with `serve --prefix-caching` and
`<name>/prefix-off` with `serve --no-prefix-caching` (hf runs once: it has no prefix cache).

A server is `python -m ringleader.hostctl.cli serve ... --bind tcp://127.0.0.1:<free port>` (`--model` as
given: a preset, a checkpoint directory or a .gguf file), ready when it answers `ping` (and,
with an HTTP gateway, when GET /health answers 200). It is stopped with SIGTERM (then SIGKILL) in a finally block, and an atexit hook
stops any that are left, so no server outlives the benchmark.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

from ringleader.bench.loadgen import read_stats, timeline_after_seq, wait_ready
from ringleader.device.engine_config import (
    WEIGHTS,
    EngineConfig,
    resolve_device,  # noqa: F401 - the bench's name for the server's rule
)
from ringleader.hostctl.commands.serve_flags import serve_flags

VARIANTS = ("device", "host", "static", "hf", "gateway", "clients")
# a .gguf is dequantized while the server starts: SmolLM2-135M takes ~20 s on 2 CPU cores
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0


# `ringleader serve`'s flags for the arms of the prefix-caching comparison, and their names
PREFIX_CACHING_FLAGS = {True: ("--prefix-caching",), False: ("--no-prefix-caching",)}
PREFIX_ARM_NAMES = {True: "prefix-on", False: "prefix-off"}


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "server", "hf" or "gateway" (a server with its HTTP gateway: native and gateway runs)
    server_args: tuple[str, ...] = ()
    prefix_caching: bool | None = None  # an arm of the prefix-caching comparison: on or off
    base: str | None = None  # the --compare variant this is an arm of (None: not an arm)

    @property
    def variant(self) -> str:
        """The --compare variant it runs (its own name, or the one it is an arm of)."""
        return self.base or self.name


@dataclass
class ServerOptions:
    """Flags of `ringleader serve` shared by every variant of one invocation."""

    model: str = EngineConfig.model
    device: str = "cpu"  # already resolved: cpu or cuda
    launch: str | None = None
    slots: int | None = None
    max_ctx: int | None = None
    token_budget: int | None = None
    threads: int | None = None
    weights_seed: int | None = None
    max_queue: int | None = None
    extra: list[str] = field(default_factory=list)

    def args(self) -> list[str]:
        out = serve_flags(
            model=self.model,
            device=self.device,
            launch=self.launch,
            n_slots=self.slots,
            max_ctx=self.max_ctx,
            token_budget=self.token_budget,
            threads=self.threads,
            seed=self.weights_seed,
            max_queued=self.max_queue,  # ServerConfig's; the rest are EngineConfig's
        )
        return out + list(self.extra)


def plan_variants(names: list[str], device: str) -> tuple[list[Variant], list[str]]:
    """The variants that can run on `device`, and a note for each one skipped. A server variant
    may name how its server keeps the weights: host:quantized is host with `--weights quantized`
    (so several weight forms run side by side in one invocation)."""
    variants, notes = [], []
    for given in names:
        name, _, weights = given.partition(":")
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {given!r}; --compare takes a list of {', '.join(VARIANTS)}")
        if weights and (name == "hf" or weights not in WEIGHTS):
            raise ValueError(
                f"variant {given!r}: a server variant takes :WEIGHTS, one of {', '.join(WEIGHTS)} "
                "(hf widens a GGUF file to fp32 itself)"
            )
        if any(v.name == given for v in variants):
            continue
        planned, skipped = _plan_variant(name, device)
        notes += skipped
        if planned is not None and weights:
            planned = Variant(given, planned.kind, planned.server_args + ("--weights", weights))
        if planned is not None:
            variants.append(planned)
    return variants, notes


def _plan_variant(name: str, device: str) -> tuple[Variant | None, list[str]]:
    """One --compare variant on `device`, or None and the note that says why it is skipped."""
    if name == "device":
        if device != "cuda":
            return None, [
                "skipping 'device': the CPU backend has no device-side scheduler "
                "(--scheduler device needs CUDA); its scheduler runs on a host thread, "
                "which is the 'host' variant"
            ]
        return Variant("device", "server", ("--scheduler", "device", "--policy", "fifo")), []
    if name == "host":
        args = ("--scheduler", "host") if device == "cuda" else ()
        return Variant("host", "server", args + ("--policy", "fifo")), []
    if name == "static":
        return Variant("static", "server", ("--policy", "static")), []
    if name == "hf":
        return Variant("hf", "hf"), []
    if name == "clients":  # a gateway server (the HTTP pass needs it); no prefix cache, so
        # every pass does the same work on the same prompts, whichever ran before it
        return Variant("clients", "clients", ("--policy", "fifo", "--no-prefix-caching")), []
    return Variant("gateway", "gateway", ("--policy", "fifo")), []


def prefix_arms(variants: list[Variant], off_first: bool = False) -> list[Variant]:
    """Each server variant as its two arms, prefix caching on then off (or off then on), back to
    back (the variants run one after another; the arms of one variant next to each other); hf as
    it is."""
    out = []
    for v in variants:
        if v.kind != "server":
            out.append(v)
            continue
        for on in (False, True) if off_first else (True, False):
            out.append(
                Variant(
                    f"{v.name}/{PREFIX_ARM_NAMES[on]}",
                    v.kind,
                    v.server_args + PREFIX_CACHING_FLAGS[on],
                    prefix_caching=on,
                    base=v.name,
                )
            )
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    pass


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 is never proxied


def http_healthy(url: str, timeout: float = 2.0) -> bool:
    """True when GET {url}/health answers 200."""
    try:
        with _NO_PROXY.open(url + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, ValueError):  # refused, reset, HTTP errors (URLError and HTTPError are OSErrors)
        return False


_live: set[ServerProcess] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        server.stop()


class ServerProcess:
    """`with ServerProcess(args) as srv:` starts `ringleader serve`, waits for ping, stops it.

    With `http=True` the server also runs its OpenAI-compatible gateway (`--http
    127.0.0.1:<free port>`); `http_url` is then its base URL, and start() also waits until
    GET /health answers 200."""

    def __init__(
        self, serve_args: list[str], *, startup_timeout_s: float = STARTUP_TIMEOUT_S, http: bool = False
    ):
        self.serve_args = list(serve_args)
        self.startup_timeout_s = startup_timeout_s
        self.http = http
        self.http_url: str | None = None
        self.address: str | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "ringleader.hostctl.cli",
            "serve",
            *self.serve_args,
            "--bind",
            self.address,
        ]
        if self.http_url:
            cmd += ["--http", self.http_url.removeprefix("http://")]
        return cmd

    def start(self) -> str:
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.http_url = f"http://127.0.0.1:{free_port()}" if self.http else None
        self._log = tempfile.TemporaryFile(mode="w+b", prefix="ringleader-bench-server-")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _live.add(self)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.output_tail()
                self.stop()
                raise ServerError(
                    f"server exited with code {self.proc.returncode} while starting:\n"
                    f"$ {' '.join(self.command)}\n{out}"
                )
            if wait_ready(self.address, timeout=min(1.0, max(0.1, deadline - time.monotonic()))):
                if not self.http_url or http_healthy(self.http_url):
                    return self.address
                time.sleep(0.1)
        out = self.output_tail()
        self.stop()
        what = "answer ping" + (f" and GET {self.http_url}/health" if self.http_url else "")
        raise ServerError(
            f"server did not {what} within {self.startup_timeout_s:.0f} s:\n$ {' '.join(self.command)}\n{out}"
        )

    def stats(self) -> dict:
        return read_stats(self.address)

    def output_tail(self, limit: int = 4000) -> str:
        if self._log is None:
            return ""
        try:
            self._log.flush()
            self._log.seek(0, os.SEEK_END)
            size = self._log.tell()
            self._log.seek(max(0, size - limit))
            return self._log.read().decode("utf-8", errors="replace")
        except (OSError, ValueError):
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait, SIGKILL if it does not exit; returns the exit code."""
        proc = self.proc
        _live.discard(self)
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        return proc.returncode

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def cpu_deltas(before: dict, after: dict) -> dict:
    """Server CPU over a run from two `stats` replies: whole process and per thread, and tokens."""
    out_tokens = _num(after.get("output_tokens")) - _num(before.get("output_tokens"))
    proc = None
    if before.get("process_cpu_s") is not None and after.get("process_cpu_s") is not None:
        proc = float(after["process_cpu_s"]) - float(before["process_cpu_s"])
    threads = {}
    tb, ta = before.get("thread_cpu_s") or {}, after.get("thread_cpu_s") or {}
    for name in ta:
        if name in tb and ta[name] is not None and tb[name] is not None:
            threads[name] = float(ta[name]) - float(tb[name])
    per_1k = (lambda s: s / (out_tokens / 1000.0)) if out_tokens > 0 else (lambda s: None)
    return {
        "server_output_tokens": out_tokens,
        "process_cpu_s": proc,
        "cpu_s_per_1k_tokens": per_1k(proc) if proc is not None else None,
        "thread_cpu_s": threads,
        "thread_cpu_s_per_1k_tokens": {k: per_1k(v) for k, v in threads.items()},
    }


DEVICE_COUNTERS = ("steps", "step_tokens", "generated", "admitted", "finished", "idle_polls", "cq_stalls")
DEVICE_TIMINGS = (
    "bubble_us_p50",
    "bubble_us_p99",
    "bubble_gaps",
    "idle_gaps",
    "overlap_overruns",
    "void_steps",
    "step_us_p50",
    "step_us_p99",
    "device_sched_us_p50",
    "device_sched_us_p99",
    "device_overlap_us_p50",
    "device_overlap_us_p99",
    "handoff_us_p50",
    "launch_us_p50",
    "sched_critical_us_p50",
    "sched_critical_us_p99",
    "sched_overlapped_us_p50",
    "sched_overlapped_us_p99",
    "sched_step_us_p50",
    "sched_step_us_p99",
    "model_step_us_p50",
    "model_step_us_p99",
)


def device_deltas(before: dict, after: dict) -> dict:
    """The backend's counters over the run, and its step timings as of the end of the run.

    The device timeline's figures (CUDA: bubble_*, step_us_*, device_sched_*, ...) cover the
    run's own steps: `after` was read with timeline_after_seq = the `steps` counter of `before`
    (loadgen.timeline_after_seq), recorded here with `timeline_steps`, the rows they summarise;
    fewer than `steps` (the counter's delta) means the trace ring (trace_len rows) no longer held
    the run's first steps, so the figures are its last timeline_steps steps'. The other timings
    are the backend's own percentiles over its recent passes (the CPU backend keeps the last
    4096), so for long runs they describe the end of the run. Absent keys stay absent.
    """
    db, da = before.get("device") or {}, after.get("device") or {}
    out: dict = {}
    for key in DEVICE_COUNTERS:
        if isinstance(da.get(key), (int, float)) and isinstance(db.get(key), (int, float)):
            out[key] = da[key] - db[key]
    if out.get("steps"):
        out["tokens_per_step"] = out.get("step_tokens", 0) / out["steps"]
        out["generated_per_step"] = out.get("generated", 0) / out["steps"]
    for key in DEVICE_TIMINGS:
        if da.get(key) is not None:
            out[key] = float(da[key])
    if isinstance(da.get("timeline_steps"), int):
        out["timeline_steps"] = da["timeline_steps"]
        out["timeline_after_seq"] = timeline_after_seq(before)
    return out


PREFIX_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits")


def prefix_cache_deltas(before: dict, after: dict) -> dict:
    """The server's prefix-cache counters over a run (prompt tokens looked up, prompt tokens found
    and not prefilled) and hits / queries; each None when a `stats` reply lacks it (a server
    without prefix caching, an HTTP endpoint, hf) or the run looked nothing up. A counter is read
    from the top of the reply, else from its `device` part."""
    out: dict = {}
    for key in PREFIX_COUNTERS:
        b, a = _counter(before, key), _counter(after, key)
        out[key] = a - b if a is not None and b is not None else None
    queries, hits = out["prefix_cache_queries"], out["prefix_cache_hits"]
    out["prefix_cache_hit_rate"] = hits / queries if hits is not None and queries else None
    return out


# the scheduler's speculative-decoding counters (ipc/counters.py): verification steps in which a
# request had a draft, draft tokens proposed, draft tokens accepted
SPEC_COUNTERS = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")


def spec_decode_deltas(before: dict, after: dict) -> dict:
    """The server's speculative-decoding counters over a run, spec_acceptance_rate = accepted /
    draft tokens and spec_accepted_per_draft = accepted / drafts. Each None when a `stats` reply
    lacks it (a server without speculative decoding, an HTTP endpoint, hf); the ratios also when
    the run drafted nothing (a server with `--speculative off`). A counter is read from the top
    of the reply, else from its `device` part."""
    out: dict = {}
    for key in SPEC_COUNTERS:
        b, a = _counter(before, key), _counter(after, key)
        out[key] = a - b if a is not None and b is not None else None
    drafts, proposed, accepted = (out[k] for k in SPEC_COUNTERS)
    out["spec_acceptance_rate"] = accepted / proposed if accepted is not None and proposed else None
    out["spec_accepted_per_draft"] = accepted / drafts if accepted is not None and drafts else None
    return out


def _counter(stats: dict, key: str) -> int | float | None:
    for where in (stats, stats.get("device") or {}):
        v = where.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else 0.0
