"""`ringleader bench --shared-prefix-len`: the shared-prefix workload, the prefix-caching arms and
their report, without servers; then the comparison end to end against `serve --model tiny`."""

from __future__ import annotations

import json

import pytest

from ringleader.bench import cli
from ringleader.bench import servers as S
from ringleader.bench.loadgen import Load, RunResult
from ringleader.bench.metrics import RequestRecord
from ringleader.bench.options import check_options
from ringleader.bench.report import make_run_entry
from ringleader.bench.report_comparisons import prefix_caching_comparison
from ringleader.bench.report_markdown import markdown_summary
from ringleader.bench.report_tables import format_prefix_caching
from ringleader.bench.workloads import (
    WorkloadConfig,
    add_shared_prefixes,
    expected_prefix_hit_rate,
    make_requests,
    shared_prefixes,
)

# ---------------------------------------------------------------- the workload


def _cfg(**kw):
    base = dict(requests=24, input_len=12, output_len=5, seed=3, shared_prefix_len=40, prefix_groups=3)
    return WorkloadConfig(**{**base, **kw})


def test_prefix_is_shared_within_a_group_and_distinct_across_groups():
    specs = make_requests(_cfg())
    prefixes = shared_prefixes(40, 3, seed=3)
    assert len(prefixes) == 3 and all(len(p) == 40 for p in prefixes)
    assert len({tuple(p) for p in prefixes}) == 3
    assert len({p[0] for p in prefixes}) == 3  # no two groups share even a first token
    for i, s in enumerate(specs):
        assert s.prompt_ids[:40] == prefixes[i % 3]  # round robin: request i in group i % G
        assert all(3 <= t < 256 for t in s.prompt_ids)


def test_suffixes_are_the_plain_workload_and_lengths_are_right():
    plain = make_requests(_cfg(shared_prefix_len=0))
    specs = make_requests(_cfg())
    assert [s.prompt_ids[40:] for s in specs] == [s.prompt_ids for s in plain]
    assert [s.max_tokens for s in specs] == [s.max_tokens for s in plain] == [5] * 24
    assert all(len(s.prompt_ids) == 40 + 12 for s in specs)
    assert len({tuple(s.prompt_ids[40:]) for s in specs}) == 24
    # other length distributions: the suffix keeps its own length
    spread = make_requests(_cfg(length_dist="uniform"))
    plain = make_requests(_cfg(length_dist="uniform", shared_prefix_len=0))
    assert [len(s.prompt_ids) - 40 for s in spread] == [len(s.prompt_ids) for s in plain]


def test_tiny_suffixes_are_made_distinct_within_a_group():
    """One-token suffixes repeat by chance; a repeat in its group gets its token redrawn."""
    specs = make_requests(_cfg(requests=60, input_len=1, prefix_groups=2))
    for g in range(2):
        group = [tuple(s.prompt_ids[40:]) for s in specs[g::2]]
        assert len(set(group)) == len(group) == 30
    assert all(len(s.prompt_ids) == 41 for s in specs)


def test_prefix_workload_is_deterministic_per_seed_and_salt():
    assert make_requests(_cfg()) == make_requests(_cfg())
    other_seed = make_requests(_cfg(seed=4))
    assert other_seed[0].prompt_ids[:40] != make_requests(_cfg())[0].prompt_ids[:40]
    salted = make_requests(_cfg(prefix_salt=1))
    base = make_requests(_cfg())
    assert [s.prompt_ids[40:] for s in salted] == [s.prompt_ids[40:] for s in base]  # same suffixes
    assert {tuple(s.prompt_ids[:40]) for s in salted}.isdisjoint({tuple(s.prompt_ids[:40]) for s in base})
    # the plain workload (no prefix) is what it always was
    assert make_requests(WorkloadConfig(3, 6, 4, "uniform", seed=5))[0].prompt_ids == [139, 67, 232, 21]


