"""PNG plots of a benchmark document (matplotlib, Agg backend; nothing is shown on screen).

- throughput_vs_concurrency.png: output tokens/s against closed-loop concurrency, per scheduler.
- rate_sweep.png: open loop: achieved output tokens/s and TTFT/E2E p50 against offered rate.
- latency_cdf.png: CDFs of TTFT, TPOT, ITL and E2E, one line per run.
- cpu_per_1k_tokens.png: server CPU-seconds per 1k output tokens, per run (stacked by thread).
- bubbles.png: GPU bubble p50/p99 and step time, only when a backend reported them.
Each function returns the path it wrote, or None when the document has nothing to plot.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.report import load_label, run_label

_STYLES = ["-", "--", ":", "-."]


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


def throughput_vs_concurrency(doc: dict, out_dir: Path) -> Path | None:
    runs = [r for r in doc["runs"] if r.get("concurrency") is not None and r.get("output_tokens_per_s")]
    if not runs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = _ordered_keys(runs)
    colors = _colors(keys)
    for k in keys:
        pts = sorted((r["concurrency"], r["output_tokens_per_s"]) for r in runs if _series_key(r) == k)
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", color=colors[k], linestyle="--" if "busy" in k else "-", label=k)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["concurrency"] for r in runs}))
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"throughput, {doc['model']} on {doc['device']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, out_dir / "throughput_vs_concurrency.png")


def rate_sweep(doc: dict, out_dir: Path) -> Path | None:
    runs = [
        r
        for r in doc["runs"]
        if r.get("concurrency") is None and isinstance(r.get("request_rate"), (int, float))
    ]
    if not runs:
        return None
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = _ordered_keys(runs)
    colors = _colors(keys)
    for k in keys:
        sel = sorted((r for r in runs if _series_key(r) == k), key=lambda r: r["request_rate"])
        xs = [r["request_rate"] for r in sel]
        a1.plot(xs, [r["output_tokens_per_s"] or 0 for r in sel], marker="o", color=colors[k], label=k)
        a2.plot(xs, [r["ttft_ms"]["p50"] for r in sel], marker="o", color=colors[k], label=f"{k} TTFT p50")
        a2.plot(
            xs,
            [r["e2e_ms"]["p50"] for r in sel],
            marker="s",
            linestyle="--",
            color=colors[k],
            label=f"{k} E2E p50",
        )
    a1.set_xlabel("offered request rate (req/s)")
    a1.set_ylabel("output tokens / s")
    a1.set_title("open loop: throughput")
    a2.set_xlabel("offered request rate (req/s)")
    a2.set_ylabel("ms")
    a2.set_yscale("log")
    a2.set_title("open loop: latency")
    for a in (a1, a2):
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    return _save(fig, out_dir / "rate_sweep.png")


def latency_cdf(doc: dict, out_dir: Path) -> Path | None:
    runs = [r for r in doc["runs"] if r.get("_samples")]
    if not any(r["_samples"].get("e2e_ms") for r in runs):
        return None
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    keys = _ordered_keys(runs)
    colors = _colors(keys)
    loads = []
    for r in runs:
        if load_label(r) not in loads:
            loads.append(load_label(r))
    for ax, (metric, title) in zip(
        axes.flat, [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")]
    ):
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
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        if metric != "itl_ms":
            ax.set_xscale("log")
        else:
            ax.set_xscale("symlog", linthresh=0.1)
        ax.grid(True, alpha=0.3)
    handles, labels = axes.flat[3].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(labels))), fontsize=7)
    fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(labels) + 3) // 4), 1, 1))
    return _save(fig, out_dir / "latency_cdf.png", tight=False)


def cpu_per_1k_tokens(doc: dict, out_dir: Path) -> Path | None:
    runs = [r for r in doc["runs"] if r.get("cpu_s_per_1k_tokens") is not None]
    if not runs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(runs) + 2), 4.5))
    threads = sorted({t for r in runs for t in (r.get("thread_cpu_s_per_1k_tokens") or {})})
    x = np.arange(len(runs))
    bottom = np.zeros(len(runs))
    for i, t in enumerate(threads):
        vals = np.array([(r.get("thread_cpu_s_per_1k_tokens") or {}).get(t) or 0.0 for r in runs])
        ax.bar(x, vals, bottom=bottom, color=f"C{i}", label=f"thread {t}")
        bottom += vals
    total = np.array([r["cpu_s_per_1k_tokens"] for r in runs])
    rest = np.clip(total - bottom, 0, None)
    ax.bar(x, rest, bottom=bottom, color="lightgray", label="other threads")
    for xi, v in zip(x, total):
        ax.text(xi, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [run_label(r) for r in runs], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("server CPU-seconds per 1k output tokens")
    ax.set_title("host CPU cost per token (whole server process)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out_dir / "cpu_per_1k_tokens.png")


def bubbles(doc: dict, out_dir: Path) -> Path | None:
    runs = [r for r in doc["runs"] if r.get("bubble_us_p50") is not None]
    if not runs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(runs) + 2), 4.5))
    x = np.arange(len(runs))
    w = 0.27
    for off, key, label in (
        (-w, "bubble_us_p50", "bubble p50"),
        (0, "bubble_us_p99", "bubble p99"),
        (w, "step_us_p50", "step p50"),
    ):
        ax.bar(x + off, [r.get(key) or 0.0 for r in runs], width=w, label=label)
    ax.set_xticks(x, [run_label(r) for r in runs], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("microseconds")
    ax.set_yscale("log")
    ax.set_title("GPU bubble between steps and step time")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out_dir / "bubbles.png")


def write_all(doc: dict, out_dir: str | Path) -> list[str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        f(doc, out) for f in (throughput_vs_concurrency, rate_sweep, latency_cdf, cpu_per_1k_tokens, bubbles)
    ]
    return [str(p) for p in paths if p is not None]


def _save(fig, path: Path, tight: bool = True) -> Path:
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
