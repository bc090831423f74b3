"""bench/plots.py: each plot's title names what it compares, the model, the workload and the
machine, and each axis its unit, drawn (Agg) from a small synthetic result of the shape
`ringleader bench` writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringleader.bench import plots, report
from ringleader.bench.loadgen import Load, RunResult
from ringleader.bench.metrics import RequestRecord

pytest.importorskip("matplotlib")

ENV = {
    "git": {"commit": "0" * 40, "dirty": False},
    "python": "3.11.7",
    "platform": "Linux-x86_64",
    "cpu_count": 8,
    "cpu_model": "AMD EPYC 7B13",
    "loadavg_at_end": [0.5, 0.5, 0.5],
    "torch": "2.13.0",
    "gpu": "NVIDIA H100 80GB HBM3",
    "cuda": "13.0",
}
MODEL_PATH = "/opt/models/SmolLM2-135M.Q4_1.gguf"
N_REQ, N_TOK = 4, 10  # requests per run, output tokens per request
SMOLLM2 = Path(__file__).resolve().parent.parent / "bench/results/2026-11-23-cpu-smollm2/results.json"


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def _records(concurrency: int) -> list[RequestRecord]:
    out = []
    for i in range(N_REQ):
        t0 = 0.01 * i
        first = t0 + 0.02 * concurrency
        chunk_t = [first + 0.005 * k for k in range(N_TOK)]
        out.append(
            RequestRecord(
                index=i,
                prompt_tokens=64,
                max_tokens=N_TOK,
                send_t=t0,
                chunk_t=chunk_t,
                chunk_n=[1] * N_TOK,
                done_t=chunk_t[-1] + 0.001,
                finish_reason="length",
                completion_tokens=N_TOK,
                server_queue_ms=1.0,
            )
        )
    return out


def _cpu_s(scheduler: str, concurrency, rate, busy: int) -> float:
    """The server CPU-seconds of a synthetic run (distinct per run, to find them on the plot)."""
    return (
        {"device": 0.2, "host": 0.3, "static": 0.4, "hf": 0.8}[scheduler]
        + 0.01 * (concurrency or rate)
        + 0.05 * busy
    )


def _run(scheduler: str, *, concurrency=None, rate=None, busy=0) -> dict:
    cpu = _cpu_s(scheduler, concurrency, rate, busy)
    before = {"process_cpu_s": 100.0, "output_tokens": 1000}
    after = {"process_cpu_s": 100.0 + cpu, "output_tokens": 1000 + N_REQ * N_TOK}
    if scheduler != "hf":
        before["thread_cpu_s"] = {"engine": 50.0, "frontend": 5.0}
        after["thread_cpu_s"] = {"engine": 50.0 + cpu / 2, "frontend": 5.0 + cpu / 10}
    if scheduler == "device":
        before["device"] = {"steps": 0}
        after["device"] = {"steps": 40, "bubble_us_p50": 6.0, "bubble_us_p99": 30.0, "step_us_p50": 800.0}
    result = RunResult(
        records=_records(concurrency or 1),
        stats_before=before,
        stats_after=after,
        loadgen_cpu_s=0.01,
        wall_s=0.5,
    )
    load = Load(concurrency=concurrency) if concurrency else Load(request_rate=rate)
    return report.make_run_entry(
        scheduler=scheduler,
        device="cuda",
        model=MODEL_PATH,
        load=load,
        result=result,
        burstiness=1.0,
        busy={"busy_processes": busy, "busy_cpu_s": 0.1} if busy else None,
    )


@pytest.fixture
def doc(monkeypatch):
    monkeypatch.setattr(report, "environment", lambda: dict(ENV))
    runs = [
        _run(s, concurrency=c, busy=b)
        for s in ("device", "host", "static", "hf")
        for c in (1, 8)
        for b in ((0, 2) if s == "host" else (0,))
    ]
    runs += [_run(s, rate=r) for s in ("device", "host") for r in (2.0, 5.0)]
    settings = {
        "requests": N_REQ,
        "input_len": 64,
        "output_len": N_TOK,
        "length_dist": "fixed",
        "ignore_eos": True,
        "burstiness": 1.0,
        "connect": None,
        "http": None,
    }
    return report.build_document(
        command=["--compare", "device,host,static,hf"],
        settings=settings,
        model=MODEL_PATH,
        device="cuda",
        runs=runs,
        notes=[],
    )


def _flat(text: str) -> str:
    return " ".join(text.split())


def _check_title(fig, *, compared: str) -> str:
    title = plots.figure_title(fig)
    assert compared in title, title
    assert "AMD EPYC 7B13, 8 logical CPUs, GPU NVIDIA H100 80GB HBM3" in title
    assert "SmolLM2-135M.Q4_1.gguf on cuda" in title and "/opt/models" not in title
    assert "64 in / 10 out tokens (fixed, EOS ignored), 4 requests per run" in title
    lines = fig.get_suptitle().split("\n")
    assert all(len(line) <= plots._CHARS_PER_INCH * fig.get_figwidth() for line in lines)
    return title


def _bar_tops(ax) -> dict[float, float]:
    """The stacked bars' total height at each x."""
    tops: dict[float, float] = {}
    for p in ax.patches:
        x = round(p.get_x() + p.get_width() / 2, 6)
        tops[x] = tops.get(x, 0.0) + p.get_height()
    return tops


