"""`ringleader bench`: end-to-end runs against real servers on 127.0.0.1, and the math under it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench import cli
from bench.metrics import RequestRecord, run_metrics, summarize
from bench.servers import ServerError, ServerProcess, cpu_deltas, plan_variants
from bench.workloads import (
    WorkloadConfig,
    arrival_times,
    fit_context,
    gamma_gaps,
    make_requests,
    sample_lengths,
)

STAT_KEYS = ("mean", "p50", "p90", "p99")
RUN_KEYS = (
    "scheduler",
    "device",
    "model",
    "concurrency",
    "request_rate",
    "completed",
    "failed",
    "output_tokens_per_s",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "cpu_s_per_1k_tokens",
)


# ---------------------------------------------------------------- end to end


def test_compare_host_static_closed_loop(tmp_path):
    out = tmp_path / "res"
    rc = cli.main(
        [
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--compare",
            "host,static",
            "--concurrency",
            "1,4",
            "--requests",
            "8",
            "--input-len",
            "8",
            "--output-len",
            "8",
            "--ignore-eos",
            "--warmup",
            "2",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["device"] == "cpu" and doc["model"] == "tiny"
    assert doc["environment"]["git"]["commit"]
    assert doc["settings"]["requests"] == 8 and doc["settings"]["ignore_eos"] is True
    runs = doc["runs"]
    assert {(r["scheduler"], r["concurrency"]) for r in runs} == {
        ("host", 1),
        ("host", 4),
        ("static", 1),
        ("static", 4),
    }
    for r in runs:
        for key in RUN_KEYS:
            assert key in r, key
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(STAT_KEYS) <= set(r[key]) and all(r[key][k] is not None for k in STAT_KEYS)
        assert r["request_rate"] is None
        assert r["completed"] == 8 and r["failed"] == 0
        assert r["output_tokens"] == 64 and r["server_output_tokens"] == 64
        assert r["output_tokens_per_s"] > 0
        assert r["cpu_s_per_1k_tokens"] > 0
        assert r["loadgen_cpu_s"] >= 0 and r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
        assert 0 <= r["queue_ms"]["p50"] <= r["ttft_ms"]["p99"]  # the server's queue time
        assert r["device_stats"]["admitted"] == 8
    assert [r["backend"]["policy"] for r in runs if r["scheduler"] == "static"] == ["static", "static"]
    for name in (
        "summary.md",
        "console.txt",
        "throughput_vs_concurrency.png",
        "latency_cdf.png",
        "cpu_per_1k_tokens.png",
    ):
        assert (out / name).stat().st_size > 0, name
    assert "static" in (out / "summary.md").read_text()


def test_open_loop_with_cpu_interference(tmp_path):
    path = tmp_path / "r.json"
    rc = cli.main(
        [
            "--device",
            "cpu",
            "--compare",
            "host",
            "--request-rate",
            "50",
            "--burstiness",
            "0.5",
            "--requests",
            "6",
            "--input-len",
            "6",
            "--output-len",
            "6",
            "--length-dist",
            "uniform",
            "--ignore-eos",
            "--warmup",
            "1",
            "--cpu-interference",
            "1",
            "--json",
            str(path),
            "--quiet",
        ]
    )
    assert rc == 0
    doc = json.loads(path.read_text())
    runs = doc["runs"]
    assert [(r["cpu_interference"], r["request_rate"], r["concurrency"]) for r in runs] == [
        (0, 50.0, None),
        (1, 50.0, None),
    ]
    assert all(r["completed"] == 6 and r["failed"] == 0 for r in runs)
    assert runs[1]["busy_cpu_s"] > 0 and runs[0]["send_lag_ms"]["p50"] is not None
    (deg,) = doc["degradation"]
    assert deg["scheduler"] == "host" and deg["throughput_ratio"] > 0


def test_server_that_cannot_start_reports_its_output():
    with pytest.raises(ServerError) as err:
        ServerProcess(["--model", "/nonexistent/checkpoint", "--device", "cpu"], startup_timeout_s=60).start()
    assert "nonexistent" in str(err.value)


def test_variants_on_cpu():
    variants, notes = plan_variants(["device", "host", "static", "hf"], "cpu")
    assert [v.name for v in variants] == ["host", "static"]
    assert len(notes) == 2 and "device" in notes[0] and "hf" in notes[1]
    assert variants[1].server_args[-2:] == ("--policy", "static")
    variants, _ = plan_variants(["device", "host"], "cuda")
    assert variants[0].server_args[:2] == ("--scheduler", "device")
    assert variants[1].server_args[:2] == ("--scheduler", "host")
    with pytest.raises(ValueError):
        plan_variants(["nope"], "cpu")


def test_no_argument_run_is_the_quick_comparison():
    args = cli.build_parser().parse_args(cli.QUICK_ARGS)
    assert args.concurrency == [1, 16] and args.requests == 48 and args.ignore_eos
    assert args.out == "ringleader-bench" and args.device == "auto" and args.compare is None
    assert cli.main(["--requests", "0"]) == 2


# ---------------------------------------------------------------- workloads


@pytest.mark.parametrize("dist", ["fixed", "uniform", "longtail"])
def test_workload_is_reproducible(dist):
    cfg = WorkloadConfig(requests=50, input_len=20, output_len=10, length_dist=dist, seed=7)
    a, b = make_requests(cfg), make_requests(cfg)
    assert a == b
    c = make_requests(WorkloadConfig(requests=50, input_len=20, output_len=10, length_dist=dist, seed=8))
    assert [s.prompt_ids for s in a] != [s.prompt_ids for s in c]
    for s in a:
        assert len(s.prompt_ids) >= 1 and s.max_tokens >= 1
        assert all(3 <= t < 256 for t in s.prompt_ids)


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert set(sample_lengths("fixed", 12, 100, rng)) == {12}
    u = sample_lengths("uniform", 100, 5000, rng, range_ratio=0.5)
    assert u.min() >= 50 and u.max() <= 150 and abs(u.mean() - 100) < 3
    lt = sample_lengths("longtail", 100, 20000, rng)
    assert lt.min() >= 1 and lt.max() <= 800
    assert np.median(lt) < 80 < 95 < lt.mean() < 105  # most are short, the tail carries the mean
    with pytest.raises(ValueError):
        sample_lengths("zipf", 10, 3, rng)


def test_fit_context():
    assert fit_context(10, 10, 100) == (10, 10)
    assert fit_context(100, 10, 50) == (40, 10)
    assert fit_context(10, 100, 50) == (1, 49)
    cfg = WorkloadConfig(requests=20, input_len=300, output_len=300, length_dist="longtail", max_context=256)
    assert all(len(s.prompt_ids) + s.max_tokens <= 256 for s in make_requests(cfg))


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_gaps_mean_is_one_over_rate(burstiness):
    gaps = gamma_gaps(40000, rate=8.0, burstiness=burstiness, seed=3)
    assert abs(gaps.mean() - 1 / 8.0) < 0.03 / 8.0
    cv = gaps.std() / gaps.mean()  # Gamma's coefficient of variation is 1/sqrt(shape)
    assert abs(cv - 1 / math.sqrt(burstiness)) < 0.05
    assert np.array_equal(gaps, gamma_gaps(40000, 8.0, burstiness, 3))


def test_arrival_times():
    t = arrival_times(100, rate=10.0, burstiness=1.0, seed=1)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0) and len(t) == 100
    assert np.array_equal(arrival_times(5, math.inf), np.zeros(5))
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


# ---------------------------------------------------------------- latency math


def _record(send, chunks, done, reason="length", index=0):
    rec = RequestRecord(index, prompt_tokens=4, max_tokens=sum(k for _, k in chunks), send_t=send)
    rec.chunk_t = [t for t, _ in chunks]
    rec.chunk_n = [k for _, k in chunks]
    rec.done_t, rec.finish_reason = done, reason
    return rec


def test_request_timeline_math():
    # one token at 0.1, one at 0.15, three in one message at 0.3, then a text-only flush at 0.35
    rec = _record(0.0, [(0.1, 1), (0.15, 1), (0.3, 3), (0.35, 0)], 0.4)
    assert rec.output_tokens == 5
    assert rec.ttft() == pytest.approx(0.1)
    assert rec.itl() == pytest.approx([0.05, 0.15, 0.0, 0.0])  # n-1 gaps, k-1 zeros per message
    assert sum(rec.itl()) == pytest.approx(0.3 - 0.1)
    assert rec.tpot() == pytest.approx(0.2 / 4)  # the flush is not a token arrival
    assert rec.e2e() == pytest.approx(0.4) and rec.decode_time() == pytest.approx(0.3)
    first_chunk_batched = _record(1.0, [(1.2, 3)], 1.3)
    assert first_chunk_batched.itl() == [0.0, 0.0] and first_chunk_batched.tpot() == 0.0
    single = _record(0.0, [(0.5, 1)], 0.6)
    assert single.itl() == [] and single.tpot() is None


def test_summarize_and_percentiles():
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    s = summarize(range(1, 101), scale=2.0)
    assert s["mean"] == pytest.approx(101.0)
    assert s["p50"] == pytest.approx(2 * 50.5) and s["p90"] == pytest.approx(2 * 90.1)
    assert s["p99"] == pytest.approx(2 * 99.01)


def test_run_metrics():
    recs = [
        _record(0.0, [(0.1, 1), (0.2, 1)], 0.2, index=0),
        _record(0.5, [(0.7, 2)], 1.0, index=1),
        _record(0.6, [], 0.7, reason="error", index=2),
    ]
    recs[2].error_code = "overloaded"
    m = run_metrics(recs)
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, {"overloaded": 1})
    assert m["duration_s"] == pytest.approx(1.0)
    assert m["output_tokens"] == 4 and m["output_tokens_per_s"] == pytest.approx(4.0)
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert m["itl_ms"]["p50"] == pytest.approx(50.0) and m["itl_zero_gaps"] == 1
    assert m["e2e_ms"]["p50"] == pytest.approx(350.0)
    empty = run_metrics([])
    assert (
        empty["completed"] == 0 and empty["output_tokens_per_s"] is None and empty["ttft_ms"]["p99"] is None
    )


def test_cpu_deltas():
    before = {"process_cpu_s": 10.0, "output_tokens": 1000, "thread_cpu_s": {"engine": 4.0, "frontend": 1.0}}
    after = {
        "process_cpu_s": 12.5,
        "output_tokens": 6000,
        "thread_cpu_s": {"engine": 6.0, "frontend": 1.5, "new": 1},
    }
    d = cpu_deltas(before, after)
    assert d["process_cpu_s"] == pytest.approx(2.5) and d["server_output_tokens"] == 5000
    assert d["cpu_s_per_1k_tokens"] == pytest.approx(0.5)
    assert d["thread_cpu_s"] == pytest.approx({"engine": 2.0, "frontend": 0.5})
    assert cpu_deltas({}, {})["cpu_s_per_1k_tokens"] is None


# ---------------------------------------------------------------- the hf baseline's weight copy


def test_hf_baseline_copies_the_preset_weights():
    pytest.importorskip("transformers")
    from bench.hf_baseline import build_hf_model, logits_gap

    hf, ours = build_hf_model("tiny", "cpu", seed=0)
    assert logits_gap(hf, ours, list(range(3, 40))) < 1e-3


def test_hf_variant_runs_through_the_harness_on_cpu(tmp_path):
    """The hf driver on the CPU (the CLI offers it on CUDA only; --hf-on-cpu is for this test)."""
    pytest.importorskip("transformers")
    path = tmp_path / "hf.json"
    rc = cli.main(
        [
            "--device",
            "cpu",
            "--compare",
            "hf",
            "--hf-on-cpu",
            "--concurrency",
            "2",
            "--requests",
            "4",
            "--input-len",
            "6",
            "--output-len",
            "5",
            "--ignore-eos",
            "--warmup",
            "1",
            "--json",
            str(path),
            "--quiet",
        ]
    )
    assert rc == 0
    (run,) = json.loads(path.read_text())["runs"]
    assert run["scheduler"] == "hf" and run["completed"] == 4 and run["output_tokens"] == 20
    assert run["tpot_ms"]["p50"] > 0 and run["cpu_s_per_1k_tokens"] > 0 and run["loadgen_cpu_s"] is None
