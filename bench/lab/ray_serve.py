"""What Ray Serve costs and what its replicas give, on this machine: the Ray Serve app
(hostctl/ray_serve: Ray's HTTP proxy -> OpenAIIngress -> a deployment handle -> EngineReplica ->
its engine over ZeroMQ) against the gateway (`serve --http`: HTTP and the engine in one process),
driven by the bench's HTTP load generator with one workload (random prompts of --prompt-tokens,
--output-tokens out, ignore_eos, greedy; closed loop).

1. Proxy overhead, one engine: one `serve --http` process; the Ray app with 1 replica attached
   to that same engine (`engine_address`), so both paths reach the same engine.  Runs alternate
   gateway, Ray, gateway, Ray, ... (--repeats each) at --concurrency and at 1.  The added latency
   of Ray's path is the median over repeats of (Ray - gateway) of TTFT p50, ITL p50 and E2E p50.
2. Replicas: the Ray app with 1 engine replica, then with 2 (each its own engine), routing
   `pow2` (distinct prompts: nothing to route by prefix), at --concurrency; and one engine with
   as many threads as the machine has cores, the single-engine use of the same cores.  The
   replica that served each timed request is read from the X-Ringleader-Replica header of its
   reply (the load generator's own responses, during the timed run).

Every engine is `serve` with --device cpu, --threads from --threads (1 by default: on 2 cores,
2 engines of 1 thread each use the cores once), --no-prefix-caching (every run sends the same
prompts; a cache would make later runs cheaper), the server's defaults otherwise.

    python -m ringleader.bench.lab.ray_serve --model $(python -m ringleader.bench.smollm2 | tail -1) \\
        --json bench/results/<date>-cpu-ray-serve/ray_serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray
from ray import serve

from ringleader.bench.http_loadgen import HttpLoadGenerator, connections_for, list_models
from ringleader.bench.loadgen import Load, SendOptions, wait_ready
from ringleader.bench.metrics import run_metrics
from ringleader.bench.report import environment, save_json
from ringleader.bench.servers import free_port
from ringleader.bench.workloads import RequestSpec, WorkloadConfig, make_requests, prompt_id_range_for
from ringleader.hostctl.ray_serve.app import build_app
from ringleader.hostctl.ray_serve.args import RayServeArgs
from ringleader.hostctl.ray_serve.ingress import REPLICA_HEADER

APP = "ringleader"
START_TIMEOUT_S = 300.0  # an engine loads its model, Ray starts its actors
RUN_TIMEOUT_S = 1800.0  # one measured run
LATENCY_KEYS = (("ttft_ms", "p50"), ("itl_ms", "p50"), ("e2e_ms", "p50"))


class _ReplicaCounting(HttpLoadGenerator):
    """The HTTP load generator, also counting the X-Ringleader-Replica header of each streamed
    reply of its latest run (the warm-up's counts are dropped when the timed run starts)."""

    replicas: Counter

    async def run(self, specs: list[RequestSpec], load: Load):
        self.replicas = Counter()
        return await super().run(specs, load)

    async def _read_stream(self, rec, resp) -> None:
        self.replicas[resp.headers.get(REPLICA_HEADER, "none")] += 1
        await super()._read_stream(rec, resp)


def _measure(url: str, specs: list[RequestSpec], load: Load, warmup: list[RequestSpec]) -> dict:
    async def go():
        async with _ReplicaCounting(
            url,
            connections=connections_for(load, len(specs)),
            timeout_s=RUN_TIMEOUT_S,
            options=SendOptions(temperature=0.0, ignore_eos=True),
        ) as gen:
            return await gen.measure(specs, load, warmup), gen.replicas

    result, replicas = asyncio.run(go())
    m = run_metrics(result.records)
    pick = ("p50", "p90", "p99", "mean")
    return {
        "completed": m["completed"],
        "failed": m["failed"],
        "errors": m["errors"],
        "warmup_failed": result.warmup_failed,
        "duration_s": m["duration_s"],
        "output_tokens": m["output_tokens"],
        "output_tokens_per_s": m["output_tokens_per_s"],
        **{k: {q: m[k][q] for q in pick} for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")},
        "loadgen_cpu_frac": result.loadgen_cpu_s / result.wall_s if result.wall_s > 0 else None,
        "token_count": result.token_count,
        "served_by": dict(sorted(replicas.items())),
    }


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    why: object = "no model listed"
    while True:
        try:
            if list_models(url):
                return
        except Exception as exc:  # not up yet
            why = exc
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/v1/models did not answer within {timeout_s:g} s: {why}")
        time.sleep(0.5)


class _Gateway:
    """`serve --http`: the engine and the OpenAI gateway in one process (ours, ended by pid)."""

    def __init__(self, engine_argv: list[str], log_dir: str):
        self.zmq = f"tcp://127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = Path(log_dir) / "serve.log"
        argv = [sys.executable, "-m", "ringleader.hostctl.cli", "serve", *engine_argv]
        argv += ["--bind", self.zmq, "--http", self.url.removeprefix("http://")]
        self.argv = argv
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def wait(self) -> None:
        try:
            if not wait_ready(self.zmq, START_TIMEOUT_S):
                raise TimeoutError(f"serve did not answer on {self.zmq} within {START_TIMEOUT_S:g} s")
            _wait_http(self.url, 60.0, self.proc)
        except Exception:
            print(self.log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _deploy(port: int, options: dict) -> str:
    serve.delete(APP)  # the previous app's engines end before the next ones start
    serve.run(build_app(options), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    _wait_http(url, 60.0)
    return url


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _proxy_summary(runs: list[dict], concurrencies: list[int]) -> dict:
    out = {}
    for c in concurrencies:
        by_path = {
            path: [r for r in runs if r["phase"] == "proxy" and r["path"] == path and r["concurrency"] == c]
            for path in ("gateway", "ray")
        }
        entry: dict = {}
        for path, rs in by_path.items():
            entry[path] = {"output_tokens_per_s": _median([r["output_tokens_per_s"] for r in rs])}
            for key, q in (*LATENCY_KEYS, ("ttft_ms", "p99")):
                entry[path][f"{key[:-3]}_{q}_ms"] = _median([r[key][q] for r in rs])
        added = {}
        for key, q in LATENCY_KEYS:
            diffs = [r[key][q] - g[key][q] for g, r in zip(by_path["gateway"], by_path["ray"])]
            added[f"{key[:-3]}_{q}_ms"] = {"median": _median(diffs), "each": diffs}
        entry["ray_added"] = added
        out[f"c={c}"] = entry
    return out


def _row(label: str, r: dict) -> str:
    def f(x, fmt="{:9.1f}"):
        return fmt.format(x) if x is not None else f"{'-':>9}"

    served = ",".join(str(n) for n in r["served_by"].values()) if r["path"] == "ray" else "-"
    return (
        f"{label:<26}{r['concurrency']:>3}{f(r['output_tokens_per_s'])}{f(r['ttft_ms']['p50'])}"
        f"{f(r['ttft_ms']['p99'])}{f(r['itl_ms']['p50'])}{f(r['e2e_ms']['p50'])}"
        f"{r['completed']:>5}/{r['failed']:<3} {served}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=64, help="per run at --concurrency")
    p.add_argument("--requests-c1", type=int, default=16, help="per run at concurrency 1")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="runs of each path in part 1")
    p.add_argument("--warmup", type=int, default=4, help="requests (8 tokens out) before each run")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every engine")
    p.add_argument("--skip-replicas", action="store_true", help="part 1 only")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    ncpu = os.cpu_count() or 1
    ids = prompt_id_range_for(args.model)

    def workload(n: int, out: int, seed: int) -> list[RequestSpec]:
        cfg = WorkloadConfig(n, args.prompt_tokens, out, seed=seed, prompt_id_range=ids)
        return make_requests(cfg)

    specs = {args.concurrency: workload(args.requests, args.output_tokens, 0)}
    specs[1] = workload(args.requests_c1, args.output_tokens, 0)
    warm = workload(args.warmup, 8, 1)
    engine = {"model": args.model, "device": "cpu", "threads": args.threads, "prefix-caching": False}
    runs: list[dict] = []
    gateway_argv: list[str] = []

    def record(label: str, phase: str, path: str, c: int, **extra) -> dict:
        t0, load1 = time.monotonic(), os.getloadavg()[0]
        r = _measure(urls[path], specs[c], Load(concurrency=c), warm)
        r = {"phase": phase, "path": path, "concurrency": c, **extra, **r}
        r |= {"started": time.strftime("%H:%M:%S", time.localtime(time.time() - r["duration_s"]))}
        r["loadavg_1m_before"] = load1
        runs.append(r)
        print(_row(label, r), f"({time.monotonic() - t0:.0f} s)", flush=True)
        return r

    header = f"{'run':<26}{'c':>3}{'tok/s':>9}{'TTFT p50':>9}{'TTFT p99':>9}{'ITL p50':>9}"
    header += f"{'E2E p50':>9}{'ok/fail':>9} served by replica"
    print(header, flush=True)
    concurrencies = list(dict.fromkeys((args.concurrency, 1)))
    gateway = None
    ray_port = free_port()
    urls: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="rl-bench-ray-") as log_dir:
        try:
            gateway = _Gateway(RayServeArgs.from_dict(engine).engine_argv(), log_dir)
            gateway_argv = gateway.argv
            # a Ray instance of its own ("local"), never one that another program started here
            ray.init(address="local", num_cpus=ncpu, include_dashboard=False, log_to_driver=False)
            serve.start(http_options={"host": "127.0.0.1", "port": ray_port})
            gateway.wait()
            urls["gateway"] = gateway.url
            one_engine = {**engine, "replicas": 1, "routing": "pow2", "engine_address": gateway.zmq}
            urls["ray"] = _deploy(ray_port, one_engine)
            for c in concurrencies:
                for rep in range(args.repeats):
                    for path in ("gateway", "ray"):
                        record(f"{path} #{rep}", "proxy", path, c, repeat=rep)
            gateway.stop()
            if not args.skip_replicas:
                configs = [(1, args.threads), (2, args.threads)]
                if ncpu != args.threads:
                    configs.append((1, ncpu))
                for n, threads in configs:
                    opts = {**engine, "threads": threads, "replicas": n, "routing": "pow2"}
                    opts["engine_start_timeout_s"] = START_TIMEOUT_S
                    urls["ray"] = _deploy(ray_port, opts)
                    label = f"ray {n} replica{'s' if n > 1 else ''} x {threads} thr"
                    record(label, "replicas", "ray", args.concurrency, replicas=n, threads=threads)
        finally:
            if gateway is not None:
                gateway.stop()
            if ray.is_initialized():
                try:
                    serve.shutdown()
                finally:
                    ray.shutdown()

    summary = _proxy_summary(runs, concurrencies)
    print("\nRay's path minus the gateway's (median over repeats, ms):")
    for c in concurrencies:
        added = summary[f"c={c}"]["ray_added"]
        print(
            f"  c={c}: "
            + ", ".join(
                f"{k} {v['median']:+.1f}" if v["median"] is not None else f"{k} -" for k, v in added.items()
            )
        )
    if args.json:
        env = environment()
        env["ray"] = ray.__version__
        save_json(
            {
                "schema": "ringleader-bench-ray-serve/1",
                "command": [sys.executable, "-m", "ringleader.bench.lab.ray_serve", *(argv or sys.argv[1:])],
                "environment": env,
                "model": args.model,
                "settings": vars(args) | {"json": str(args.json)},
                "workload": {
                    "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens,
                    "requests": {str(args.concurrency): args.requests, "1": args.requests_c1},
                    "warmup_requests": args.warmup,
                    "prompt_id_range": list(ids),
                    "ignore_eos": True,
                    "temperature": 0.0,
                },
                "engine": engine,
                "gateway_command": gateway_argv,
                "proxy_overhead": summary,
                "runs": runs,
            },
            args.json,
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
