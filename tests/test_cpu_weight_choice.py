"""device/weights/cpu_weight_choice.py: `--weights auto` on the CPU times a GGUF file's first
feed-forward matrix in each form on this machine and serves the faster; a file the quantized
kernel cannot take is served dense."""

from __future__ import annotations

import pytest

from ringleader.device.backends.cpu import CpuBackend
from ringleader.device.weights.cpu_weight_choice import TRIAL_ROWS, choose_cpu_weights, trial_matrix


def test_the_real_models_forms_are_timed_and_the_faster_is_served(smollm2_gguf):
    choice = choose_cpu_weights(str(smollm2_gguf))
    assert choice.matrix == "blk.0.ffn_up.weight"
    assert set(choice.us) == {"quantized", "fp32"}
    for by_rows in choice.us.values():
        assert set(by_rows) == set(TRIAL_ROWS) and all(us > 0 for us in by_rows.values())
    cost = {f: t[TRIAL_ROWS[0]] * t[TRIAL_ROWS[-1]] for f, t in choice.us.items()}
    assert choice.form == min(cost, key=cost.__getitem__)
    assert choice.form in choice.describe() and "us at 16" in choice.describe()

    backend = CpuBackend(str(smollm2_gguf), n_slots=2, max_ctx=256, kv_cache_memory=16 << 20)
    try:
        auto = backend.description["weights_auto"]
        assert backend.config.weights == auto["form"] and set(auto["us"]) == {"quantized", "fp32"}
    finally:
        backend.stop()
    given = CpuBackend(str(smollm2_gguf), weights="fp32", n_slots=2, max_ctx=256, kv_cache_memory=16 << 20)
    try:  # a form named on the command line is served as named, untimed
        assert given.config.weights == "fp32" and "weights_auto" not in given.description
    finally:
        given.stop()


def test_a_file_without_quantized_matrices_is_served_dense(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from tests.test_gguf_checkpoint import hf_model as hf_model_fixture
    from tests.test_gguf_checkpoint import write_gguf

    path = write_gguf(tmp_path / "f32.gguf", hf_model_fixture.__wrapped__(), qtype="F32")
    assert trial_matrix(str(path)) is None
    choice = choose_cpu_weights(str(path))
    assert choice.form == "fp32" and choice.us == {} and choice.describe() == "fp32"
    quantized = write_gguf(tmp_path / "q.gguf", hf_model_fixture.__wrapped__(), qtype="Q4_1")
    timed = choose_cpu_weights(str(quantized))  # a layer of 64 columns: the kernel takes it too
    assert timed.matrix == "blk.0.ffn_up.weight" and set(timed.us) == {"quantized", "fp32"}
