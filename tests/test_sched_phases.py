"""The scheduler's two phases, through bench/lab/sched_micro.py's harness: the critical phase never
touches host-shared memory, the overlapped phase does the host traffic, and the benchmark's
scenarios are correct runs (every request ends with exactly one DONE)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringleader.bench.lab import sched_micro
from ringleader.bench.lab.sched_micro import SCENARIOS, Harness
from ringleader.bench.report import CPU_FLAGS
from ringleader.device.sched.build import HOST_ACCESS_KINDS as KINDS
from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from tests.sched_driver import Driver, scheduler, token_for

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
    assert set(doc["machine"]["cpu_flags"]) == set(CPU_FLAGS)
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


def test_steady_mode_measures_the_steady_path_against_the_full_build_on_the_same_states(tmp_path, capsys):
    path = tmp_path / "steady.json"
    argv = [
        "--steady",
        "--plan-ahead",
        "--steps",
        "30",
        "--warmup",
        "5",
        "--sizes",
        "1,4",
        "--json",
        str(path),
    ]
    assert sched_micro.main(argv) == 0  # quiet, then beside a busy-looping neighbour
    assert "full/steady" in capsys.readouterr().out  # the table
    doc = json.loads(path.read_text())
    assert doc["mode"] == "steady" and doc["variants"] == ["steady", "full", "steady+plan", "full+plan"]
    assert [c["neighbour"] for c in doc["conditions"]] == ["quiet", "busy"]
    assert doc["conditions"][0]["neighbour_cpu_share"] is None
    assert doc["conditions"][1]["neighbour_cpu_share"] > 0  # it spun while the twins stepped
    for c in doc["conditions"]:
        assert [s["n_slots"] for s in c["sizes"]] == [1, 4]
        for s in c["sizes"]:
            assert s["layouts_differ"] == {}  # the full build lays out what the steady path does
            assert set(s["ratios"]) == {"full/steady", "full+plan/steady+plan", "steady+plan/steady"}
            for name, v in s["variants"].items():
                assert v["eligible_share"] == 1.0, name  # every pass could take the steady path
                assert v["steady_share"] == (0.0 if name.startswith("full") else 1.0), name
                assert v["critical"]["host_accesses_per_step"] == 0, name
                assert v["overlapped"]["host_accesses_per_step"] > 0, name
                assert v["critical"]["us_p99"] >= v["critical"]["us_per_step"] > 0


# ---- the steady path and the void step (sched_critical.h): device memory only, too


@pytest.mark.parametrize("n_slots", (1, 4, 32))
def test_the_steady_path_makes_no_host_access(n_slots):
    h = Harness("decode-only", n_slots)
    h.warm_up(5)
    steady = 0
    for i in range(STEPS):
        rows = int(h.a["sched"][0]["steady_rows"])
        s = h.step()
        assert not s["critical"].any(), f"step {i}: {dict(zip(KINDS, s['critical'].tolist()))}"
        if rows:
            assert s["built"] and s["passes"] == 1 and rows == n_slots, i
            assert int(h.a["step"][0]["n_tokens"]) == rows
            steady += 1
    h.check()
    assert steady >= STEPS - 1  # decode-only never leaves the steady state once in it


def _phase_twin(plan_ahead: bool, null_host: bool) -> dict:
    """Two Drivers in lockstep over the phases (critical, a stand-in step, overlapped) with
    traffic that reaches the steady path and, with plan_ahead, void steps: long decodes side by
    side, then lone and paired requests that end by a stop id.  The second one's critical phase
    runs on a context without host-shared pointers when null_host (a host access there is a
    segfault: run it in a subprocess), else on the real one with its host accesses counted.
    Returns the steps where steady_rows was set and the void steps, with their critical
    phases' host accesses, and whether the two drivers laid out every step alike."""
    sched = scheduler()
    cfg = RingConfig(
        n_slots=4,
        max_ctx=64,
        token_budget=16,
        sq_size=16,
        cq_size=128,
        arena_size=1024,
        pending_cap=16,
        buckets=(1, 2, 4, 8, 16),
        plan_ahead=plan_ahead,
    )
    twins = [Driver(cfg), Driver(cfg)]
    table = sched_micro.null_host_context(twins[1].mem) if null_host else None
    critical_ctx = [
        twins[0].mem.context_address,
        ctypes.addressof(table) if table is not None else twins[1].mem.context_address,
    ]
    waves = [[(8, 12, None)] * 3, [(5, 20, 1)], [(3, 20, 2), (3, 20, 2)], [(6, 20, 0)], [(4, 9, None)] * 2]
    out = {"steady": [], "void": [], "same": True, "steps": 0}
    for wave in waves:
        for prompt_len, max_tokens, stop_at in wave:
            handles = [
                d.submit(
                    np.arange(1, 1 + prompt_len),
                    max_tokens,
                    stop_ids=() if stop_at is None else (token_for(d._next, stop_at),),
                )
                for d in twins
            ]
            assert handles[0] == handles[1] is not None
        for _ in range(200):
            laid_out, accesses = [], None
            steady_rows = int(twins[0].a["sched"][0]["steady_rows"])
            for k, d in enumerate(twins):
                d.rings.submissions.publish()
                sched.reset_host_accesses()
                built = sched.critical(critical_ctx[k]) == layout.StepStatus.RUN
                got = sched.host_accesses()
                if k == 0:
                    accesses = sum(got.values())
                snapshot = None
                if built:
                    a = d.a
                    hdr = a["step"][0]
                    n, bucket, ns = int(hdr["n_tokens"]), int(hdr["bucket"]), int(hdr["n_samples"])
                    snapshot = (
                        n,
                        bucket,
                        ns,
                        *(a[x][:bucket].tobytes() for x in ("token_ids", "positions", "slot_of")),
                    )
                    snapshot += tuple(
                        a[x][:ns].tobytes() for x in ("sample_slot", "sample_row", "sample_counter")
                    )
                    for q in range(ns):
                        s = int(a["sample_slot"][q])
                        a["next_token"][s] = token_for(
                            int(a["slots"][s]["handle"]), int(a["sample_counter"][q])
                        )
                laid_out.append(snapshot)
                sched.overlapped(d.mem.context_address, built)
                d.drain_cq()
            out["same"] &= laid_out[0] == laid_out[1]
            out["steps"] += laid_out[0] is not None
            if laid_out[0] is not None:
                if steady_rows:
                    out["steady"].append(accesses)
                if laid_out[0][0] == 0:
                    out["void"].append(accesses)
            if all(r.done for r in twins[0].records.values()) and laid_out[0] is None:
                break
    for d in twins:
        for handle, rec in d.records.items():
            assert len(rec.done) == 1 and rec.tokens == [token_for(handle, i) for i in range(len(rec.tokens))]
    return out


@pytest.mark.parametrize("plan_ahead", [False, True])
def test_the_steady_path_and_the_void_step_make_no_host_access(plan_ahead):
    got = _phase_twin(plan_ahead, null_host=False)
    assert got["same"] and len(got["steady"]) >= 10, got
    assert all(n == 0 for n in got["steady"]), got
    if plan_ahead:  # the lone stopper, the pair that stop together and the one stopping at once
        assert len(got["void"]) == 3 and all(n == 0 for n in got["void"]), got
    else:
        assert got["void"] == []


@pytest.mark.parametrize("plan_ahead", [False, True])
def test_null_host_check_covers_the_steady_path_and_the_void_step(plan_ahead):
    # a subprocess: a host access in the critical phase is a segfault, which must fail the test
    code = (
        "import json; from tests.test_sched_phases import _phase_twin; "
        f"got = _phase_twin({plan_ahead}, null_host=True); "
        "print(json.dumps({'same': got['same'], 'steady': len(got['steady']), 'void': len(got['void'])}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["same"] and got["steady"] >= 10 and got["void"] == (3 if plan_ahead else 0), got
