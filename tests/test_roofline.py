"""bench/roofline.py: the byte accounting of the floor, and one measured run on the CPU."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch

from ringleader.bench import roofline
from ringleader.bench.cli import main as bench_main
from ringleader.device.model import LlamaModel


def test_weight_and_kv_bytes_follow_the_model():
    model = LlamaModel.from_preset("tiny", torch.float32)
    c = model.config
    per_layer = sum(p.numel() for p in model.layers[0].parameters())
    want = 4 * (c.num_layers * per_layer + c.hidden_size + c.vocab_size * c.hidden_size)
    assert roofline.weight_bytes_per_step(model) == want  # tied: the embedding is read as lm_head
    kv = roofline.kv_bytes_per_step(model, rows=3, ctx=10, dtype=torch.bfloat16)
    assert kv == 2 * c.num_layers * 3 * 10 * c.num_kv_heads * c.head_dim * 2


def test_decode_layout_samples_every_row():
    lay = roofline.decode_layout(rows=4, ctx=9, vocab=100, pages_per_slot=2, device=torch.device("cpu"))
    assert lay.slot_of.tolist() == [0, 1, 2, 3] and lay.positions.tolist() == [8] * 4
    assert lay.block_table.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert int(lay.n_samples[0]) == 4 and all(0 <= t < 100 for t in lay.token_ids.tolist())


def test_a_decode_step_writes_the_same_token_each_run_into_its_layout():
    # gpu_limits probe 10 compares the token a WHILE graph's runs sample with the host replays'
    model = LlamaModel.from_preset("tiny", torch.float32)
    step = roofline.decode_step(model, rows=1, ctx=12, attention="torch")
    assert step.graph is None and step.layout is not None  # the CPU: no graph, the eager step
    step.layout.next_token.fill_(-1)
    step.run()
    first = int(step.layout.next_token[0])
    step.layout.next_token.fill_(-1)
    step.run()
    assert 0 <= first < model.config.vocab_size and int(step.layout.next_token[0]) == first


def test_measured_on_the_cpu(tmp_path):
    out = tmp_path / "r.json"
    code = bench_main(
        [
            "--roofline",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--slots",
            "4",
            "--max-ctx",
            "32",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    r = json.loads(out.read_text())
    assert [s["rows"] for s in r["steps"]] == [1, 4]
    bw = r["copy_bandwidth_GBps"] * 1e9
    for s in r["steps"]:
        floor_us = (r["weight_bytes"] + s["kv_bytes"]) / bw * 1e6
        assert abs(s["floor_us"] - floor_us) <= 0.05 * floor_us + 0.1
        assert s["step_us"] > 0 and abs(s["ratio"] - s["step_us"] / s["floor_us"]) <= 0.01 * s["ratio"] + 0.01


# ---- the step kinds side by side ----------------------------------------------------------------
ARGV = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--rows", "1,2", "--ctx", "16"]
ARGV += ["--repeats", "3", "--copy-mib", "8"]


def test_side_by_side_timing_interleaves_and_reverses_the_order():
    calls: list[str] = []
    times = roofline.timed_side_by_side(
        [lambda: calls.append("a"), lambda: calls.append("b")], torch.device("cpu"), repeats=3
    )
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]  # warm-up, then round by round
    assert [len(t) for t in times] == [3, 3] and all(s >= 0 for t in times for s in t)


def test_on_the_cpu_every_kind_is_the_one_eager_step(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert roofline.main(ARGV + ["--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["step_kernels"] == ["fused", "layered"] and "on the CPU" in r["step_kernels_note"]
    assert r["fused_over_layered"] is None and r["errors"] == []  # one step: nothing compared
    fused, layered = r["by_kind"]["fused"], r["by_kind"]["layered"]
    assert r["steps"] == fused and [s["rows"] for s in fused] == [1, 2]
    assert [s["step_kernels"] for s in layered] == ["layered"] * 2
    assert [s["step_us"] for s in fused] == [s["step_us"] for s in layered]
    text = capsys.readouterr().out
    assert "note: on the CPU" in text and "    1    fused" in text and "    2  layered" in text
    # one kind, the first's figures as today's steps
    assert roofline.main(ARGV + ["--step-kernels", "layered", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["by_kind"]) == ["layered"] and r["steps"][0]["step_kernels"] == "layered"


def test_unknown_kinds_are_refused():
    assert roofline.parse_kinds(" layered, fused,layered") == ("layered", "fused")
    with pytest.raises(ValueError):
        roofline.parse_kinds("fused,cublas")
    with pytest.raises(SystemExit):
        roofline.main(ARGV + ["--step-kernels", ","])


class KindStep(roofline.StaticStep):
    """A StaticStep that takes step_kernels (as the CUDA one does) and records what it was given;
    the kind named `broken` fails to build."""

    made: ClassVar[list[tuple[str, int]]] = []
    broken: ClassVar[str | None] = None

    def __init__(self, model, kv, *args, step_kernels: str = "fused", **kwargs) -> None:
        if step_kernels == KindStep.broken:
            raise RuntimeError(f"no {step_kernels} kernels here")
        KindStep.made.append((step_kernels, id(kv)))
        super().__init__(model, kv, *args, **kwargs)


@pytest.fixture
def kinds_apart(monkeypatch):
    """The CUDA path's shape on the CPU: a StaticStep of its own per kind."""
    monkeypatch.setattr(roofline, "StaticStep", KindStep)
    monkeypatch.setattr(roofline, "steps_apart", lambda device: True)
    KindStep.made, KindStep.broken = [], None
    return KindStep


