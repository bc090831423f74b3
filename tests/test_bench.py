"""`ringleader bench`: end-to-end runs against real servers on 127.0.0.1, and the math under it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ringleader.bench import cli
from ringleader.bench.load_plan import loads, plan_loads, request_counts
from ringleader.bench.metrics import RequestRecord, run_metrics, summarize
from ringleader.bench.options import check_options
from ringleader.bench.servers import ServerError, ServerProcess, cpu_deltas, plan_variants
from ringleader.bench.workloads import (
    PRESET_PROMPT_IDS,
    WorkloadConfig,
    arrival_times,
    fit_context,
    gamma_gaps,
    make_requests,
    ordinary_id_range,
    prompt_id_range_for,
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
    assert [v.name for v in variants] == ["host", "static", "hf"]  # hf runs on the CPU too
    assert len(notes) == 1 and "device" in notes[0]
    assert variants[1].server_args[-2:] == ("--policy", "static")
    assert variants[2].kind == "hf" and variants[2].server_args == ()
    variants, _ = plan_variants(["device", "host"], "cuda")
    assert variants[0].server_args[:2] == ("--scheduler", "device")
    assert variants[1].server_args[:2] == ("--scheduler", "host")
    with pytest.raises(ValueError):
        plan_variants(["nope"], "cpu")


def test_variants_may_name_their_weights():
    """host:quantized and host:fp32 run side by side: two servers, each with its --weights."""
    variants, _ = plan_variants(["host:quantized", "host:fp32", "hf", "host:quantized"], "cpu")
    assert [v.name for v in variants] == ["host:quantized", "host:fp32", "hf"]
    assert variants[0].server_args[-2:] == ("--weights", "quantized")
    assert variants[1].server_args[-2:] == ("--weights", "fp32")
    with pytest.raises(ValueError, match="hf:fp32"):
        plan_variants(["hf:fp32"], "cpu")  # transformers widens a GGUF file itself
    with pytest.raises(ValueError, match="one of auto, fp32, bf16, quantized"):
        plan_variants(["host:int2"], "cpu")


def test_no_argument_run_is_the_quick_comparison():
    args = cli.build_parser().parse_args(cli.QUICK_ARGS)
    assert args.concurrency == [1, 16] and args.requests == 48 and args.ignore_eos
    assert args.out == "ringleader-bench" and args.device == "auto" and args.compare is None
    assert cli.main(["--requests", "0"]) == 2


def test_cpu_interference_takes_a_list_of_busy_counts():
    parse = cli.build_parser().parse_args
    assert parse([]).cpu_interference == []
    assert parse(["--cpu-interference", "1,2"]).cpu_interference == [1, 2]
    plan = plan_loads(parse(["--cpu-interference", "2,1,2", "--requests", "2"]), 128, (17, 100))
    assert plan.busy_levels == [0, 1, 2]  # each count once, beside the quiet run
    with pytest.raises(SystemExit):
        parse(["--cpu-interference", "-1"])


def test_requests_per_load_point():
    parse = cli.build_parser().parse_args
    args = parse(["--concurrency", "1,8,32", "--requests", "8,24,64"])
    assert request_counts(args) == [8, 24, 64] and check_options(args) == []
    assert [(load.concurrency, n) for load, n in loads(args)] == [(1, 8), (8, 24), (32, 64)]
    args = parse(["--concurrency", "1,8", "--request-rate", "5", "--requests", "10"])
    assert request_counts(args) == [10, 10, 10] and args.requests == 10
    (_, _, (rate, n)) = loads(args)
    assert rate.request_rate == 5 and n == 10 and len(rate.arrival_s) == 10
    assert check_options(parse(["--concurrency", "1,8", "--requests", "4,8,16"]))  # 3 counts, 2 points
    assert cli.main(["--concurrency", "1,8", "--requests", "4,0"]) == 2


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


def test_preset_prompts_are_unchanged():
    """The presets' prompts (ids 3..255 from the seed's token stream) are what they always were."""
    specs = make_requests(WorkloadConfig(3, 6, 4, "uniform", seed=5))
    assert [(s.prompt_ids, s.max_tokens) for s in specs] == [
        ([139, 67, 232, 21], 5),
        ([187, 210, 106, 144, 98], 5),
        ([115, 124, 219, 196, 72, 9, 100, 147, 73], 2),
    ]
    assert WorkloadConfig(1, 1, 1).prompt_id_range == PRESET_PROMPT_IDS == (3, 256)
    assert prompt_id_range_for("tiny") == PRESET_PROMPT_IDS


def test_prompt_ids_of_a_real_vocabulary():
    cfg = WorkloadConfig(40, 50, 4, "uniform", seed=5, prompt_id_range=(17, 49152))
    specs = make_requests(cfg)
    ids = [t for s in specs for t in s.prompt_ids]
    assert min(ids) >= 17 and max(ids) < 49152 and max(ids) > 40000  # the whole range, not bytes
    # lengths come from their own stream: the same as the presets' for the same seed
    base = make_requests(WorkloadConfig(40, 50, 4, "uniform", seed=5))
    assert [len(s.prompt_ids) for s in specs] == [len(s.prompt_ids) for s in base]
    assert make_requests(cfg) == specs
    with pytest.raises(ValueError):
        make_requests(WorkloadConfig(1, 4, 4, prompt_id_range=(10, 10)))


def test_ordinary_id_range():
    assert ordinary_id_range(49152, range(17)) == (17, 49152)  # SmolLM2: controls first
    assert ordinary_id_range(128256, range(128000, 128256)) == (0, 128000)  # Llama-3: specials last
    assert ordinary_id_range(32000, {0, 1, 2}) == (3, 32000)  # Llama-2: unk, bos, eos
    assert ordinary_id_range(100, {50, 200, -1}) == (0, 50)  # ties: the first; out-of-range ids ignored
    assert ordinary_id_range(10, set()) == (0, 10)
    with pytest.raises(ValueError):
        ordinary_id_range(2, {0, 1})


def _tokenizer_dir(tmp_path, config_vocab=None):
    """A checkpoint directory with a word-level tokenizer.json: 3 special tokens first, then
    2 ordinary words, one more special, then 20 ordinary words."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<s>", "</s>", "<pad>", "a", "b", "<|im_end|>", *[f"w{i}" for i in range(20)]]
    tk = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>")
    )
    tk.add_special_tokens(["<s>", "</s>", "<pad>", "<|im_end|>"])
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    if config_vocab is not None:
        (tmp_path / "config.json").write_text(json.dumps({"vocab_size": config_vocab}))
    return tmp_path


