"""bench/lab/parity.py on the CPU: ringleader's CPU backend against transformers, on a preset and on a
checkpoint transformers wrote itself; and the check can fail."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from ringleader.bench.lab import parity


def test_cpu_backend_matches_transformers_on_tiny_and_a_transformers_checkpoint(tmp_path):
    out = tmp_path / "parity.json"
    assert (
        parity.main(
            [
                "--device",
                "cpu",
                "--model",
                "tiny",
                "--model",
                "hf-random",
                "--tokens",
                "16",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["ok"] and [m["model"] for m in doc["models"]] == [
        "tiny",
        "hf-random (transformers save_pretrained)",
    ]
    for record in doc["models"]:
        rows = {(c["a"], c["b"]): c for c in record["comparisons"]}
        assert rows[("cpu", "transformers")]["identical"], rows[("cpu", "transformers")]
        assert all(len(t) == 16 for t in record["variants"]["cpu"]["tokens"])
        assert "not run on this machine" in rows[("cuda-fp32", "cpu")]["skipped"]


def test_a_path_that_generates_other_tokens_is_a_mismatch(tmp_path, monkeypatch):
    real = parity.served_greedy

    def off_by_one(*args, **kwargs):
        return [[(t + 1) % 256 for t in tokens] for tokens in real(*args, **kwargs)]

    monkeypatch.setattr(parity, "served_greedy", off_by_one)
    out = tmp_path / "parity.json"
    assert parity.main(["--device", "cpu", "--model", "tiny", "--tokens", "8", "--json", str(out)]) == 1
    row = json.loads(out.read_text())["models"][0]["comparisons"][0]
    assert (row["a"], row["b"]) == ("cpu", "transformers") and len(row["mismatched"]) == len(
        parity.PROMPT_LENGTHS
    )