def test_prefix_fits_the_context_suffix_first():
    specs = make_requests(_cfg(input_len=30, output_len=20, max_context=64))
    for s in specs:
        assert len(s.prompt_ids) + s.max_tokens <= 64 and len(s.prompt_ids) >= 41  # prefix kept whole
    assert [len(s.prompt_ids) for s in specs] == [44] * 24 and specs[0].max_tokens == 20
    tight = make_requests(_cfg(input_len=30, output_len=30, max_context=45))
    assert all((len(s.prompt_ids), s.max_tokens) == (41, 4) for s in tight)
    with pytest.raises(ValueError):
        make_requests(_cfg(max_context=41))  # no room for a prompt and an output token
    # the same as adding prefixes to the plain workload
    plain = make_requests(_cfg(shared_prefix_len=0, input_len=30, output_len=20, max_context=64))
    assert add_shared_prefixes(plain, 40, 3, seed=3, max_context=64) == specs


def test_prefixes_of_a_real_vocabulary():
    prefixes = shared_prefixes(16, 5, seed=1, id_range=(17, 49152))
    ids = [t for p in prefixes for t in p]
    assert min(ids) >= 17 and max(ids) < 49152 and max(ids) > 1000


def test_expected_hit_rate():
    specs = make_requests(_cfg())  # 24 requests of 40 + 12 tokens, 3 groups
    rate = expected_prefix_hit_rate(specs, 40, 3)
    assert rate["steady"] == pytest.approx(40 / 52)
    assert rate["cold"] == pytest.approx(21 * 40 / (24 * 52))
    assert expected_prefix_hit_rate([], 40, 3) == {"steady": None, "cold": None}
    few = expected_prefix_hit_rate(specs[:2], 40, 3)  # fewer requests than groups: all cold
    assert few["cold"] == 0.0


# ---------------------------------------------------------------- options and arms


def test_prefix_options():
    parse = cli.build_parser().parse_args
    args = parse(["--shared-prefix-len", "64", "--prefix-groups", "4"])
    assert (args.shared_prefix_len, args.prefix_groups) == (64, 4) and check_options(args) == []
    assert parse([]).shared_prefix_len == 0 and parse([]).prefix_groups is None
    assert check_options(parse(["--prefix-groups", "2"]))  # without --shared-prefix-len
    assert check_options(parse(["--shared-prefix-len", "-1"]))
    assert check_options(parse(["--shared-prefix-len", "8", "--prefix-groups", "0"]))
    assert check_options(parse(["--shared-prefix-len", "63", "--max-ctx", "64"]))
    assert check_options(parse(["--shared-prefix-len", "62", "--max-ctx", "64"])) == []
    assert check_options(parse(["--shared-prefix-len", "8", "--compare", "host,gateway"]))
    assert cli.main(["--shared-prefix-len", "8", "--prefix-groups", "0"]) == 2


def test_prefix_arms():
    variants, _ = S.plan_variants(["host", "static", "hf"], "cpu")
    arms = S.prefix_arms(variants)
    assert [v.name for v in arms] == [
        "host/prefix-on",
        "host/prefix-off",
        "static/prefix-on",
        "static/prefix-off",
        "hf",
    ]
    assert arms[0].server_args == ("--policy", "fifo", "--prefix-caching")
    assert arms[1].server_args == ("--policy", "fifo", "--no-prefix-caching")
    assert [(v.variant, v.prefix_caching) for v in arms] == [
        ("host", True),
        ("host", False),
        ("static", True),
        ("static", False),
        ("hf", None),
    ]
    # --prefix-off-first swaps each variant's arms, nothing else
    swapped = [v.name for v in S.prefix_arms(variants, off_first=True)]
    assert swapped == ["host/prefix-off", "host/prefix-on", "static/prefix-off", "static/prefix-on", "hf"]


# ---------------------------------------------------------------- counters and the report


