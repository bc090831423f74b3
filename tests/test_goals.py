"""The goals report (bench/lab/goals.py): one row per goal from the files a GPU window returns,
met / missed / not measured, read from folders, JSON files and the bring-up's archives."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile

from ringleader.bench.lab.bringup_figures import stage_figures
from ringleader.bench.lab.bringup_stages import RUN_LIMITS, builtin_stages
from ringleader.bench.lab.goals import goals, load_documents


def run(
    scheduler, c=None, rate=None, tok_s=1000.0, bubble=(2.0, 8.0), cpu=0.01, steps=1000, busy=0, thread=1e-3
):
    name = "rl-cq-poll" if scheduler == "device" else "rl-host-sched"
    return {
        "model": "llama-1b",
        "scheduler": scheduler,
        "concurrency": c,
        "request_rate": rate,
        "cpu_interference": busy,
        "prefix_caching": None,
        "completed": 10,
        "output_tokens_per_s": tok_s,
        "bubble_us_p50": bubble[0],
        "bubble_us_p99": bubble[1],
        "cpu_s_per_1k_tokens": cpu,
        "thread_cpu_s": {name: thread, "frontend": 0.5},
        "device_stats": {"steps": steps},
    }


def all_met_document() -> dict:
    runs = []
    for c in (1, 32, 256):
        runs += [run("device", c, tok_s=1100, thread=1e-3), run("host", c, tok_s=1000, cpu=0.02, thread=2e-2)]
    runs += [run("device", rate=100.0, tok_s=900), run("host", rate=100.0, tok_s=880, cpu=0.02)]
    runs += [run("device", 32, tok_s=1080, busy=16), run("host", 32, tok_s=700, busy=16)]
    return {"runs": runs}


def layered_document(tok_s=900.0) -> dict:
    """goals-layered's document: device runs only, the old step asked for through --server-arg."""
    runs = [run("device", c, tok_s=tok_s, bubble=(40.0, 90.0), cpu=0.5, thread=1.0) for c in (1, 32, 256)]
    return {"settings": {"server_arg": ["--step-kernels", "layered", "--run-budget-s", "300"]}, "runs": runs}


ROOFLINE = {
    "model": "llama-1b",
    "copy_bandwidth_GBps": 4000.0,
    "steps": [{"rows": 1, "step_us": 700.0, "floor_us": 620.0, "ratio": 1.13}],
}


def verdicts(rows) -> list[str]:
    return [g.verdict for g in rows]


def test_every_goal_met_and_each_one_missed_by_its_own_number():
    rows = goals([all_met_document(), layered_document()], [ROOFLINE])
    assert verdicts(rows) == ["met"] * 8, [(g.goal, g.measured) for g in rows]
    assert "x20.00 lower" in rows[2].measured  # 2e-2 vs 1e-3 s over the same steps
    assert "host c=32 +16 busy: 70.0% kept" in rows[6].measured  # host's shown beside, not judged
    doc = all_met_document()
    doc["runs"][2]["bubble_us_p99"] = 10.5  # device at c=32
    doc["runs"][0]["thread_cpu_s"]["rl-cq-poll"] = 3e-3  # only x6.7 below the host at c=1
    doc["runs"][-2]["output_tokens_per_s"] = 1000  # 90.9% kept
    slow = dict(ROOFLINE, steps=[dict(ROOFLINE["steps"][0], ratio=1.9)])
    rows = goals([doc, layered_document(tok_s=1150.0)], [slow])
    assert verdicts(rows) == ["missed", "missed", "missed", "met", "met", "met", "missed", "missed"]


def test_a_load_that_did_not_run_is_not_measured_and_a_partial_run_says_so():
    assert set(verdicts(goals([], []))) == {"not measured"}
    doc = all_met_document()
    doc["runs"] = [r for r in doc["runs"] if r["concurrency"] != 256]
    rows = goals([doc], [])
    assert rows[0].verdict == "met where measured" and "c=256: not measured" in rows[0].measured
    assert rows[1].verdict == "not measured"


def test_two_windows_are_both_shown_and_both_must_meet():
    e, f = all_met_document(), all_met_document()
    f["runs"][1]["output_tokens_per_s"] = 1200  # host beats device at c=1 in the second run
    rows = goals([e, f], [ROOFLINE])
    assert rows[4].verdict == "missed" and "c=1: 1100 / 1100 vs 1000 / 1200" in rows[4].measured


