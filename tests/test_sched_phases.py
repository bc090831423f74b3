"""The scheduler's two phases, through bench/lab/sched_micro.py's harness: the critical phase never
touches host-shared memory, the overlapped phase does the host traffic, and the benchmark's
scenarios are correct runs (every request ends with exactly one DONE)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringleader.bench.lab import sched_micro
from ringleader.bench.lab.sched_micro import SCENARIOS, Harness
from ringleader.device.sched.build import HOST_ACCESS_KINDS as KINDS
from ringleader.ipc import layout

REPO = Path(__file__).resolve().parents[1]
SIZES = (1, 4)
STEPS = 40


def _kind(sample, phase, kind):
    return int(sample[phase][KINDS.index(kind)])


@pytest.mark.parametrize("n_slots", SIZES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_critical_phase_makes_no_host_access_and_overlapped_does_the_traffic(scenario, n_slots):
    h = Harness(scenario, n_slots)
    samples = [h.step() for _ in range(STEPS)]
    h.check()
    assert sum(s["built"] for s in samples) > STEPS // 2 and sum(s["events"] for s in samples) > 0
    for i, s in enumerate(samples):
        assert not s["critical"].any(), f"step {i}: {dict(zip(KINDS, s['critical'].tolist()))}"
        # every overlapped pass reads shutdown, the abort-ring tail and the SQ tail
        assert _kind(s, "overlapped", "acquire_loads") >= 3 * s["passes"], i
        if s["events"]:  # one store per event, a fence, and cq_tail published
            assert _kind(s, "overlapped", "stores") >= s["events"], i
            assert _kind(s, "overlapped", "system_fences") >= 1, i
            assert _kind(s, "overlapped", "release_stores") >= 1, i


@pytest.mark.parametrize("n_slots", SIZES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_request_of_a_scenario_ends_with_exactly_one_done(scenario, n_slots):
    h = Harness(scenario, n_slots)
    for _ in range(STEPS):
        h.step()
    h.finish()  # aborts what is left; an event after a DONE is recorded as an error
    h.check()
    assert not h.live and h.finished == h.submitted > 0
    assert h.rings.arena.used() == 0  # every prompt's arena was released once
    assert int(h.a["ctl"][0]["finished"]) == h.finished  # mirrored when the scheduler went idle


def test_scenarios_have_the_shape_they_are_named_for():
    h = Harness("decode-only", 4)
    h.warm_up(5)
    assert (h.a["slots"]["state"] == layout.SlotState.DECODE).all()

    h = Harness("mixed-prefill", 4, record_layouts=True)
    for _ in range(STEPS):
        h.step()
    mixed = [x for x in h.layouts if x["n_decode"] == 2 and x["n_tokens"] > 2]
    assert len(mixed) > STEPS // 2  # two decode rows and prefill chunks in the same step
    assert all(x["n_tokens"] <= h.cfg.token_budget for x in h.layouts)
    assert h.finished > 0  # prefilled requests end and new arrivals take their slots

    h = Harness("admission-heavy", 4)
    for _ in range(STEPS):
        h.step()
        assert h.rings.submissions.free_entries() == 0  # the SQ is kept full
    assert h.finished > STEPS

    h = Harness("abort-storm", 4)
    for _ in range(STEPS):
        h.step()
    assert sum(r.aborted for r in h.live.values()) > 0 and h.finished > STEPS
    h.finish()
    assert int(h.a["ctl"][0]["aborts"]) > STEPS


def test_whole_step_mode_drives_the_serial_step():
    h = Harness("abort-storm", 4, whole_step=True)
    samples = [h.step() for _ in range(STEPS)]
    assert all(s["passes"] == 1 and s["overlapped_ns"] == 0 for s in samples)
    h.finish()
    h.check()
    assert h.finished == h.submitted


def test_null_host_check_builds_the_same_layouts_without_host_pointers():
    # a subprocess: a host access in the critical phase is a segfault, which must fail the test
    proc = subprocess.run(
        [
            sys.executable,
            "bench/lab/sched_micro.py",
            "--null-host-check",
            "--steps",
            "30",
            "--sizes",
            "1,4,32",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "ok" and len(lines) == 1 + len(SCENARIOS) * 3


def test_json_has_the_documented_shape(tmp_path, capsys):
    path = tmp_path / "micro.json"
    assert sched_micro.main(["--steps", "20", "--warmup", "5", "--sizes", "1,4", "--json", str(path)]) == 0
    assert "critical" in capsys.readouterr().out  # the table
    doc = json.loads(path.read_text())
    assert doc["mode"] == "split"
    for key in ("cpu_model", "cpu_count", "python", "git_rev"):
        assert key in doc["machine"], key
    assert [(s["name"], s["n_slots"]) for s in doc["scenarios"]] == [
        (name, n) for name in SCENARIOS for n in (1, 4)
    ]
    for s in doc["scenarios"]:
        for phase in ("critical", "overlapped"):
            st = s["phases"][phase]
            assert st["us_per_step"] > 0 and st["us_p99"] >= st["us_per_step"]
            assert set(st["host_accesses_by_kind"]) == set(KINDS)
            assert np.isclose(st["host_accesses_per_step"], sum(st["host_accesses_by_kind"].values()))
        assert s["phases"]["critical"]["host_accesses_per_step"] == 0
        assert s["phases"]["overlapped"]["host_accesses_per_step"] > 0
