"""The Prometheus exporter (hostctl/serving/prometheus.py, docs/metrics.md): scraped over HTTP from a real
server on 127.0.0.1 with the CPU backend and `tiny`, parsed with prometheus_client's own parser;
known requests move the counters and histograms by exactly what they should.  Also the
fixed-bucket histogram (ipc/histogram.py) and the device timeline's incremental feed, on
synthetic trace rows (no GPU needed)."""

from __future__ import annotations

import math
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ringleader.device.backends import open_backend
from ringleader.device.backends.device_timeline import TimelineFeed, complete_rows, timeline_summary
from ringleader.hostctl.serving.background_server import BackgroundServer
from ringleader.hostctl.serving.prometheus import MetricsExporter
from ringleader.hostctl.serving.server import Server
from ringleader.ipc import layout
from ringleader.ipc.client import Client
from ringleader.ipc.histogram import Histogram, buckets_125
from tests.conftest import running_server

P = "ringleader:"


# ---- scraping ------------------------------------------------------------------------------
class Scrape:
    """One scrape: value(name, **labels) of the one sample whose labels include those given."""

    def __init__(self, url: str):
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200
            text = r.read().decode()
        self.samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    def all(self, name: str, **labels) -> list:
        return [
            s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels) -> float:
        found = self.all(name, **labels)
        assert len(found) == 1, f"{name} {labels}: {len(found)} samples"
        return found[0].value

    def has(self, name: str, **labels) -> bool:
        return bool(self.all(name, **labels))


