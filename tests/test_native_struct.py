"""Argument structs declared once (ipc/native_struct.py), checked on the null model's C step
(device/null/null_step.py's NULL_STEP_ARGS): the host compiler lays out the generated C struct
exactly as the numpy record the Python side fills, field for field; a struct text that disagrees
with its declaration does not compile; and NullStep binds every declared field by name."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest

from ringleader.device.null.null_logits import record_logprobs
from ringleader.device.null.null_model import NullModel
from ringleader.device.null.null_options import NullOptions
from ringleader.device.null.null_step import NULL_STEP_ARGS, NullStep
from ringleader.device.step.step_layout import StepLayout
from ringleader.ipc.layout import Field, Struct
from ringleader.ipc.native import find_compiler, load_library
from ringleader.ipc.native_struct import POINTER_SIZE, Pointer, host_c_text, struct_record


def _compiled_layout(struct: Struct) -> tuple[int, dict[str, tuple[int, int]]]:
    """sizeof(struct) and each field's (offsetof, sizeof) as the host compiler lays out the
    generated text, read back from a probe built with it."""
    names = [f.name for f in struct.fields]
    probe = "\n".join(
        [
            'extern "C" void rl_probe(uint64_t* out) {  // sizeof, then (offsetof, sizeof) per field',
            f"  out[0] = sizeof({struct.name});",
            *(
                f"  out[{1 + 2 * i}] = offsetof({struct.name}, {name}); "
                f"out[{2 + 2 * i}] = sizeof((({struct.name}*)0)->{name});"
                for i, name in enumerate(names)
            ),
            "}",
        ]
    )
    library = load_library("rlstructprobe", host_c_text(struct) + probe)
    out = (ctypes.c_uint64 * (1 + 2 * len(names)))()
    library.rl_probe(out)
    return out[0], {name: (out[1 + 2 * i], out[2 + 2 * i]) for i, name in enumerate(names)}


def test_the_compiled_null_step_struct_is_the_python_record_field_for_field():
    size, fields = _compiled_layout(NULL_STEP_ARGS)
    dtype = NULL_STEP_ARGS.numpy_dtype()
    assert size == dtype.itemsize == NULL_STEP_ARGS.size
    assert list(fields) == list(dtype.names)
    for name, (offset, width) in fields.items():
        base, record_offset = dtype.fields[name][:2]
        assert (offset, width) == (record_offset, base.itemsize), name


def test_a_struct_text_that_disagrees_with_its_declaration_does_not_compile(tmp_path):
    right = "RL_ASSERT_OFFSET(NullStepArgs, vocab, 8);"
    text = host_c_text(NULL_STEP_ARGS)
    assert right in text
    source = tmp_path / "wrong.cpp"
    source.write_text(text.replace(right, right.replace("8)", "12)")))
    r = subprocess.run(
        [find_compiler(), "-std=c++17", "-fsyntax-only", str(source)], capture_output=True, text=True
    )
    assert r.returncode != 0 and "NullStepArgs.vocab" in r.stderr


def test_a_pointer_field_is_the_hosts_pointer_on_both_sides():
    struct = Struct("RlProbe", (Field("n", "i32"), Pointer("ids", "i32", const=True), Pointer("out", "f32")))
    assert "  const int32_t* ids;" in struct.c_text() and "  float* out;" in struct.c_text()
    dtype = struct.numpy_dtype()
    assert dtype.fields["ids"][1] == POINTER_SIZE and dtype.fields["ids"][0] == np.dtype(np.uintp)
    assert dtype.itemsize == ctypes.sizeof(ctypes.c_void_p) * 3  # n padded to the pointer's alignment


def test_a_record_is_set_by_name_and_refuses_a_name_it_does_not_declare():
    record = struct_record(NULL_STEP_ARGS, vocab=7, spin_ns=2**64 - 1, token_lp=-0.5)
    assert (int(record["vocab"]), int(record["spin_ns"]), float(record["token_lp"])) == (7, 2**64 - 1, -0.5)
    assert int(record["table"]) == 0 and record.ctypes.data % NULL_STEP_ARGS.align == 0
    with pytest.raises(ValueError, match="no field of name vocab_size"):
        struct_record(NULL_STEP_ARGS, vocab_size=7)


def test_the_native_null_step_binds_every_declared_field():
    """A field added to the declaration and never bound would read zero in C: none is."""
    vocab, n_slots = 500, 8
    step = NullStep(NullModel(NullOptions(vocab, 1.0, "next", step_wait="sleep")), n_slots, kernel="native")
    layout = StepLayout.allocate(n_slots, 16, "cpu", pages_per_slot=4)
    address = step._bind(layout)
    record = step._native_args
    assert record is not None and address == record.ctypes.data
    assert all(record[name] != 0 for name in NULL_STEP_ARGS.numpy_dtype().names)
    assert int(record["n_samples"]) == layout.n_samples.data_ptr() and int(record["spin_ns"]) == 1000
    token_lp, other_lp = record_logprobs(vocab)
    assert float(record["token_lp"]) == np.float32(token_lp) and float(record["other_lp"]) == np.float32(
        other_lp
    )
    assert step._bind(layout) == address  # the same layout: bound once