def test_each_kind_its_own_step_over_one_kv_cache(tmp_path, kinds_apart, capsys):
    assert roofline.takes_step_kernels() is True  # KindStep's keyword
    out = tmp_path / "r.json"
    assert roofline.main(ARGV + ["--profile", "--profile-steps", "2", "--json", str(out)]) == 0
    made = kinds_apart.made
    assert [k for k, _ in made] == ["fused", "layered", "fused", "layered"]  # per rows, in order
    assert made[0][1] == made[1][1] != made[2][1] == made[3][1]  # one cache per rows value
    r = json.loads(out.read_text())
    assert r["step_kernels_note"] is None and r["steps"] == r["by_kind"]["fused"]
    ratios = r["fused_over_layered"]
    assert [x["rows"] for x in ratios] == [1, 2]
    for x, f, lay in zip(ratios, r["by_kind"]["fused"], r["by_kind"]["layered"], strict=True):
        assert (x["fused_us"], x["layered_us"]) == (f["step_us"], lay["step_us"])
        assert x["ratio"] == pytest.approx(f["step_us"] / lay["step_us"], abs=1e-3)
        assert f["profile"]["step_kernels"] == "fused" and lay["profile"]["step_kernels"] == "layered"
    text = capsys.readouterr().out
    assert "rows 1: fused/layered" in text
    assert "rows 1 (fused): profiled eager-cpu" in text and "rows 2 (layered): profiled eager-cpu" in text


def test_a_kind_that_fails_to_build_leaves_the_others_measured(tmp_path, kinds_apart):
    kinds_apart.broken = "fused"
    out = tmp_path / "r.json"
    assert roofline.main(ARGV + ["--json", str(out)]) == 1  # the stage fails, its figures kept
    r = json.loads(out.read_text())
    assert [(e["rows"], e["step_kernels"]) for e in r["errors"]] == [(1, "fused"), (2, "fused")]
    assert "no fused kernels here" in r["errors"][0]["error"]
    assert r["by_kind"]["fused"] == [] and r["steps"] == r["by_kind"]["layered"]
    assert r["fused_over_layered"] == [] and [s["rows"] for s in r["steps"]] == [1, 2]


def test_the_kinds_are_the_engine_options():
    from ringleader.device import engine_config

    assert engine_config.STEP_KERNELS == roofline.STEP_KERNELS
    assert engine_config.EngineConfig().step_kernels == roofline.STEP_KERNELS[0]  # the default first
