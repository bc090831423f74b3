"""PNG plots of a benchmark document (matplotlib, Agg backend; nothing is shown on screen).

- throughput_vs_concurrency.png: closed loop: output tokens/s of all the run's requests together
  against concurrency, one line per scheduler.
- rate_sweep.png: open loop: achieved output tokens/s, and TTFT / E2E p50 in ms, against the
  offered request rate (finite rates only).
- latency_cdf.png: CDFs of TTFT, TPOT, ITL and E2E (ms; TPOT in ms per output token), one line
  per run.
- cpu_per_1k_tokens.png: server CPU-seconds per 1000 output tokens, per run, stacked by server
  thread (hf: the whole benchmark process).
- bubbles.png: GPU bubble p50/p99 and step time p50 in microseconds, only when a backend
  reported them.

Every figure's title (its suptitle) says what it compares (the runs' schedulers or variants, and
the busy processes of --cpu-interference), the model and device, the workload, and the machine,
from the document's "environment" (cpu_model, cpu_count, gpu). `<name>_figure(doc)` builds a
figure, or None when the document has nothing for it (so tests can read its texts back);
`write_all` saves each figure there is as <name>.png.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np

from ringleader.bench.report import load_label, run_label

_STYLES = ["-", "--", ":", "-."]
_TITLE_FONTSIZE = 9.5
_CHARS_PER_INCH = 13  # title characters per inch of figure width at _TITLE_FONTSIZE


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series_key(run: dict) -> str:
    return run["scheduler"] + (f" +{run['cpu_interference']} busy" if run.get("cpu_interference") else "")


def _colors(keys: list[str]) -> dict[str, str]:
    cycle = [f"C{i}" for i in range(10)]
    return {k: cycle[i % len(cycle)] for i, k in enumerate(keys)}


def _ordered_keys(runs: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in runs:
        k = _series_key(r)
        if k not in seen:
            seen.append(k)
    return seen


def _num(x) -> float:
    """A plotted value: None (or a non-number) as NaN, so it leaves a gap instead of a zero."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


# ---------------------------------------------------------------- what the titles say


def model_name(doc: dict) -> str:
    """The model of the document: a preset's name, or the last part of a checkpoint/GGUF path."""
    model = str(doc.get("model") or "?")
    return Path(model).name if "/" in model else model


def machine_text(doc: dict) -> str:
    """The machine the bench ran on, from the document's environment: CPU model, logical CPUs
    (os.cpu_count()) and the GPU when CUDA was there. With --connect / --http that is the bench
    client's machine; the server may be elsewhere."""
    env = doc.get("environment") or {}
    parts = []
    if env.get("cpu_model"):
        flags = [k for k, on in (env.get("cpu_flags") or {}).items() if on]
        parts.append(str(env["cpu_model"]) + (f" [{' '.join(flags)}]" if flags else ""))
    if env.get("cpu_count"):
        parts.append(f"{env['cpu_count']} logical CPUs")
    if env.get("gpu"):
        parts.append(f"GPU {env['gpu']}")
    text = ", ".join(parts) if parts else "unrecorded machine"
    settings = doc.get("settings") or {}
    if settings.get("connect") or settings.get("http"):
        return f"bench client host: {text}"
    return text


def workload_text(doc: dict) -> str:
    """The workload of the document's settings: token lengths, EOS and requests per run."""
    s = doc.get("settings") or {}
    parts = []
    if s.get("input_len") is not None and s.get("output_len") is not None:
        how = [s.get("length_dist") or "fixed"]
        if s.get("ignore_eos"):
            how.append("EOS ignored")
        parts.append(f"{s['input_len']} in / {s['output_len']} out tokens ({', '.join(how)})")
    req = s.get("requests")
    if isinstance(req, list):
        parts.append(f"{'/'.join(str(n) for n in req)} requests per load point")
    elif req is not None:
        parts.append(f"{req} requests per run")
    return ", ".join(parts)


def compared_text(runs: list[dict]) -> str:
    """What the runs compare: their schedulers (variants) in order, and the busy processes."""
    names: list[str] = []
    for r in runs:
        if r["scheduler"] not in names:
            names.append(r["scheduler"])
    text = " vs ".join(names)
    busy = sorted({int(r.get("cpu_interference") or 0) for r in runs} - {0})
    if busy:
        text += f", each without and with {'/'.join(str(b) for b in busy)} busy processes"
    return text


def title_text(doc: dict, runs: list[dict], what: str, width_in: float) -> str:
    """A figure's title: what it shows and compares; the model, device and workload; the machine.
    The machine goes on the first line when that fits the figure's width, else on a line of its
    own; a line too long for the width is wrapped."""
    device = doc.get("device")
    on = model_name(doc) + (f" on {device}" if device and device != "?" else "")
    workload = workload_text(doc)
    first = f"{what}: {compared_text(runs)}"
    machine = f"machine: {machine_text(doc)}"
    width = max(40, int(width_in * _CHARS_PER_INCH))
    lines = [f"{first}; {machine}"] if len(first) + len(machine) + 2 <= width else [first, machine]
    lines.insert(1, on + (f", {workload}" if workload else ""))
    return "\n".join(textwrap.fill(line, width) for line in lines)