def test_cpu_plot_is_per_1k_output_tokens_and_names_the_machine(doc):
    fig = plots.cpu_per_1k_tokens_figure(doc)
    (ax,) = fig.axes
    title = _check_title(fig, compared="device vs host vs static vs hf, each without and with 2 busy")
    assert "per 1k output tokens" in title and "per token" not in title
    assert _flat(ax.get_ylabel()).startswith("server CPU-seconds per 1k output tokens")
    assert "hf: the whole benchmark process" in ax.get_xlabel()
    # what is drawn is CPU-seconds / (output tokens / 1000), computed here from the stats
    runs = doc["runs"]
    tops = _bar_tops(ax)
    for i, r in enumerate(runs):
        cpu = _cpu_s(r["scheduler"], r["concurrency"], r["request_rate"], r["cpu_interference"])
        assert tops[float(i)] == pytest.approx(cpu / (N_REQ * N_TOK / 1000.0))
    assert [t.get_text() for t in ax.get_xticklabels()] == [report.run_label(r) for r in runs]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["thread engine", "thread frontend", "rest of the process"]


def test_throughput_plot(doc):
    fig = plots.throughput_vs_concurrency_figure(doc)
    (ax,) = fig.axes
    _check_title(fig, compared="device vs host vs static vs hf, each without and with 2 busy processes")
    assert ax.get_ylabel().startswith("output tokens/s")
    assert ax.get_xlabel().startswith("concurrency (requests in flight")
    host = next(line for line in ax.get_lines() if line.get_label() == "host")
    want = [
        r["output_tokens_per_s"]
        for r in doc["runs"]
        if r["scheduler"] == "host" and r["concurrency"] and not r["cpu_interference"]
    ]
    assert list(host.get_xdata()) == [1, 8] and list(host.get_ydata()) == pytest.approx(want)


def test_rate_sweep_plot(doc):
    fig = plots.rate_sweep_figure(doc)
    a1, a2 = fig.axes
    _check_title(fig, compared="device vs host")
    assert "Open loop" in plots.figure_title(fig)
    for ax in (a1, a2):
        assert ax.get_xlabel() == "offered request rate (requests/s, Poisson arrivals)"
    assert a1.get_ylabel().startswith("achieved output tokens/s")
    assert a2.get_ylabel() == "p50 latency (ms, log scale)"


def test_latency_cdf_plot(doc):
    fig = plots.latency_cdf_figure(doc)
    _check_title(fig, compared="device vs host vs static vs hf")
    axes = fig.axes
    assert [ax.get_xlabel() for ax in axes] == [
        "TTFT (ms, log scale)",
        "TPOT (ms per output token, log scale)",
        "inter-token gap (ms, symlog scale)",
        "E2E (ms, log scale)",
    ]
    assert [ax.get_ylabel() for ax in axes] == [
        "fraction of requests",
        "fraction of requests",
        "fraction of token gaps",
        "fraction of requests",
    ]


def test_bubbles_plot(doc):
    fig = plots.bubbles_figure(doc)
    (ax,) = fig.axes
    title = _check_title(fig, compared="device")
    assert "GPU idle gap between steps (bubble) and step time" in title
    assert ax.get_ylabel().startswith("microseconds")
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        report.run_label(r) for r in doc["runs"] if r["scheduler"] == "device"
    ]


def test_write_all_and_the_written_json(doc, tmp_path):
    paths = plots.write_all(doc, tmp_path / "plots")
    assert [Path(p).name for p in paths] == [f"{name}.png" for name in plots.FIGURES]
    assert all(Path(p).stat().st_size > 0 for p in paths)
    # the JSON as written (no latency samples: no CDF) draws the same titles
    report.write_json(doc, tmp_path / "results.json")
    loaded = json.loads((tmp_path / "results.json").read_text())
    figs = plots.build_figures(loaded)
    assert list(figs) == ["throughput_vs_concurrency", "rate_sweep", "cpu_per_1k_tokens", "bubbles"]
    assert plots.figure_title(figs["cpu_per_1k_tokens"]) == plots.figure_title(
        plots.cpu_per_1k_tokens_figure(doc)
    )


def test_machine_text():
    assert plots.machine_text({"environment": ENV}) == (
        "AMD EPYC 7B13, 8 logical CPUs, GPU NVIDIA H100 80GB HBM3"
    )
    cpu_only = {k: v for k, v in ENV.items() if k not in ("gpu", "cuda")}
    assert plots.machine_text({"environment": cpu_only}) == "AMD EPYC 7B13, 8 logical CPUs"
    connected = {"environment": cpu_only, "settings": {"connect": "tcp://10.0.0.2:5555"}}
    assert plots.machine_text(connected) == "bench client host: AMD EPYC 7B13, 8 logical CPUs"
    assert plots.machine_text({}) == "unrecorded machine"


@pytest.mark.skipif(not SMOLLM2.exists(), reason="committed result not present")
def test_a_committed_result_draws_with_its_machine():
    doc = json.loads(SMOLLM2.read_text())
    figs = plots.build_figures(doc)
    assert list(figs) == ["throughput_vs_concurrency", "cpu_per_1k_tokens"]
    for fig in figs.values():
        title = plots.figure_title(fig)
        assert "host vs static vs hf" in title
        assert "SmolLM2-135M-Instruct.Q4_1.gguf on cpu" in title and ".venv" not in title
        assert "64 in / 64 out tokens (fixed, EOS ignored), 8/24/64 requests per load point" in title
        assert "machine: AMD EPYC, 2 logical CPUs" in title
    (ax,) = figs["cpu_per_1k_tokens"].axes
    tops = _bar_tops(ax)
    for i, r in enumerate(doc["runs"]):  # CPU-seconds / (server output tokens / 1000)
        assert tops[float(i)] == pytest.approx(r["server_cpu_s"] / (r["server_output_tokens"] / 1000.0))
