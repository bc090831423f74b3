"""What a replica's failure costs on the Ray Serve app (hostctl/ray_serve), on a local Ray: with
--streams streams running on two engine replicas, one engine is killed (SIGKILL) and three times
are taken, from the kill:

- to each of the victim's streams ending with its one error event (what its clients wait);
- to a request whose prompt prefix the victim held answering 200 (prefix affinity sends it to
  the victim first: its replica refuses, and the ingress sends it again elsewhere);
- to a new replica answering (Ray's health check fails, Ray replaces the replica, whose engine
  loads its model).

Repeated --repeats times on one app, each kill on the replica that served the first stream.

    python -m ringleader.bench.lab.ray_failover --json bench/results/<date>-cpu-ray-serve/failover.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray
from ray import serve

from ringleader.bench.report import environment, save_json
from ringleader.bench.servers import free_port
from ringleader.hostctl.ray_serve.app import build_app
from ringleader.hostctl.ray_serve.ingress import REPLICA_HEADER

PREFIX = "Story {i}: " + "once upon a time there was a ring. " * 4


def _post(port: int, body: dict, timeout: float = 120.0) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    return response.status, response.headers.get(REPLICA_HEADER, ""), raw


def _engine_pid(replica: str) -> int:
    """The `ringleader serve` process whose socket is named for `replica`."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(f"/{replica}.sock".encode()) for arg in argv):
            return int(proc.name)
    raise LookupError(f"no engine for replica {replica}")


class _Stream(threading.Thread):
    """One streamed completion; `ended` is when its last byte came, `error` whether an error
    event ended it."""

    def __init__(self, port: int, i: int, max_tokens: int):
        super().__init__(daemon=True)
        self.port, self.i, self.max_tokens = port, i, max_tokens
        self.replica = ""
        self.started = threading.Event()
        self.ended: float | None = None
        self.error = False

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        body = {
            "prompt": PREFIX.format(i=self.i),
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        self.replica = response.headers.get(REPLICA_HEADER, "")
        response.readline()  # the first event: tokens flow
        self.started.set()
        raw = response.read()
        self.ended = time.monotonic()
        self.error = b'"error"' in raw


def _one_kill(port: int, streams: int, max_tokens: int) -> dict:
    running = [_Stream(port, i, max_tokens) for i in range(streams)]
    for s in running:
        s.start()
    for s in running:
        if not s.started.wait(120):
            raise TimeoutError("a stream did not start")
    victim = running[0].replica
    seen_before = {s.replica for s in running}
    killed = time.monotonic()
    os.kill(_engine_pid(victim), signal.SIGKILL)
    # a request the victim's prefix cache would have served: the retry path
    status, served_by, raw = _post(port, {"prompt": PREFIX.format(i=0) + " The end.", "max_tokens": 4})
    resent_s = time.monotonic() - killed
    if status != 200:
        raise RuntimeError(f"the resent request failed: {status} {raw[:200]!r}")
    for s in running:
        s.join(300)
    cut = [s.ended - killed for s in running if s.replica == victim and s.error and s.ended is not None]
    whole_on_others = sum(1 for s in running if s.replica != victim and not s.error)
    deadline = time.monotonic() + 180
    replaced_s = None
    while time.monotonic() < deadline:
        status, served_by, _ = _post(port, {"prompt": f"probe {time.monotonic()}", "max_tokens": 2})
        if status == 200 and served_by not in seen_before:
            replaced_s = time.monotonic() - killed
            break
        time.sleep(0.05)
    return {
        "victim": victim,
        "victim_streams_cut": len(cut),
        "other_streams_whole": whole_on_others,
        "kill_to_stream_error_s": sorted(cut),
        "kill_to_resent_request_answered_s": resent_s,
        "resent_request_served_by_victim": served_by == victim,
        "kill_to_new_replica_answering_s": replaced_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--health-check-period", type=float, default=2.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    port = free_port()
    app_args = {
        "model": args.model,
        "device": "cpu",
        "threads": 1,
        "max-ctx": 1024,
        "replicas": 2,
        "routing": "prefix",
        "health_check_period_s": args.health_check_period,
    }
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    runs = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args), name="ringleader", route_prefix="/")
        for repeat in range(args.repeats):
            run = _one_kill(port, args.streams, args.max_tokens)
            runs.append(run)
            cut = run["kill_to_stream_error_s"]
            print(
                f"kill {repeat + 1}: {run['victim_streams_cut']} streams cut, ended {min(cut) * 1e3:.0f}.."
                f"{max(cut) * 1e3:.0f} ms after the kill; resent request answered in "
                f"{run['kill_to_resent_request_answered_s'] * 1e3:.0f} ms; a new replica answered "
                f"{run['kill_to_new_replica_answering_s']:.1f} s after the kill",
                flush=True,
            )
    finally:
        serve.shutdown()
        ray.shutdown()
    cut_all = [t for run in runs for t in run["kill_to_stream_error_s"]]
    summary = {
        "kill_to_stream_error_ms_p50": statistics.median(cut_all) * 1e3 if cut_all else None,
        "kill_to_stream_error_ms_max": max(cut_all) * 1e3 if cut_all else None,
        "kill_to_resent_answered_ms_median": statistics.median(
            r["kill_to_resent_request_answered_s"] for r in runs
        )
        * 1e3,
        "kill_to_new_replica_s_median": statistics.median(r["kill_to_new_replica_answering_s"] for r in runs),
    }
    print(json.dumps(summary, indent=1))
    if args.json is not None:
        record = {
            "environment": environment(),
            "args": vars(args) | {"json": str(args.json)},
            "app": app_args,
        }
        save_json(record | {"runs": runs, "summary": summary}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
