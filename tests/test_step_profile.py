"""bench/step_profile.py: the gap, split and grouping arithmetic on plain event tuples, the byte
attribution, the graph node counts without a graph, and roofline --profile run on the CPU."""

from __future__ import annotations

import json

import pytest

from ringleader.bench import roofline
from ringleader.bench import step_profile as sp


def test_gaps_are_idle_time_after_the_latest_end():
    # b starts 2 after a ends; c overlaps b (no gap); d starts 5 after c ends; given out of order
    events = [("d", 25.0, 26.0), ("a", 0.0, 10.0), ("c", 14.0, 20.0), ("b", 12.0, 15.0)]
    assert sp.step_gaps(events) == [2.0, 0.0, 5.0]
    # a long kernel covers the short ones inside it: idle only after it ends
    covered = [("long", 0.0, 100.0), ("x", 10.0, 20.0), ("y", 30.0, 40.0), ("z", 105.0, 106.0)]
    assert sp.step_gaps(covered) == [0.0, 0.0, 5.0]
    assert sp.step_gaps([("only", 1.0, 2.0)]) == [] and sp.step_gaps([]) == []


def test_gap_summary_per_step_and_over_all_gaps():
    steps = [
        [("a", 0.0, 10.0), ("b", 11.0, 20.0), ("c", 24.0, 30.0)],  # gaps 1, 4
        [("a", 100.0, 110.0), ("b", 112.0, 120.0), ("c", 122.0, 130.0)],  # gaps 2, 2
    ]
    g = sp.gap_summary(steps)
    assert g["gap_us_per_step"] == pytest.approx((5 + 4) / 2)
    assert g["gap_p50_us"] == pytest.approx(2.0) and g["gap_max_us"] == pytest.approx(4.0)
    assert g["busy_us_per_step"] == pytest.approx((25 + 26) / 2)
    assert g["span_us_per_step"] == pytest.approx(30.0)
    assert g["gaps_per_step"] == 2
    # span = busy + gaps when nothing overlaps
    assert g["span_us_per_step"] == pytest.approx(g["busy_us_per_step"] + g["gap_us_per_step"])


def test_split_steps_in_time_order_and_refuses_uneven():
    one = [("k1", 0.0, 1.0), ("k2", 2.0, 3.0), ("k3", 4.0, 5.0)]
    two = [(n, s + 100, e + 100) for n, s, e in one]
    steps = sp.split_steps(two + one[::-1], 2)
    assert steps == [one, two]
    with pytest.raises(ValueError):
        sp.split_steps(one + two[:2], 2)


def test_kernel_table_shares_counts_and_bandwidth():
    step = [
        ("gemm", 0.0, 10.0, "kernel"),
        ("norm", 10.0, 12.0, "kernel"),
        ("gemm", 12.0, 22.0, "kernel"),
        ("Memset (Device)", 22.0, 23.0, "memset"),
    ]
    steps = [step, [(n, s + 50, e + 50, k) for n, s, e, k in step]]
    rows = sp.kernel_table(steps, {"gemm": 2e6})
    assert [r["name"] for r in rows] == ["gemm", "norm", "Memset (Device)"]  # most time first
    assert sum(r["share"] for r in rows) == pytest.approx(1.0, abs=1e-5)
    gemm = rows[0]
    assert gemm["count_per_step"] == 2 and isinstance(gemm["count_per_step"], int)
    assert gemm["us_per_step"] == pytest.approx(20.0) and gemm["share"] == pytest.approx(20 / 23, abs=1e-5)
    assert gemm["GBps"] == pytest.approx(100.0)  # 2 MB in 20 us
    assert rows[1]["GBps"] is None and rows[1]["bytes_per_step"] is None
    assert sp.kind_counts(steps) == {"kernel": 3, "memset": 1}


def test_count_per_step_not_an_integer_when_steps_differ():
    rows = sp.kernel_table([[("a", 0.0, 1.0)], [("a", 2.0, 3.0), ("a", 4.0, 5.0)]])
    assert rows[0]["count_per_step"] == pytest.approx(1.5)


def test_op_bytes_from_shapes_and_dtypes():
    assert sp.op_bytes([[2, 3], [3, 4], []], ["c10::BFloat16", "c10::BFloat16", ""]) == (6 + 12) * 2
    assert sp.op_bytes([[2, 3], [3, 4]], ["float", "c10::Half"]) == 6 * 4 + 12 * 2
    assert sp.op_bytes([[2, 3]], []) is None  # dtypes not recorded: unknown, not zero
    assert sp.op_bytes([[2, 3]], ["c10::ComplexFloat"]) is None


def test_kernel_bytes_go_to_the_longest_kernel_of_a_matmul():
    launches = [
        (1000, [("gemm_splitk", 5.0), ("reduce", 1.0)]),
        (1000, [("gemm_splitk", 5.0), ("reduce", 1.0)]),
        (400, [("gemm", 2.0)]),
        (None, [("elementwise", 1.0)]),
    ]
    got = sp.kernel_bytes(launches, n_steps=2)
    assert got["gemm_splitk"] == (1.0, 1000.0)
    assert got["reduce"] == (1.0, None)
    assert got["gemm"] == (0.5, 200.0) and got["elementwise"] == (0.5, None)
    # a name also launched by an op without bytes has none
    assert sp.kernel_bytes([(400, [("k", 1.0)]), (None, [("k", 1.0)])], 1)["k"] == (2.0, None)