def test_prompt_id_range_of_a_checkpoint_directory(tmp_path):
    d = _tokenizer_dir(tmp_path)
    from ringleader.device.model.presets import tokenizer_for

    assert tokenizer_for(str(d)).special_token_ids() == {0, 1, 2, 5}
    assert prompt_id_range_for(str(d)) == (6, 26)
    (d / "config.json").write_text(json.dumps({"vocab_size": 16}))  # an embedding smaller than the vocab
    assert prompt_id_range_for(str(d)) == (6, 16)


def test_prompt_id_range_of_the_smollm2_gguf(smollm2_gguf):
    """The real GGUF's vocabulary (no server): 17 control tokens, then ordinary ids to 49152."""
    assert prompt_id_range_for(str(smollm2_gguf)) == (17, 49152)


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


# ---------------------------------------------------------------- ringleader / hf ratios


def _fake_run(scheduler, concurrency, tok_s, ttft, tpot, busy=0):
    stat = lambda v: {"mean": v, "p50": v, "p90": v, "p99": v}  # noqa: E731
    return {
        "scheduler": scheduler,
        "concurrency": concurrency,
        "request_rate": None,
        "cpu_interference": busy,
        "output_tokens_per_s": tok_s,
        "ttft_ms": stat(ttft),
        "tpot_ms": stat(tpot),
        "itl_ms": stat(tpot),
        "e2e_ms": stat(ttft + 10 * tpot),
        "queue_ms": stat(0.0),
        "completed": 4,
        "failed": 0,
        "request_throughput": 1.0,
        "cpu_s_per_1k_tokens": 2.0,
        "loadgen_cpu_s": None,
        "loadgen_cpu_frac": None,
    }


def test_ratios_vs_hf_in_the_summary():
    from ringleader.bench.report_comparisons import ratios_vs_hf
    from ringleader.bench.report_markdown import markdown_summary
    from ringleader.bench.report_tables import format_ratios

    runs = [
        _fake_run("host", 1, 30.0, 100.0, 20.0),
        _fake_run("host", 8, 120.0, 300.0, 40.0),
        _fake_run("static", 8, 60.0, 900.0, 40.0),
        _fake_run("hf", 1, 10.0, 400.0, 80.0),
        _fake_run("hf", 8, 40.0, 600.0, 160.0),
        _fake_run("host", 32, 200.0, 1.0, 1.0),  # no hf run at c=32: no ratio
    ]
    rows = ratios_vs_hf(runs)
    assert [(r["scheduler"], r["concurrency"]) for r in rows] == [("host", 1), ("host", 8), ("static", 8)]
    assert [r["output_tokens_per_s_ratio"] for r in rows] == pytest.approx([3.0, 3.0, 1.5])
    assert rows[0]["ttft_ms_p50_ratio"] == pytest.approx(0.25) and rows[1][
        "tpot_ms_p50_ratio"
    ] == pytest.approx(0.25)
    assert rows[0]["output_tokens_per_s"] == [30.0, 10.0] and rows[0]["baseline"] == "hf"
    assert ratios_vs_hf([r for r in runs if r["scheduler"] != "hf"]) == []
    text = format_ratios(rows)
    assert "ringleader / hf" in text and "x3.00" in text and "x1.50" in text and "x0.25" in text
    assert format_ratios([]) == ""
    doc = {
        "model": "m.gguf",
        "device": "cpu",
        "created": "now",
        "command": ["--compare", "host,static,hf"],
        "environment": {"git": {}},
        "settings": {},
        "runs": runs,
        "degradation": [],
        "ratios_vs_hf": rows,
        "notes": [],
    }
    md = markdown_summary(doc, [])
    assert "## ringleader / hf" in md
    assert "| host | c=8 | 120.0 / 40.0 | x3.00 | x0.50 | x0.25 |" in md
    assert "hf runs in the benchmark's own process" in md