def scrape_until(url: str, pred, timeout: float = 10.0) -> Scrape:
    """Scrapes until pred(scrape) holds (the control block's counters are mirrored, not live)."""
    deadline = time.monotonic() + timeout
    while True:
        s = Scrape(url)
        if pred(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


@pytest.fixture(scope="module")
def served():
    with running_server() as bg:
        with MetricsExporter(bg.server, "127.0.0.1", 0) as exporter:
            yield bg, exporter


# ---- end to end ------------------------------------------------------------------------------
def test_known_requests_move_every_counter_and_histogram_by_exactly_their_share(served):
    bg, exporter = served
    prompts, max_tokens = [3, 5, 8], [4, 6, 9]
    before = Scrape(exporter.url)
    with Client(bg.address, timeout=60) as c:
        done = [
            c.complete(prompt_ids=list(range(1, n + 1)), max_tokens=m, ignore_eos=True).done
            for n, m in zip(prompts, max_tokens)
        ]
        rejected = c.complete(prompt_ids=[1] * 600, max_tokens=4).done  # longer than max_ctx 512
        aborted = c.generate(prompt_ids=[7, 8, 9, 10], max_tokens=400, ignore_eos=True)
        next(aborted)
        aborted.abort()
        done.append(aborted.wait())
    prompts.append(4)
    assert [d.finish_reason for d in done] == ["length"] * 3 + ["abort"]
    assert rejected.error_code == "bad_request"
    tokens = [d.completion_tokens for d in done]
    assert tokens[:3] == max_tokens
    n = len(done)

    def settled(s: Scrape) -> bool:
        """The control block's counters are mirrored, not live (after an idle pass at the
        latest): wait until the step histograms and steps_total agree and no slot is held."""
        steps = s.value(P + "steps_total") - before.value(P + "steps_total")
        observed = s.value(P + "scheduler_step_seconds_count", phase="critical") - before.value(
            P + "scheduler_step_seconds_count", phase="critical"
        )
        return steps == observed and s.value(P + "num_requests_running") == 0

    after = scrape_until(exporter.url, settled)

    def delta(name, **labels):
        return after.value(name, **labels) - before.value(name, **labels)

    assert delta(P + "generation_tokens_total") == sum(tokens)
    assert delta(P + "prompt_tokens_total") == sum(prompts)
    assert delta(P + "requests_accepted_total") == n
    assert delta(P + "request_success_total", finished_reason="length") == 3
    assert delta(P + "request_success_total", finished_reason="abort") == 1
    assert delta(P + "request_success_total", finished_reason="stop") == 0
    assert delta(P + "request_success_total", finished_reason="error") == 0
    assert delta(P + "requests_rejected_total", code="bad_request") == 1
    assert delta(P + "requests_rejected_total", code="overloaded") == 0
    assert delta(P + "request_errors_total", code="timeout") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(P + name + "_count") == n, name
    assert delta(P + "inter_token_latency_seconds_count") == sum(tokens) - n
    assert delta(P + "request_time_per_output_token_seconds_count") == sum(t >= 2 for t in tokens)
    assert delta(P + "request_prompt_tokens_count") == n
    assert delta(P + "request_prompt_tokens_sum") == sum(prompts)
    assert delta(P + "request_generation_tokens_sum") == sum(tokens)
    # the histograms hold the numbers each `done` reported, not a second measurement
    for name, key in (
        ("time_to_first_token_seconds", "ttft_ms"),
        ("e2e_request_latency_seconds", "e2e_ms"),
        ("request_queue_time_seconds", "queue_ms"),
    ):
        reported = sum(d.timing[key] for d in done) / 1e3
        assert delta(P + name + "_sum") == pytest.approx(reported, rel=1e-6, abs=1e-9), name
    # the scheduler's steps
    assert delta(P + "steps_total") > 0
    assert delta(P + "scheduler_step_seconds_count", phase="overlapped") == delta(P + "steps_total")
    assert delta(P + "tokens_per_step_sum") == delta(P + "step_tokens_total") >= sum(prompts)
    # the prefix cache looked every admitted prompt up; none fills a page of 16 tokens to share
    assert delta(P + "prefix_cache_queries_total") == sum(prompts)
    assert delta(P + "prefix_cache_hits_total") == 0
    assert not after.has(P + "step_bubble_seconds_count")  # no bubble on the CPU backend
    # nothing left in flight, the engine lives, and what runs is described
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_in_flight", "engine_dead"):
        assert after.value(P + name) == 0, name
    assert after.value(P + "batch_slots") == bg.server.backend.description["n_slots"]
    info = after.all(P + "launch_mode_info")
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["device"] == "cpu" and info[0].labels["model"] == "tiny"
    assert info[0].labels["scheduler"] == "host-thread" and info[0].labels["launch"] == "none"
    # CPU time per thread, and the process's own from the default collectors
    for thread in ("frontend", "completions", "engine"):
        assert after.value(P + "host_cpu_seconds_total", thread=thread) >= before.value(
            P + "host_cpu_seconds_total", thread=thread
        )
    assert after.value("process_cpu_seconds_total") > 0


def test_every_series_carries_model_name_and_histograms_are_cumulative(served):
    s = Scrape(served[1].url)
    ours = [x for x in s.samples if x.name.startswith(P)]
    assert ours and all(x.labels.get("model_name") == "tiny" for x in ours)
    buckets = s.all(P + "time_to_first_token_seconds_bucket")
    counts = [b.value for b in sorted(buckets, key=lambda b: float(b.labels["le"]))]
    assert counts == sorted(counts)
    assert buckets[-1].labels["le"] == "+Inf"
    assert counts[-1] == s.value(P + "time_to_first_token_seconds_count")


def test_running_and_waiting_gauges_follow_the_slots(served):
    bg, exporter = served
    n_slots = bg.server.backend.description["n_slots"]
    with Client(bg.address, timeout=60) as c:
        streams = [c.generate(prompt_ids=[1, 2], max_tokens=450, ignore_eos=True) for _ in range(n_slots + 3)]
        s = scrape_until(
            exporter.url,
            lambda s: (
                s.value(P + "num_requests_running") == n_slots and s.value(P + "num_requests_waiting") == 3
            ),
        )
        assert s.value(P + "num_requests_running") == n_slots
        assert s.value(P + "num_requests_waiting") == 3
        assert s.value(P + "num_requests_in_flight") == n_slots + 3
        for st in streams:
            st.abort()
        assert {st.wait().finish_reason for st in streams} <= {"abort", "length"}
    s = scrape_until(exporter.url, lambda s: s.value(P + "num_requests_running") == 0)
    assert s.value(P + "num_requests_running") == 0 and s.value(P + "num_requests_in_flight") == 0


def test_the_exporter_serves_before_the_server_starts_and_after_it_stops():
    server = Server(
        open_backend("tiny", device="cpu", n_slots=4, max_ctx=256, token_budget=32),
        "tcp://127.0.0.1:0",
        drain_timeout_s=0.5,
    )
    exporter = MetricsExporter(server, "127.0.0.1", 0).start()
    try:
        s = Scrape(exporter.url)  # the backend has not started: the control block is zero
        assert s.value(P + "steps_total") == 0 and s.value(P + "num_requests_running") == 0
        assert s.value(P + "engine_dead") == 0
        with BackgroundServer(server) as bg:
            with Client(bg.address, timeout=60) as c:
                assert c.complete(prompt_ids=[1, 2, 3], max_tokens=5, ignore_eos=True).done.ok
            running = scrape_until(exporter.url, lambda s: s.value(P + "steps_total") > 0)
            assert running.has(P + "host_cpu_seconds_total", thread="engine")
        stopped = Scrape(exporter.url)  # its threads have ended: their last readings stay
        assert stopped.value(P + "generation_tokens_total") == 5
        assert stopped.value(P + "steps_total") == running.value(P + "steps_total")
        for thread in ("frontend", "completions", "engine"):
            assert stopped.value(P + "host_cpu_seconds_total", thread=thread) >= running.value(
                P + "host_cpu_seconds_total", thread=thread
            )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(exporter.url.replace("/metrics", "/other"), timeout=10)
        assert err.value.code == 404
    finally:
        exporter.close()
    exporter.close()  # twice is fine
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(exporter.url, timeout=2)


def test_importing_the_server_and_the_exporter_does_not_need_prometheus_client():
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import ringleader.hostctl.serving.server, ringleader.hostctl.serving.prometheus\n"
        "try:\n"
        "    ringleader.hostctl.serving.prometheus.MetricsExporter(None, '127.0.0.1', 0)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert 'pip install -e ".[http]"' in out.stdout and "prometheus-client>=" in out.stdout


# ---- the histogram ---------------------------------------------------------------------------
def test_histogram_buckets_are_prometheus_le_buckets():
    h = Histogram([0.1, 1.0, 10.0])
    for v in (0.0, 0.1, 0.10001, 1.0, 5.0, 10.0, 11.0, math.inf):
        h.observe(v)
    assert h.counts == [2, 2, 2, 2]  # <= 0.1 | (0.1, 1] | (1, 10] | > 10
    snap = h.snapshot()
    assert snap.cumulative() == [(0.1, 2), (1.0, 4), (10.0, 6), (math.inf, 8)]
    assert snap.cumulative()[-1][1] == snap.count == 8


def test_histogram_observes_n_equal_values_at_once():
    h, g = Histogram([1.0, 2.0]), Histogram([1.0, 2.0])
    h.observe(1.5, 4)
    for _ in range(4):
        g.observe(1.5)
    assert h.snapshot() == g.snapshot()
    assert h.count == 4 and h.sum == 6.0 and h.counts == [0, 4, 0]


def test_histogram_observe_array_matches_observe():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.exponential(1e-3, 1000), [1e-3, 2.5e-3, 0.0, 1.0]])
    a, b = Histogram([1e-4, 1e-3, 2.5e-3, 1e-2]), Histogram([1e-4, 1e-3, 2.5e-3, 1e-2])
    a.observe_array(values)
    for v in values.tolist():
        b.observe(v)
    assert a.counts == b.counts and a.count == b.count
    assert a.sum == pytest.approx(b.sum)