def _suptitle(fig, doc: dict, runs: list[dict], what: str) -> None:
    fig.suptitle(title_text(doc, runs, what, fig.get_figwidth()), fontsize=_TITLE_FONTSIZE)


def figure_title(fig) -> str:
    """A figure's title as one line (the wrapping's line breaks as spaces)."""
    return " ".join(fig.get_suptitle().split())


# ---------------------------------------------------------------- the figures


def throughput_vs_concurrency_figure(doc: dict):
    runs = [r for r in doc["runs"] if r.get("concurrency") is not None and r.get("output_tokens_per_s")]
    if not runs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5.2))
    keys = _ordered_keys(runs)
    colors = _colors(keys)
    for k in keys:
        pts = sorted((r["concurrency"], r["output_tokens_per_s"]) for r in runs if _series_key(r) == k)
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", color=colors[k], linestyle="--" if "busy" in k else "-", label=k)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["concurrency"] for r in runs}))
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency (requests in flight, closed loop; log scale)")
    ax.set_ylabel("output tokens/s (all requests of the run together)")
    _suptitle(fig, doc, runs, "Output throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def _arrivals(doc: dict) -> str:
    b = (doc.get("settings") or {}).get("burstiness")
    if b is None:
        return "arrivals"
    return "Poisson arrivals" if b == 1.0 else f"gamma arrivals, burstiness {b:g}"


def rate_sweep_figure(doc: dict):
    runs = [
        r
        for r in doc["runs"]
        if r.get("concurrency") is None and isinstance(r.get("request_rate"), (int, float))
    ]
    if not runs:
        return None
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.8))
    keys = _ordered_keys(runs)
    colors = _colors(keys)
    for k in keys:
        sel = sorted((r for r in runs if _series_key(r) == k), key=lambda r: r["request_rate"])
        xs = [r["request_rate"] for r in sel]
        a1.plot(xs, [_num(r["output_tokens_per_s"]) for r in sel], marker="o", color=colors[k], label=k)
        a2.plot(
            xs, [_num(r["ttft_ms"]["p50"]) for r in sel], marker="o", color=colors[k], label=f"{k} TTFT p50"
        )
        a2.plot(
            xs,
            [_num(r["e2e_ms"]["p50"]) for r in sel],
            marker="s",
            linestyle="--",
            color=colors[k],
            label=f"{k} E2E p50",
        )
    xlabel = f"offered request rate (requests/s, {_arrivals(doc)})"
    a1.set_xlabel(xlabel)
    a1.set_ylabel("achieved output tokens/s (all requests together)")
    a1.set_title("achieved throughput", fontsize=9)
    a2.set_xlabel(xlabel)
    a2.set_ylabel("p50 latency (ms, log scale)")
    a2.set_yscale("log")
    a2.set_title("TTFT p50 (solid) and E2E p50 (dashed)", fontsize=9)
    for a in (a1, a2):
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    _suptitle(fig, doc, runs, "Open loop: throughput and latency vs offered rate")
    return fig


_CDF_PANELS = [
    ("ttft_ms", "TTFT: time to first token", "TTFT (ms, log scale)", "fraction of requests"),
    (
        "tpot_ms",
        "TPOT: time per output token",
        "TPOT (ms per output token, log scale)",
        "fraction of requests",
    ),
    (
        "itl_ms",
        "ITL: gap between tokens (0 within a message)",
        "inter-token gap (ms, symlog scale)",
        "fraction of token gaps",
    ),
    ("e2e_ms", "E2E: request latency", "E2E (ms, log scale)", "fraction of requests"),
]


def latency_cdf_figure(doc: dict):
    runs = [r for r in doc["runs"] if r.get("_samples")]
    if not any(r["_samples"].get("e2e_ms") for r in runs):
        return None
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.4))
    keys = _ordered_keys(runs)
    colors = _colors(keys)
    loads = []
    for r in runs:
        if load_label(r) not in loads:
            loads.append(load_label(r))
    for ax, (metric, title, xlabel, ylabel) in zip(axes.flat, _CDF_PANELS):
        for r in runs:
            vals = np.sort(np.asarray(r["_samples"].get(metric) or [], dtype=float))
            if vals.size == 0:
                continue
            ys = np.arange(1, vals.size + 1) / vals.size
            ax.step(
                vals,
                ys,
                where="post",
                color=colors[_series_key(r)],
                linestyle=_STYLES[loads.index(load_label(r)) % len(_STYLES)],
                label=run_label(r),
            )
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if metric != "itl_ms":
            ax.set_xscale("log")
        else:
            ax.set_xscale("symlog", linthresh=0.1)
        ax.grid(True, alpha=0.3)
    _suptitle(fig, doc, runs, "Latency CDFs")
    handles, labels = axes.flat[3].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(labels))), fontsize=7)
    fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(labels) + 3) // 4), 1, 1))
    return fig