def _result(before: dict, after: dict, ttft: float, n: int = 4) -> RunResult:
    records = []
    for i in range(n):
        rec = RequestRecord(i, prompt_tokens=52, max_tokens=2, send_t=float(i))
        rec.chunk_t, rec.chunk_n = [i + ttft, i + ttft + 0.01], [1, 1]
        rec.done_t, rec.finish_reason = i + ttft + 0.02, "length"
        records.append(rec)
    return RunResult(records, before, after, loadgen_cpu_s=0.1, wall_s=float(n))


def _entry(name, on, before, after, ttft):
    return make_run_entry(
        scheduler=name,
        device="cpu",
        model="tiny",
        load=Load(concurrency=2),
        result=_result(before, after, ttft),
        burstiness=None,
        variant="host",
        prefix_caching=on,
        expected_prefix_hit_rate={"steady": 0.75, "cold": 0.6},
    )


def test_hit_rate_from_counter_deltas():
    before = {"prefix_cache_queries": 1000, "prefix_cache_hits": 100}
    after = {"prefix_cache_queries": 1208, "prefix_cache_hits": 256}
    assert S.prefix_cache_deltas(before, after) == {
        "prefix_cache_queries": 208,
        "prefix_cache_hits": 156,
        "prefix_cache_hit_rate": pytest.approx(0.75),
    }
    nested = S.prefix_cache_deltas({"device": before}, {"device": after})  # under the backend's stats
    assert nested["prefix_cache_hit_rate"] == pytest.approx(0.75)
    missing = {"prefix_cache_queries": None, "prefix_cache_hits": None, "prefix_cache_hit_rate": None}
    assert S.prefix_cache_deltas({}, {}) == missing  # a server without the counters: null
    assert S.prefix_cache_deltas({"output_tokens": 3}, after) == missing  # only after: no delta
    idle = S.prefix_cache_deltas(before, before)
    assert idle["prefix_cache_queries"] == 0 and idle["prefix_cache_hit_rate"] is None
    entry = _entry("host/prefix-on", True, before, after, 0.1)
    assert entry["prefix_cache_hit_rate"] == pytest.approx(0.75) and entry["prefix_cache_hits"] == 156
    assert entry["expected_prefix_hit_rate"] == 0.75 and entry["expected_prefix_hit_rate_cold"] == 0.6
    assert (entry["variant"], entry["prefix_caching"]) == ("host", True)
    json.dumps({k: v for k, v in entry.items() if not k.startswith("_")})


def test_prefix_comparison_ratios_and_missing_counters():
    on = _entry(
        "host/prefix-on",
        True,
        {"prefix_cache_queries": 0, "prefix_cache_hits": 0},
        {"prefix_cache_queries": 208, "prefix_cache_hits": 156},
        0.1,
    )
    off = _entry("host/prefix-off", False, {}, {}, 0.4)  # no counters in its stats
    other = dict(_entry("host/prefix-off", False, {}, {}, 0.4), concurrency=8)  # no pair at c=8
    (row,) = prefix_caching_comparison([on, off, other])
    assert (row["variant"], row["on"], row["off"], row["concurrency"]) == (
        "host",
        "host/prefix-on",
        "host/prefix-off",
        2,
    )
    assert row["ttft_ms_p50"] == pytest.approx([100.0, 400.0])
    assert row["ttft_ms_p50_ratio_off_on"] == pytest.approx(4.0)
    assert row["ttft_ms_p90_ratio_off_on"] == pytest.approx(4.0)
    assert row["prefix_cache_hit_rate"][0] == pytest.approx(0.75) and row["prefix_cache_hit_rate"][1] is None
    tput_on, tput_off = row["output_tokens_per_s"]
    assert row["output_tokens_per_s_ratio_on_off"] == pytest.approx(tput_on / tput_off)
    assert row["request_throughput_ratio_on_off"] == pytest.approx(
        on["request_throughput"] / off["request_throughput"]
    )
    assert row["expected_prefix_hit_rate"] == 0.75
    assert prefix_caching_comparison([on]) == [] and prefix_caching_comparison([off]) == []
    text = format_prefix_caching([row])
    assert "prefix caching on / off" in text and "x4.00" in text and "75% / -" in text
    assert format_prefix_caching([]) == ""
    doc = {
        "model": "tiny",
        "device": "cpu",
        "created": "now",
        "command": ["--shared-prefix-len", "40"],
        "environment": {"git": {}},
        "settings": {"shared_prefix_len": 40, "prefix_groups": 3},
        "runs": [on, off],
        "degradation": [],
        "prefix_caching": [row],
        "notes": [],
    }
    md = markdown_summary(doc, [])
    assert "## prefix caching on / off" in md and "shared prefix of 40 tokens" in md
    assert "| host | c=2 |" in md