def test_histogram_refuses_bounds_that_are_not_increasing():
    for bad in ([], [1.0, 1.0], [2.0, 1.0], [1.0, math.inf]):
        with pytest.raises(ValueError):
            Histogram(bad)
    assert buckets_125(100) == (1, 2, 5, 10, 20, 50, 100)


# ---- the device timeline's incremental feed -------------------------------------------------
F = layout.TraceField


def trace_rows(n_rows: int, steps, *, trace_len: int = 8, chained=True, overlap=True) -> np.ndarray:
    """A trace ring of trace_len rows holding `steps` (step k at row k % trace_len, SEQ k + 1),
    as the scheduler writes them: critical 2 us, step 10 us, overlapped 3 us, steps 1 us apart
    (+k ns, so every gap differs), all in ns."""
    trace = np.zeros((trace_len, layout.TRACE_FIELDS), dtype=np.uint64)
    for k in steps:
        t0 = 1_000_000 + 20_000 * k
        row = trace[k % trace_len]
        row[F.SCHED_BEGIN], row[F.SCHED_END] = t0, t0 + 2_000
        row[F.STEP_BEGIN], row[F.STEP_END] = t0 + 3_000 + k, t0 + 13_000
        if overlap:
            row[F.OVERLAP_BEGIN], row[F.OVERLAP_END] = t0 + 2_500, t0 + 5_500
        row[F.FLAGS] = layout.TraceFlag.CHAINED if chained else 0
        row[F.SEQ] = k + 1
    return trace