# ---------------------------------------------------------------- the hf baseline's weight copy


def test_hf_baseline_copies_the_preset_weights():
    pytest.importorskip("transformers")
    from ringleader.bench.hf_baseline import build_hf_model, logits_gap

    hf, ours = build_hf_model("tiny", "cpu", seed=0)
    assert logits_gap(hf, ours, list(range(3, 40))) < 1e-3


def test_hf_cache_blocks_read_either_name_of_the_block_size():
    """transformers 5.17 (the GPU image's) names the tokens per cache block `block_size`, newer
    releases `page_size`: the H200 run of 2026-11-28 failed on the older name."""
    from types import SimpleNamespace

    transformers = pytest.importorskip("transformers")
    from ringleader.bench.hf_baseline import cache_blocks

    if hasattr(transformers, "ContinuousBatchingConfig"):  # the installed release, as it is
        assert cache_blocks(transformers.ContinuousBatchingConfig(), 4096) >= 1
    assert cache_blocks(SimpleNamespace(page_size=256), 1000) == 4
    assert cache_blocks(SimpleNamespace(block_size=128, page_size=None), 1000) == 8
    with pytest.raises(ValueError, match="page_size or block_size"):
        cache_blocks(SimpleNamespace(), 1000)


def test_hf_loads_a_gguf_file_with_transformers(monkeypatch):
    """A .gguf spec goes to from_pretrained(dir, gguf_file=name) in float32 on the CPU."""
    transformers = pytest.importorskip("transformers")
    import torch

    from ringleader.bench.hf_baseline import build_hf_model

    seen = {}

    class Fake(torch.nn.Module):
        def eval(self):
            seen["eval"] = True
            return self

    def from_pretrained(path, **kwargs):
        seen.update(path=path, **kwargs)
        return Fake()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    model, ours = build_hf_model("/models/x/SmolLM2.Q4_1.gguf", "cpu")
    assert ours is None and seen["eval"]
    assert seen["path"] == "/models/x" and seen["gguf_file"] == "SmolLM2.Q4_1.gguf"
    assert seen["dtype"] == torch.float32
    seen.clear()
    build_hf_model("/models/dir", "cpu")  # a checkpoint directory: plain from_pretrained
    assert seen["path"] == "/models/dir" and "gguf_file" not in seen


def test_hf_variant_runs_through_the_harness_on_cpu(tmp_path):
    """The hf driver on the CPU, beside a server variant: the same workload goes to both, and
    the summary carries the ringleader / hf ratio."""
    pytest.importorskip("transformers")
    out = tmp_path / "res"
    rc = cli.main(
        [
            "--device",
            "cpu",
            "--compare",
            "host,hf",
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
            "--out",
            str(out),
            "--no-plots",
            "--quiet",
        ]
    )
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    host, run = doc["runs"]
    assert run["scheduler"] == "hf" and run["completed"] == 4 and run["output_tokens"] == 20
    assert run["tpot_ms"]["p50"] > 0 and run["cpu_s_per_1k_tokens"] > 0 and run["loadgen_cpu_s"] is None
    assert host["scheduler"] == "host" and host["output_tokens"] == 20  # same lengths to both
    (ratio,) = doc["ratios_vs_hf"]
    assert ratio["scheduler"] == "host" and ratio["concurrency"] == 2
    assert ratio["output_tokens_per_s_ratio"] == pytest.approx(
        host["output_tokens_per_s"] / run["output_tokens_per_s"]
    )
    assert "## ringleader / hf" in (out / "summary.md").read_text()
    assert "ringleader / hf" in (out / "console.txt").read_text()
    assert doc["settings"]["prompt_id_range"] == [3, 256]
