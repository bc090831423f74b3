"""The structured-output bench (bench/structured_bench.py) in its --quick mode on the real model:
it runs to the end and writes a JSON document and a Markdown table whose figures are sane."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("outlines_core")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")


@pytest.mark.timeout(120)
def test_quick_run_writes_sane_figures(smollm2_gguf, tmp_path):
    cmd = [sys.executable, "-m", "ringleader.bench.structured_bench", "--quick"]
    out = subprocess.run(
        [*cmd, "--out", str(tmp_path), "--model", str(smollm2_gguf)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "structured.json").read_text())
    assert "Enforcement cost" in (tmp_path / "structured.md").read_text()

    machine = doc["machine"]
    assert machine["cpu_model"] and set(machine["cpu_flags"]) >= {"avx2", "avx512_vnni", "avx512_bf16"}
    assert machine["torch_threads"] >= 1 and "commit" in machine["git"]

    rows = doc["enforcement"]
    assert {(r["condition"].split()[0], r["streams"], r["arm"]) for r in rows} == {
        (c, s, a) for c in ("quiet", "busy") for s in (1, 4) for a in ("none", "json", "regex")
    }
    for r in rows:
        assert r["failed"] == 0 and r["output_tokens"] > 0, r
        assert r["tok_per_s"] > 0 and r["tok_per_s_ratio"] > 0 and r["tok_per_s_ratio_paired"] > 0, r
        assert r["tpot_ms"]["p50"] > 0 and r["tpot_p50_ratio"] > 0, r
    assert all(r["tok_per_s_ratio"] == 1.0 for r in rows if r["arm"] == "none")
    assert doc["neighbour"]["busy_cpu_s"] > 0

    assert doc["compile"]
    for r in doc["compile"]:
        assert r["nbytes"] > 0 and r["n_states"] > 0 and r["n_masks"] > 0, r
        assert r["cold_ms_median"] * 1e3 >= r["cached_us"] > 0, r

    assert doc["first_request"]
    for r in doc["first_request"]:
        for label in ("cold", "cached", "none"):
            assert r[f"ttft_{label}_ms"] > 0 and r[f"bystander_gap_{label}_ms"] > 0, r
    assert doc["server_structured_stats"]["available"] is True
