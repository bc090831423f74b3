"""Every GPU-limits probe end to end against FakeDriver (tests/fake_cuda_driver.py), a simulation
of the CUDA driver set as ``ringleader.device.backends.cuda_driver.cu``: each driver call is first
made on the real cuda-python binding, so a wrong argument type for the installed bindings fails,
and the simulated kernels follow the protocols of bench/gpu_limits/kernels.cu, so the host
side's checks and statistics run on realistic data. torch has no CUDA here, so probes 4 and 6
and the torch half of probe 5 are not exercised.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
    }
    assert not res["meta"]["tainted"]
    assert res["kernels"]["ok"] and len(res["kernels"]["kernels"]) == N_KERNELS

    def ok(key):
        assert probes[key]["status"] == "ok", json.dumps(probes[key], indent=1)[:6000]

    for key in ("1_doorbell", "2_handoff", "3_launch", "7_memops"):
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
    for key in ("4_torchgraph", "6_roofline"):  # torch has no CUDA here
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
