"""`ringleader bench --model null` and `--compare clients`: the null model's defaults, the options
refused with it, each client's load generator against a real server on 127.0.0.1 (the bundled
sync and async clients here; the C client's when it is built), and the client table end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringleader.bench import cli
from ringleader.bench.client_loadgens import (
    ClientUnavailable,
    c_bench_binary,
    measure_c,
    measure_python_async,
    measure_python_sync,
)
from ringleader.bench.loadgen import Load, SendOptions
from ringleader.bench.options import NULL_MODEL_REQUESTS, apply_model_defaults, check_options
from ringleader.bench.workloads import RequestSpec
from tests.conftest import REQUIRE_FETCHED, running_server

REPO = Path(__file__).resolve().parents[1]


def _args(*argv: str):
    args = cli.build_parser().parse_args(list(argv))
    apply_model_defaults(args)
    return args


def test_the_null_model_defaults_fill_only_what_was_not_given():
    args = _args("--model", "null")
    assert args.compare == ["clients"] and args.concurrency == [1, 256] and args.slots == 256
    assert args.requests == NULL_MODEL_REQUESTS
    args = _args("--model", "null", "--concurrency", "4", "--slots", "8", "--compare", "host")
    assert args.compare == ["host"] and args.concurrency == [4] and args.slots == 8 and args.requests == 48
    args = _args("--model", "null", "--request-rate", "5")  # an open loop keeps its own loads
    assert args.concurrency is None and args.compare == ["clients"]
    assert any("closed loop only" in p for p in check_options(args))
    assert _args("--model", "tiny").compare is None and _args("--model", "tiny").requests == 48
    assert any("--c-bench goes with --compare clients" in p for p in check_options(_args("--c-bench", "x")))


SPECS = [RequestSpec([5 + i, 40, 41], 6 + i % 3) for i in range(10)]


def _null_pattern(spec: RequestSpec) -> int:
    return spec.max_tokens  # the next pattern never stops early: every request runs to max_tokens


@pytest.mark.parametrize("measure", [measure_python_sync, measure_python_async], ids=["sync", "async"])
def test_a_bundled_client_runs_a_closed_loop(measure):
    with running_server("null") as bg:
        result = measure(bg.address, SPECS, Load(concurrency=3), warmup=SPECS[:2], options=SendOptions())
    assert [r.ok for r in result.records] == [True] * len(SPECS)
    assert [r.output_tokens for r in result.records] == [_null_pattern(s) for s in SPECS]
    assert all(r.send_t < r.chunk_t[0] <= r.done_t for r in result.records)
    assert result.stats_after["output_tokens"] > result.stats_before["output_tokens"]
    assert result.loadgen_cpu_s > 0 and result.warmup_failed == 0


def test_the_client_generators_refuse_an_open_loop():
    with pytest.raises(ClientUnavailable, match="closed loop only"):
        measure_python_sync("tcp://127.0.0.1:1", SPECS, Load(request_rate=5.0, arrival_s=[0.0] * 10))


def _c_bench() -> Path:
    try:
        return c_bench_binary()
    except ClientUnavailable as exc:
        if os.environ.get(REQUIRE_FETCHED):
            raise
        pytest.skip(str(exc))


def test_the_c_client_runs_a_closed_loop():
    binary = _c_bench()
    with running_server("null") as bg:
        result = measure_c(bg.address, SPECS, Load(concurrency=4), warmup=SPECS[:3], binary=binary)
    assert [r.ok for r in result.records] == [True] * len(SPECS)
    assert [r.output_tokens for r in result.records] == [_null_pattern(s) for s in SPECS]
    assert [r.completion_tokens for r in result.records] == [s.max_tokens for s in SPECS]
    assert all(r.send_t < r.chunk_t[0] <= r.done_t for r in result.records)
    assert result.loadgen_cpu_s > 0


def test_bench_model_null_end_to_end(tmp_path):
    """`ringleader bench --model null`: one server, every client at each load, and the client
    table in the JSON, the summary and the console."""
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "ringleader.hostctl.cli", "bench", "--model", "null", "--concurrency", "1,4"]
    cmd += ["--requests", "6,12", "--input-len", "8", "--output-len", "8", "--warmup", "1", "--no-plots"]
    cmd += ["--out", str(out), "--server-arg=--null-step-us", "--server-arg=50"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    rows = doc["client_costs"]
    clients = {r["client"] for r in rows}
    assert {"python-sync", "python-async", "pyzmq-raw", "http"} <= clients
    if os.environ.get(REQUIRE_FETCHED):  # CI builds the C client: its row must be there
        assert "c" in clients
    assert all(r["completed"] == (6 if r["concurrency"] == 1 else 12) and r["failed"] == 0 for r in rows)
    for r in rows:
        assert r["model_step_us_p50"] >= 50.0  # --null-step-us reached the server
        assert r["tpot_less_model_us_p50"] == pytest.approx(
            r["tpot_ms"]["p50"] * 1e3 - r["model_step_us_p50"]
        )
    assert doc["runs"][0]["backend"]["null_step_us"] == 50.0
    assert "## clients" in (out / "summary.md").read_text()
    assert "TPOT-model p50 us" in proc.stdout
