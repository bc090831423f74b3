"""device/weights/cpu_weight_choice.py: `--weights auto` on the CPU times a GGUF file's first
gate|up matrix, as the model loaded it, in each form on this machine and serves the faster; a
file without matrices the quantized kernel takes is served dense."""

from __future__ import annotations

import pytest

from ringleader.device.backends.cpu import CpuBackend
from ringleader.device.weights.cpu_weight_choice import TRIAL_ROWS, choose_cpu_weights, trial_kernel

SMALL = dict(n_slots=2, max_ctx=256, kv_cache_memory=16 << 20)


def test_the_real_models_forms_are_timed_and_the_faster_is_served(smollm2_gguf):
    backend = CpuBackend(str(smollm2_gguf), **SMALL)
    try:
        choice = backend.weight_choice
        assert choice is not None and choice.matrix == "layers.0.gate_up"
        assert set(choice.us) == {"quantized", "fp32"}
        for by_rows in choice.us.values():
            assert set(by_rows) == set(TRIAL_ROWS) and all(us > 0 for us in by_rows.values())
        cost = {f: t[TRIAL_ROWS[0]] * t[TRIAL_ROWS[-1]] for f, t in choice.us.items()}
        assert choice.form == min(cost, key=cost.__getitem__)
        assert choice.form in choice.describe() and "us at 16" in choice.describe()
        auto = backend.description["weights_auto"]
        assert backend.config.weights == auto["form"] == backend.description["weights"]
    finally:
        backend.stop()
    given = CpuBackend(str(smollm2_gguf), weights="fp32", **SMALL)
    try:  # a form named on the command line is served as named, untimed
        assert given.config.weights == "fp32" and given.weight_choice is None
        assert "weights_auto" not in given.description
    finally:
        given.stop()


def test_a_file_without_quantized_matrices_is_served_dense(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from ringleader.device.model import LlamaModel
    from tests.test_gguf_checkpoint import hf_model as hf_model_fixture
    from tests.test_gguf_checkpoint import write_gguf

    path = write_gguf(tmp_path / "f32.gguf", hf_model_fixture.__wrapped__(), qtype="F32")
    dense = LlamaModel.from_spec(str(path), weights="quantized")  # nothing to keep: all dense
    assert trial_kernel(dense) is None
    choice = choose_cpu_weights(dense)
    assert choice.form == "fp32" and choice.us == {} and choice.describe() == "fp32"
    path = write_gguf(tmp_path / "q.gguf", hf_model_fixture.__wrapped__(), qtype="Q4_1")
    timed = choose_cpu_weights(LlamaModel.from_spec(str(path), weights="quantized"))
    assert timed.matrix == "layers.0.gate_up" and set(timed.us) == {"quantized", "fp32"}
