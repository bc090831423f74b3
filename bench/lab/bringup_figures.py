"""The key figures of a finished stage for bringup.json: its own result.json, else what its
tools wrote (the gpu_limits JSON, the benchmark's results.json, pytest's junit.xml)."""

from __future__ import annotations

import glob
import json
import xml.etree.ElementTree as ET
from pathlib import Path

from ringleader.bench.lab.bringup_stages import Stage
from ringleader.bench.lab.goals import step_kernels_of

SERVING_STAGES = ("perf", "goals-layered")  # beside the bubble-* stages: the benchmark's figures


def probe_figures(stage_dir: Path) -> dict | None:
    """Per-probe status from the gpu_limits JSON the gpu-limits stage wrote."""
    files = sorted(glob.glob(str(stage_dir / "*gpu-limits*.json")))
    if not files:
        return None
    try:
        doc = json.loads(Path(files[-1]).read_text())
    except (OSError, ValueError):
        return None
    probes = doc.get("probes") if isinstance(doc, dict) else None
    if isinstance(probes, dict):
        return {str(k): (v.get("status") if isinstance(v, dict) else v) for k, v in probes.items()}
    return {"keys": sorted(doc)[:20]} if isinstance(doc, dict) else None


def perf_figures(stage_dir: Path) -> dict | None:
    try:
        doc = json.loads((stage_dir / "results.json").read_text())
    except (OSError, ValueError):
        return None
    out = {}
    for run in doc.get("runs", []) if isinstance(doc, dict) else []:
        key = f"{run.get('scheduler')} c={run.get('concurrency')} rate={run.get('request_rate')}"
        out[key] = {
            k: run.get(k) for k in ("output_tokens_per_s", "cpu_s_per_1k_tokens", "completed", "failed")
        }
        out[key]["tpot_ms_p50"] = (run.get("tpot_ms") or {}).get("p50")
        out[key]["launch"] = (run.get("backend") or {}).get("launch")
        out[key]["step_kernels"] = step_kernels_of(run, doc)  # None: the server's default
        dev = run.get("device_stats") or {}
        out[key].update(
            {
                k: dev.get(k)
                for k in (
                    "bubble_us_p50",
                    "bubble_us_p99",
                    "bubble_gaps",
                    "idle_gaps",
                    "handoff_us_p50",
                    "launch_us_p50",
                    "device_sched_us_p50",
                    "device_sched_us_p99",
                    "void_steps",  # once bench/servers.py carries it into device_stats
                    "device_overlap_us_p50",
                    "overlap_overruns",
                    "step_us_p50",
                )
                if k in dev
            }
        )
    return out or None


def junit_figures(path: Path) -> dict | None:
    """Counts and each test's outcome from a pytest --junitxml file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    tests = {}
    for case in root.iter("testcase"):
        module = (case.get("classname") or "").replace(".", "/")
        node = f"{module}.py::{case.get('name')}" if module else str(case.get("name"))
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = "failed" if tag == "failure" else tag
                break
        tests[node] = outcome
    counts = {k: sum(1 for o in tests.values() if o == k) for k in ("passed", "failed", "error", "skipped")}
    return {**counts, "tests": tests}


def stage_figures(stage: Stage, stage_dir: Path, log_tail: str) -> dict | None:
    result = stage_dir / "result.json"
    if result.exists():
        try:
            doc = json.loads(result.read_text())
            if isinstance(doc, dict):
                return doc
        except ValueError:
            pass
    if stage.name == "gpu-limits":
        return probe_figures(stage_dir)
    if stage.name in SERVING_STAGES or stage.name.startswith("bubble-"):
        return perf_figures(stage_dir)
    if stage.name == "tests":
        figures = junit_figures(stage_dir / "junit.xml")
        if figures is None:  # no junit.xml: pytest-timeout ended the process, say
            lines = [ln for ln in log_tail.splitlines() if ln.strip()]
            figures = {"outcome": lines[-1] if lines else ""}
        return figures
    return None