def test_bytes_only_where_the_eager_run_launches_the_name_as_often():
    eager = {"gemm": (2.0, 500.0), "copy": (1.0, None)}
    got = sp.matched_bytes({"gemm": 2.0, "copy": 1.0, "graph_only": 1.0}, eager)
    assert got == {"gemm": 500.0, "copy": None, "graph_only": None}
    assert sp.matched_bytes({"gemm": 3.0}, eager) == {"gemm": None}


def test_count_differences_names_what_only_one_profile_launches():
    diff = sp.count_differences({"a": 4, "memcpy_kernel": 2}, 2, {"a": 2}, 1)
    assert diff == [{"name": "memcpy_kernel", "per_step": 1, "other_per_step": 0}]


def test_node_kind_counts():
    names = ["CU_GRAPH_NODE_TYPE_KERNEL"] * 5 + ["CU_GRAPH_NODE_TYPE_MEMSET"] * 2
    names += ["CU_GRAPH_NODE_TYPE_MEMCPY", "CU_GRAPH_NODE_TYPE_EMPTY", "CU_GRAPH_NODE_TYPE_EVENT_RECORD"]
    got = sp.node_kind_counts(names)
    assert {k: got[k] for k in ("kernel", "memset", "memcpy", "other", "total")} == {
        "kernel": 5,
        "memset": 2,
        "memcpy": 1,
        "other": 2,
        "total": 10,
    }
    assert got["by_type"]["CU_GRAPH_NODE_TYPE_EMPTY"] == 1


def test_graph_node_counts_without_a_readable_graph_is_none():
    class NoRaw:
        pass

    class RawFails:
        def raw_cuda_graph(self):
            raise RuntimeError("keep_graph must be True")

    class RawZero:
        def raw_cuda_graph(self):
            return 0

    assert sp.graph_node_counts(None) is None
    assert sp.graph_node_counts(NoRaw()) is None
    assert sp.graph_node_counts(RawFails()) is None
    assert sp.graph_node_counts(RawZero()) is None


def _fake_profile(n_names: int) -> dict:
    steps = [[(f"kernel_{i}", 10.0 * i, 10.0 * i + 1 + i, "kernel") for i in range(n_names)]]
    return {
        "profiled": "graph",
        "note": None,
        "steps": 1,
        "unit": "kernel",
        "launches_per_step": n_names,
        "events_per_step": sp.kind_counts(steps),
        **sp.gap_summary(steps),
        "kernels": sp.kernel_table(steps),
        "graph_nodes": sp.node_kind_counts(["CU_GRAPH_NODE_TYPE_KERNEL"] * n_names),
        "eager_launches_per_step": n_names,
        "unlike_eager": [],
    }


def test_format_profile_top_rows_rest_and_total():
    text = sp.format_profile(1, _fake_profile(30), top=25)
    lines = text.splitlines()
    assert "profiled graph" in lines[0] and "graph nodes 30 (kernel 30" in lines[0]
    assert "(5 more names)" in text and lines[-1].rstrip().endswith("total")
    assert sum(1 for line in lines if "kernel_" in line) == 25
    assert next(line for line in lines if "kernel_" in line).endswith("kernel_29")  # the longest first
    # the step kind profiled, where the profile names one
    named = sp.format_profile(32, dict(_fake_profile(3), step_kernels="layered")).splitlines()[0]
    assert named.startswith("rows 32 (layered): profiled graph over 1 steps")


def test_roofline_profile_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--rows", "1,2", "--ctx", "32"]
    argv += ["--repeats", "2", "--copy-mib", "16", "--profile", "--profile-steps", "3", "--json", str(out)]
    assert roofline.main(argv) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert [s["rows"] for s in r["steps"]] == [1, 2]
    for s in r["steps"]:
        p = s["profile"]
        # on the CPU the step kinds are one eager step: one profile, named for both
        assert f"rows {s['rows']} (fused,layered): profiled eager-cpu over 3 steps" in text
        assert p["step_kernels"] == "fused,layered" and r["by_kind"]["layered"][s["rows"] - 1]["profile"] == p
        assert p["profiled"] == "eager-cpu" and p["steps"] == 3 and p["unit"] == "op"
        assert p["graph_nodes"] is None
        for key in ("launches_per_step", "gap_us_per_step", "gap_p50_us", "busy_us_per_step", "kernels"):
            assert key in p
        rows = p["kernels"]
        assert sum(k["share"] for k in rows) == pytest.approx(1.0, abs=1e-4)
        assert all(isinstance(k["count_per_step"], int) and k["count_per_step"] > 0 for k in rows)
        assert sum(k["count_per_step"] for k in rows) == p["launches_per_step"] > 0
        # the matmuls' operands are the weights the step reads (plus a few activation rows)
        matmul_bytes = sum(k["bytes_per_step"] for k in rows if k["bytes_per_step"] is not None)
        assert abs(matmul_bytes - r["weight_bytes"]) <= 0.05 * r["weight_bytes"]
        assert all(k["GBps"] is not None for k in rows if k["bytes_per_step"])


def test_roofline_without_profile_has_no_profile(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--rows", "1", "--ctx", "16"]
    assert roofline.main(argv + ["--repeats", "1", "--copy-mib", "8", "--json", str(out)]) == 0
    assert "profile" not in json.loads(out.read_text())["steps"][0]
