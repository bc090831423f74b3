"""Every GPU-limits probe end to end against FakeDriver (tests/fake_cuda_driver.py), a simulation
of the CUDA driver set as ``ringleader.device.backends.cuda_driver.cu``: each driver call is first
made on the real cuda-python binding, so a wrong argument type for the installed bindings fails,
and the simulated kernels follow the protocols of bench/lab/gpu_limits/kernels.cu, so the host
side's checks and statistics run on realistic data. torch has no CUDA here, so probes 4 and 6
and the torch half of probe 5 are not exercised.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ringleader.bench.lab.launch_designs import design_rows
from tests.gpu_limits_probe import N_KERNELS, ROOT, libcuda_present

FAKE_RUN = [sys.executable, str(ROOT / "tests" / "fake_cuda_driver.py"), "--fake-run"]


@pytest.mark.skipif(libcuda_present(), reason="a CUDA driver is installed: the real-GPU test covers this")
def test_every_probe_against_fake_driver(tmp_path):
    pytest.importorskip("cuda.bindings")
    r = subprocess.run(
        [*FAKE_RUN, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "fake driver:" not in out, out[-6000:]
    files = list(tmp_path.glob("*-h100-gpu-limits-quick.json"))
    assert len(files) == 1, (list(tmp_path.iterdir()), out[-3000:])
    res = json.loads(files[0].read_text())
    assert (tmp_path / files[0].name.replace(".json", ".log")).exists()
    probes = res["probes"]
    assert set(probes) == {
        "1_doorbell",
        "2_handoff",
        "3_launch",
        "4_torchgraph",
        "5_blocking",
        "6_roofline",
        "7_memops",
        "8_devlaunch",
        "9_graphpair",
        "10_stepwhile",
    }
    assert not res["meta"]["tainted"]
    assert res["kernels"]["ok"] and len(res["kernels"]["kernels"]) == N_KERNELS

    def ok(key):
        assert probes[key]["status"] == "ok", json.dumps(probes[key], indent=1)[:6000]

    for key in ("1_doorbell", "2_handoff", "3_launch", "7_memops", "8_devlaunch", "9_graphpair"):
        ok(key)
    db = probes["1_doorbell"]["variants"]
    assert set(db) == {"spin", "nanosleep_0", "nanosleep_100", "nanosleep_1000"}
    for v in db.values():
        assert v["check"]["ok"] and v["round_trip"]["n"] == 1000 and v["round_trip"]["median_us"] > 0
    pp = probes["2_handoff"]["pingpong"]
    assert pp["check"]["ok"] and pp["one_way_both"]["n"] > 0
    ln = probes["3_launch"]
    assert ln["while_graph"]["check"]["ok"] and ln["switch_graph"]["branch_check"]["ok"]
    assert ln["while_graph"]["per_iteration_from_stamps"]["n"] > 1000
    mo = probes["7_memops"]
    assert mo["handoff_memops"]["check"]["ok"] and mo["handoff_events"]["check"]["ok"]
    cap = mo["capture"]
    assert cap["node_types"].count("CU_GRAPH_NODE_TYPE_BATCH_MEM_OP") == 2
    assert cap["captured_graph_runs"]["ok"] and cap["mem_op_graph_in_while_body"]["ok"]
    dl = probes["8_devlaunch"]
    for mode in ("fire_and_forget", "tail", "sibling"):
        r = dl[f"launch_{mode}"]
        assert r["check"]["ok"] and r["launches"] == r["targets_ran"] == 200, r
        assert r["launch_to_first_kernel"]["n"] > 100 and r["launch_to_first_kernel"]["min_us"] >= 0, r
    assert dl["tail_self_loop"]["count"] == 1000 and dl["tail_self_loop"]["first_relaunch_error"] is None
    assert dl["tail_self_loop"]["per_iteration_from_stamps"]["n"] > 900
    in_graph, plain = dl["persistent_in_graph"], dl["persistent_plain"]
    assert in_graph["exit"] == "done" and in_graph["ran_while_launcher_waited"] == 200, in_graph
    # the simulated driver refuses a launch from a kernel outside any graph: read back as a finding
    assert plain["status"] == "ok" and plain["exit"] == "launch_error", plain
    assert plain["first_error"] == {"index": 0, "code": 1} and plain["ran_by_the_end"] == 0, plain
    gp = probes["9_graphpair"]
    for key in ("one_work_0us", "pair_work_0us", "one_work_20us", "pair_work_20us"):
        r = gp[key]
        assert r["check"]["ok"] and r["steps"] == 1000 * r["graphs"], (key, r)
        assert r["idle_between_steps"]["n"] > 500 and r["idle_between_steps"]["min_us"] >= 0, (key, r)
    assert gp["pair_work_20us"]["flag_handover"]["n"] > 1000
    assert gp["pair_work_20us"]["cadence_per_step_us"] >= 20  # each stand-in step holds 20 us
    # the goals report's design rows read this document as run F's stage returns it
    designs = {d.design: d for d in design_rows([res], 3.0)}
    assert len(designs) == 11
    plain = next(d for name, d in designs.items() if "plain launch" in name)
    assert plain.verdict == "refused" and "returned error 1" in plain.measured, plain
    in_graph = next(d for name, d in designs.items() if "a graph's node" in name)
    assert in_graph.measured.startswith("200/200 launches ran"), in_graph
    step = next(d for name, d in designs.items() if "real 1-row step" in name)
    assert step.verdict == "not measured" and "torch" in step.measured, step
    timed = [d for d in designs.values() if d not in (plain, in_graph, step)]
    assert all(d.verdict in ("under the goal", "over the goal") and "p50" in d.measured for d in timed), timed
    for key in ("4_torchgraph", "6_roofline", "10_stepwhile"):  # torch has no CUDA here
        assert probes[key]["status"] == "skipped", probes[key]
    bl = probes["5_blocking"]
    for name in (
        "cuMemHostAlloc",
        "cuMemAlloc_cuMemFree",
        "cuModuleLoadData",
        "kernel_on_other_nonblocking_stream",
        "cuMemFreeHost",
    ):
        assert bl["ops"][name]["status"] == "completed", bl["ops"][name]
        assert bl["ops"][name]["kernel_still_running"] is True, bl["ops"][name]
    # the exit test's child uses the real driver, which is absent here
    assert bl["exit"]["plain"]["status"] == "error"
    assert "measurement" in (tmp_path / files[0].name.replace(".json", ".log")).read_text()
