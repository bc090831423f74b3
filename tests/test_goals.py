"""The goals report (bench/lab/goals.py): one row per goal from the files a GPU window returns,
met / missed / not measured, read from folders, JSON files and the bring-up's archives."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile

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


ROOFLINE = {
    "model": "llama-1b",
    "copy_bandwidth_GBps": 4000.0,
    "steps": [{"rows": 1, "step_us": 700.0, "floor_us": 620.0, "ratio": 1.13}],
}


def verdicts(rows) -> list[str]:
    return [g.verdict for g in rows]


def test_every_goal_met_and_each_one_missed_by_its_own_number():
    rows = goals([all_met_document()], [ROOFLINE])
    assert verdicts(rows) == ["met"] * 7, [(g.goal, g.measured) for g in rows]
    assert "x20.00 lower" in rows[2].measured  # 2e-2 vs 1e-3 s over the same steps
    assert "host c=32 +16 busy: 70.0% kept" in rows[6].measured  # host's shown beside, not judged
    doc = all_met_document()
    doc["runs"][2]["bubble_us_p99"] = 10.5  # device at c=32
    doc["runs"][0]["thread_cpu_s"]["rl-cq-poll"] = 3e-3  # only x6.7 below the host at c=1
    doc["runs"][-2]["output_tokens_per_s"] = 1000  # 90.9% kept
    slow = dict(ROOFLINE, steps=[dict(ROOFLINE["steps"][0], ratio=1.9)])
    rows = goals([doc], [slow])
    assert verdicts(rows) == ["missed", "missed", "missed", "met", "met", "met", "missed"]


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
    assert [g["verdict"] for g in doc["goals"]] == ["met"] * 7
    assert (out / "summary.md").read_text().count("**met**") == 7
    # no gpu_limits document: every design row says so
    assert doc["designs"] and {d["verdict"] for d in doc["designs"]} == {"not measured"}
