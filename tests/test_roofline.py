"""bench/roofline.py: the byte accounting of the floor, and one measured run on the CPU."""

from __future__ import annotations

import json

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