# ---------------------------------------------------------------- end to end


def _bench_args(out) -> list[str]:
    return [
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--concurrency",
        "2",
        "--requests",
        "6",
        "--input-len",
        "4",
        "--output-len",
        "3",
        "--shared-prefix-len",
        "40",
        "--prefix-groups",
        "2",
        "--ignore-eos",
        "--warmup",
        "1",
        "--out",
        str(out),
        "--no-plots",
        "--quiet",
    ]


def _check_comparison(out) -> dict:
    doc = json.loads((out / "results.json").read_text())
    runs = doc["runs"]
    assert [(r["scheduler"], r["variant"], r["prefix_caching"]) for r in runs] == [
        ("host/prefix-on", "host", True),
        ("host/prefix-off", "host", False),
    ]
    assert doc["settings"]["variants"] == ["host/prefix-on", "host/prefix-off"]
    assert doc["settings"]["skipped"] == [] and doc["settings"]["shared_prefix_len"] == 40
    assert doc["settings"]["prefix_groups"] == 2
    for r in runs:
        assert r["completed"] == 6 and r["failed"] == 0 and r["output_tokens"] == 18
        assert r["expected_prefix_hit_rate"] == pytest.approx(40 / 44)
        assert r["expected_prefix_hit_rate_cold"] == pytest.approx(4 * 40 / (6 * 44))
        for key in ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate"):
            assert key in r
        assert r["prefix_cache_hit_rate"] is None or 0.0 <= r["prefix_cache_hit_rate"] <= 1.0
    (row,) = doc["prefix_caching"]
    assert row["variant"] == "host" and row["concurrency"] == 2
    assert row["ttft_ms_p50_ratio_off_on"] > 0 and row["output_tokens_per_s_ratio_on_off"] > 0
    assert row["request_throughput_ratio_on_off"] > 0
    assert "## prefix caching on / off" in (out / "summary.md").read_text()
    assert "prefix caching on / off" in (out / "console.txt").read_text()
    return doc


def test_comparison_end_to_end_with_the_flags_left_out(tmp_path, monkeypatch):
    """The harness alone, whatever serve takes: both arms start `serve --model tiny` without the
    flag (the server's default), and both run the workload and report."""
    monkeypatch.setattr(S, "PREFIX_CACHING_FLAGS", {True: (), False: ()})
    out = tmp_path / "res"
    assert cli.main(_bench_args(out)) == 0
    _check_comparison(out)


def test_comparison_end_to_end(tmp_path, capsys):
    """The real arms: serve --prefix-caching and --no-prefix-caching (skipped while serve does not
    take the flag: it exits with a usage error)."""
    out = tmp_path / "res"
    rc = cli.main(_bench_args(out))
    err = capsys.readouterr().err
    if rc != 0 and "unrecognized arguments" in err and "prefix-caching" in err:
        pytest.skip("ringleader serve does not take --prefix-caching yet")
    assert rc == 0, err
    doc = _check_comparison(out)
    off = doc["runs"][1]
    assert off["prefix_cache_hits"] in (None, 0)  # caching off finds nothing
    on = doc["runs"][0]
    if on["prefix_cache_queries"] is not None:  # the server reports its counters
        assert on["prefix_cache_queries"] > 0 and on["prefix_cache_hits"] > 0