def test_documents_are_found_in_folders_and_archives_and_the_cli_writes_both_files(tmp_path):
    (tmp_path / "E" / "goals-e").mkdir(parents=True)
    (tmp_path / "E" / "goals-e" / "results.json").write_text(json.dumps(all_met_document()))
    data = json.dumps(ROOFLINE).encode()
    with tarfile.open(tmp_path / "E" / "artifacts.tar.gz", "w:gz") as t:
        info = tarfile.TarInfo("roofline-profile/result.json")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    bench, roofline, limits = load_documents([tmp_path / "E"])
    assert len(bench) == 1 and roofline == [ROOFLINE] and limits == []
    out = tmp_path / "report"
    r = subprocess.run(
        [sys.executable, "-m", "ringleader.bench.lab.goals", str(tmp_path / "E"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "goals.json").read_text())
    assert [g["verdict"] for g in doc["goals"]] == ["met"] * 7 + ["not measured"]  # no layered runs
    assert (out / "summary.md").read_text().count("**met**") == 7
    # no gpu_limits document: every design row says so
    assert doc["designs"] and {d["verdict"] for d in doc["designs"]} == {"not measured"}


# ---------------------------------------------------------------- run F's launch pair


def launch_run(launch, c, bubble, crit, tpot_ms=1.39):
    r = run("device", c, bubble=bubble)
    r.update(backend={"launch": launch}, tpot_ms={"p50": tpot_ms, "p99": tpot_ms})
    r["device_stats"].update(bubble_us_p50=bubble[0], bubble_us_p99=bubble[1])  # as make_run_entry has both
    r["device_stats"].update(device_sched_us_p50=crit[0], device_sched_us_p99=crit[1])
    return r


def test_the_launch_pair_stages_differ_only_in_the_launch_and_the_signal_and_fit_run_f():
    stages = {s.name: s for s in builtin_stages()}
    pp, res, goals_f = stages["bubble-pingpong"], stages["bubble-resident"], stages["goals-f"]
    assert pp.run == res.run == "F" and pp.timeout_s == res.timeout_s
    names = [s.name for s in builtin_stages() if s.run == "F"]
    assert names[:2] == ["bubble-resident", "bubble-pingpong"]  # first: the bubble goal hangs on them
    assert sum(s.timeout_s for s in stages.values() if s.run == "F") <= RUN_LIMITS["F"]

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    assert flag(pp.argv, "--launch") == "pingpong" and flag(res.argv, "--launch") == "resident"
    # the design (its signal in the step where it builds) against the launch the H100 measured
    signal = "--server-arg=--step-signal"
    assert flag(pp.argv, signal) == "--server-arg=auto" and flag(res.argv, signal) == "--server-arg=node"
    same = [a.replace("pingpong", "resident").replace("=auto", "=node") for a in pp.argv]
    assert same == res.argv
    assert flag(pp.argv, "--compare") == "device"
    for name in ("--concurrency", "--slots", "--requests", "--input-len", "--output-len"):
        assert flag(pp.argv, name) == flag(goals_f.argv, name), name  # the same loads as goals-f
    assert "--server-arg={run_budget_s}" in pp.argv and "--server-arg={dir}/device-trace.json" in pp.argv


def test_the_launch_pair_figures_and_one_bubble_row_per_launch(tmp_path):
    doc = {"runs": [launch_run("pingpong", c, (2.5, 8.0), (0.6, 0.9), 1.3817) for c in (1, 32, 256)]}
    doc["runs"] += [launch_run("resident", c, (18.4, 19.0), (7.5, 8.1)) for c in (1, 32, 256)]
    stage = next(s for s in builtin_stages() if s.name == "bubble-pingpong")
    (tmp_path / "results.json").write_text(json.dumps({"runs": doc["runs"][:3]}))
    figures = stage_figures(stage, tmp_path, "")
    one = figures["device c=1 rate=None"]
    assert one["launch"] == "pingpong" and (one["bubble_us_p50"], one["bubble_us_p99"]) == (2.5, 8.0)
    assert (one["device_sched_us_p50"], one["device_sched_us_p99"]) == (0.6, 0.9)

    e = all_met_document()  # goals-e's runs: no launch recorded
    e["runs"] = [r for r in e["runs"] if r["scheduler"] == "host"]  # host beside, in every bubble row
    rows = goals([doc, e], [ROOFLINE])
    resident, pingpong = rows[0], rows[1]
    assert "launch resident" in resident.goal and "launch pingpong" in pingpong.goal
    assert resident.verdict == "missed" and pingpong.verdict == "met"
    assert "c=1: device 2.5/8.0, critical 0.60/0.90, TPOT 1381.7; host 2.0/8.0 µs" in pingpong.measured
    assert "c=256: device 18.4/19.0, critical 7.50/8.10, TPOT 1390.0" in resident.measured
    assert rows[2].goal.startswith("1-row llama-1b")  # the other goals follow, as before
    # a window where only one launch ran: one row, named by its launch
    (only,) = [g for g in goals([{"runs": doc["runs"][:3]}], []) if g.goal.startswith("bubble")]
    assert "launch pingpong" in only.goal and only.verdict == "met"


# ---------------------------------------------------------------- the fused step beside the layered


def test_layered_runs_sit_beside_the_goals_not_in_them():
    # the layered document's bubbles, CPU and throughput would miss every device goal if judged
    rows = goals([all_met_document(), layered_document(tok_s=10.0)], [ROOFLINE])
    assert verdicts(rows)[:7] == ["met"] * 7
    assert "c=1: 1100 vs 1000" in rows[4].measured  # the layered 10 tok/s is not a device value
    kinds = rows[7]
    assert kinds.goal.startswith("fused step ≥ layered step throughput") and kinds.verdict == "met"
    assert (
        kinds.measured
        == "c=1: 1100 vs 10 (x110.00); c=32: 1100 vs 10 (x110.00); c=256: 1100 vs 10 (x110.00), beside"
    )
    # the server's own description names the kind too (no --server-arg needed)
    described = layered_document(tok_s=1000.0)
    del described["settings"]
    for r in described["runs"]:
        r["backend"] = {"step_kernels": "layered"}
    assert "c=1: 1100 vs 1000 (x1.10)" in goals([all_met_document(), described], [])[7].measured


def test_the_kinds_row_judges_where_the_fused_step_runs():
    faster_at_256 = layered_document(tok_s=1000.0)
    faster_at_256["runs"][2]["output_tokens_per_s"] = 1500.0  # c=256: over 32 rows, shown not judged
    row = goals([all_met_document(), faster_at_256], [])[7]
    assert row.verdict == "met" and "c=256: 1100 vs 1500 (x0.73), beside" in row.measured
    faster_at_32 = layered_document(tok_s=1000.0)
    faster_at_32["runs"][1]["output_tokens_per_s"] = 1200.0
    assert goals([all_met_document(), faster_at_32], [])[7].verdict == "missed"
    only_1 = layered_document()
    only_1["runs"] = only_1["runs"][:1]
    row = goals([all_met_document(), only_1], [])[7]
    assert row.verdict == "met where measured" and "c=32: not measured" in row.measured


def test_the_kinds_row_compares_runs_asked_for_the_same_launch():
    bubble = all_met_document()  # a bubble stage's fused runs: the launch forced, 2000 tok/s
    bubble["runs"] = [
        dict(r, output_tokens_per_s=2000.0) for r in bubble["runs"] if r["scheduler"] == "device"
    ]
    for r in bubble["runs"]:
        r["backend"] = {"launch": "resident", "launch_requested": "resident"}
    row = goals([all_met_document(), bubble, layered_document()], [])[-1]  # two bubble rows above
    assert "c=1: 1100 vs 900 (x1.22)" in row.measured  # goals-e/f's auto launch against the layered one's


TWO_KINDS = {
    "model": "llama-1b",
    "copy_bandwidth_GBps": 4000.0,
    "step_kernels": ["fused", "layered"],
    "by_kind": {
        "fused": [{"rows": 1, "step_us": 700.0, "floor_us": 620.0, "ratio": 1.13}],
        "layered": [{"rows": 1, "step_us": 1358.0, "floor_us": 620.0, "ratio": 2.19}],
    },
    "fused_over_layered": [{"rows": 1, "fused_us": 700.0, "layered_us": 1358.0, "ratio": 0.515}],
    "errors": [],
}
TWO_KINDS["steps"] = TWO_KINDS["by_kind"]["fused"]


def test_the_step_row_judges_the_fused_step_with_the_layered_beside():
    row = goals([], [TWO_KINDS])[1]
    assert row.goal.startswith("1-row llama-1b") and row.verdict == "met"
    assert (
        row.measured == "1 rows: fused 700 µs over 620 = 1.13x, layered 1358 µs = 2.19x, fused/layered 0.52"
    )
    # the fused step failed to build: the layered one (now the document's steps) is not judged
    failed = dict(TWO_KINDS, by_kind=dict(TWO_KINDS["by_kind"], fused=[]), fused_over_layered=[])
    failed["steps"] = failed["by_kind"]["layered"]
    failed["errors"] = [{"rows": 1, "step_kernels": "fused", "error": "CompilationError: x"}]
    row = goals([], [failed])[1]
    assert row.verdict == "not measured" and row.measured == "fused at 1 rows failed: CompilationError: x"