def hists():
    return Histogram([1e-6, 1e-5]), Histogram([1e-6, 1e-5]), Histogram([1e-6, 1e-5, 1e-4])


def test_timeline_feed_observes_each_step_once():
    feed, (crit, over, bub) = TimelineFeed(), hists()
    trace = trace_rows(8, range(5))
    assert feed.feed(trace, crit, over, bub) == 5
    assert crit.count == over.count == 5 and bub.count == 4
    assert crit.sum == pytest.approx(5 * 2e-6) and over.sum == pytest.approx(5 * 3e-6)
    # the bubble: the next step's first kernel minus the previous step's end
    expected = sum((20_000 + 3_000 + k) - 13_000 for k in range(1, 5)) / 1e9
    assert bub.sum == pytest.approx(expected)
    summary = timeline_summary(trace)  # the same definition as the stats' bubble
    assert summary["bubble_gaps"] == bub.count
    assert feed.feed(trace, crit, over, bub) == 0 and crit.count == 5  # nothing new: nothing observed


def test_timeline_feed_takes_only_newer_rows_and_bridges_the_bubble_across_feeds():
    feed, (crit, over, bub) = TimelineFeed(), hists()
    feed.feed(trace_rows(8, range(5)), crit, over, bub)
    assert feed.last_seq == 5
    trace = trace_rows(8, range(5, 13))  # steps 5..12: the ring has overwritten 0..4
    assert feed.feed(trace, crit, over, bub) == 8
    assert crit.count == 13 and bub.count == 12  # 4 + the gap 4 -> 5 + 7 among the new rows
    assert feed.last_seq == 13


def test_timeline_feed_loses_what_the_ring_overwrote_and_pairs_no_bubble_across_the_gap():
    feed, (crit, over, bub) = TimelineFeed(), hists()
    feed.feed(trace_rows(8, range(3)), crit, over, bub)
    feed.feed(trace_rows(8, range(20, 28)), crit, over, bub)  # steps 3..19 were never read
    assert crit.count == 3 + 8
    assert bub.count == 2 + 7  # no bubble between step 2 and step 20


def test_timeline_feed_waits_for_a_row_to_be_final():
    feed, (crit, over, bub) = TimelineFeed(), hists()
    trace = trace_rows(8, range(3))
    trace[2, F.OVERLAP_BEGIN] = trace[2, F.OVERLAP_END] = 0  # its overlapped phase still runs
    trace[3, F.SCHED_BEGIN], trace[3, F.SCHED_END], trace[3, F.SEQ] = 9_000_000, 9_001_000, 4  # building
    assert len(complete_rows(trace)) == 3
    assert feed.feed(trace, crit, over, bub) == 2 and feed.last_seq == 2
    full = trace_rows(8, range(4))
    assert feed.feed(full, crit, over, bub) == 2  # steps 2 and 3, now final
    assert crit.count == over.count == 4 and bub.count == 3


def test_timeline_feed_counts_no_bubble_before_a_step_that_was_not_waited_for():
    feed, (crit, over, bub) = TimelineFeed(), hists()
    trace = trace_rows(8, range(4))
    trace[2, F.FLAGS] = 0  # the scheduler went idle before step 2: its gap is idle time
    feed.feed(trace, crit, over, bub)
    assert crit.count == 4 and bub.count == 2


def test_timeline_feed_of_an_unused_ring_observes_nothing():
    feed, (crit, over, bub) = TimelineFeed(), hists()
    assert feed.feed(np.zeros((8, layout.TRACE_FIELDS), dtype=np.uint64), crit, over, bub) == 0
    assert feed.feed(np.zeros((0, layout.TRACE_FIELDS), dtype=np.uint64), crit, over, bub) == 0
    assert crit.count == over.count == bub.count == 0