CPU_YLABEL = "server CPU-seconds per 1k output tokens"


def cpu_per_1k_tokens_figure(doc: dict):
    """cpu_s_per_1k_tokens of each run: the server process's CPU-seconds over the run (all its
    threads) / (the output tokens its stats counted over the run / 1000), stacked by the
    per-thread figures of the same division; the rest is the process's other threads."""
    runs = [r for r in doc["runs"] if r.get("cpu_s_per_1k_tokens") is not None]
    if not runs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(9, 0.9 * len(runs) + 2), 5.2))
    threads = sorted({t for r in runs for t in (r.get("thread_cpu_s_per_1k_tokens") or {})})
    x = np.arange(len(runs))
    bottom = np.zeros(len(runs))
    for i, t in enumerate(threads):
        vals = np.array([(r.get("thread_cpu_s_per_1k_tokens") or {}).get(t) or 0.0 for r in runs])
        ax.bar(x, vals, bottom=bottom, color=f"C{i}", label=f"thread {t}")
        bottom += vals
    total = np.array([r["cpu_s_per_1k_tokens"] for r in runs], dtype=float)
    rest = np.clip(total - bottom, 0, None)
    ax.bar(x, rest, bottom=bottom, color="lightgray", label="rest of the process")
    for xi, v in zip(x, total):
        ax.text(xi, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [run_label(r) for r in runs], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel(f"{CPU_YLABEL}\n(CPU time of all threads, not wall time)")
    caveats = []
    if any(r["scheduler"] == "hf" for r in runs):
        caveats.append("hf: the whole benchmark process (model and load generator)")
    if any(r["scheduler"] == "gateway" for r in runs):
        caveats.append("gateway: includes the in-process HTTP gateway")
    if caveats:
        ax.set_xlabel("; ".join(caveats), fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    _suptitle(fig, doc, runs, "Server CPU-seconds per 1k output tokens, by thread")
    return fig


def bubbles_figure(doc: dict):
    runs = [r for r in doc["runs"] if r.get("bubble_us_p50") is not None]
    if not runs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(9, 0.9 * len(runs) + 2), 5.2))
    x = np.arange(len(runs))
    w = 0.27
    for off, key, label in (
        (-w, "bubble_us_p50", "bubble p50"),
        (0, "bubble_us_p99", "bubble p99"),
        (w, "step_us_p50", "step time p50"),
    ):
        ax.bar(x + off, [_num(r.get(key)) for r in runs], width=w, label=label)
    ax.set_xticks(x, [run_label(r) for r in runs], rotation=35, ha="right", fontsize=7)
    ax.set_xlabel("percentiles of the backend's recent steps, as of the end of each run", fontsize=8)
    ax.set_ylabel("microseconds per gap / per step (log scale)")
    ax.set_yscale("log")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    _suptitle(fig, doc, runs, "GPU idle gap between steps (bubble) and step time")
    return fig


FIGURES = {
    "throughput_vs_concurrency": throughput_vs_concurrency_figure,
    "rate_sweep": rate_sweep_figure,
    "latency_cdf": latency_cdf_figure,
    "cpu_per_1k_tokens": cpu_per_1k_tokens_figure,
    "bubbles": bubbles_figure,
}


def build_figures(doc: dict) -> dict:
    """{name: figure} of every plot the document has data for, in FIGURES' order."""
    out = {}
    for name, build in FIGURES.items():
        fig = build(doc)
        if fig is not None:
            out[name] = fig
    return out


# ---------------------------------------------------------------- files


def throughput_vs_concurrency(doc: dict, out_dir: Path) -> Path | None:
    return _write(doc, out_dir, "throughput_vs_concurrency")


def rate_sweep(doc: dict, out_dir: Path) -> Path | None:
    return _write(doc, out_dir, "rate_sweep")


def latency_cdf(doc: dict, out_dir: Path) -> Path | None:
    return _write(doc, out_dir, "latency_cdf")


def cpu_per_1k_tokens(doc: dict, out_dir: Path) -> Path | None:
    return _write(doc, out_dir, "cpu_per_1k_tokens")


def bubbles(doc: dict, out_dir: Path) -> Path | None:
    return _write(doc, out_dir, "bubbles")


def write_all(doc: dict, out_dir: str | Path) -> list[str]:
    """Each plot the document has data for, as out_dir/<name>.png; the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [_write(doc, out, name) for name in FIGURES]
    return [str(p) for p in paths if p is not None]


def _write(doc: dict, out_dir: Path, name: str) -> Path | None:
    fig = FIGURES[name](doc)
    if fig is None:
        return None
    return save_figure(fig, Path(out_dir) / f"{name}.png", tight=name != "latency_cdf")


def save_figure(fig, path: Path, tight: bool = True) -> Path:
    """Writes the figure as a PNG and closes it."""
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
