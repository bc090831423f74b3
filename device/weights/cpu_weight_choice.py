"""`--weights auto` on the CPU for a GGUF file: the form of its matrices that runs fastest on this
machine, measured at start-up rather than assumed.

The trial takes the file's first feed-forward matrix (the largest in a layer), kept quantized,
and times it in each form at 1 row (a decode step at one stream) and TRIAL_ROWS[-1] rows (many
streams, or a prefill chunk's slice), interleaved, median of TRIAL_REPEATS, on this process's
threads:
- "quantized": the file's codes through cpu_quant_matmul.py (int8 activations, this CPU's ISA);
- "fp32": the matrix dequantized to float32 through the thread-split dense matmul.
The form with the lower product of the two times wins (each load point weighs the same). On the
2-core EPYC VM the quantized form is 4-10x faster on both ISAs (bench/results/2026-11-29-cpu-shared/);
a machine whose dense GEMM outruns the integer kernel (a wide AMX or many-core server at many
rows) would choose fp32. Costs ~50 ms once.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

import torch

from ringleader.device.weights.quant_weights import DIGIT_FORMS, GGUFMatrix

log = logging.getLogger("ringleader.cpu")

TRIAL_ROWS = (1, 16)
TRIAL_REPEATS = 7
TRIAL_TENSORS = ("blk.0.ffn_up.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight")


@dataclass
class WeightChoice:
    form: str  # "quantized" or "fp32"
    matrix: str = ""  # the tensor timed
    us: dict[str, dict[int, float]] = field(default_factory=dict)  # form -> rows -> median us

    def describe(self) -> str:
        times = "; ".join(
            f"{form} " + ", ".join(f"{us:.0f} us at {rows}" for rows, us in by_rows.items())
            for form, by_rows in self.us.items()
        )
        return f"{self.form} (measured on {self.matrix}: {times})" if self.us else self.form

    def as_description(self) -> dict:
        return {"form": self.form, "matrix": self.matrix, "us": self.us}


def trial_matrix(path: str) -> GGUFMatrix | None:
    """The first layer's feed-forward matrix of a GGUF file, kept quantized; None without one
    of a type the quantized kernel takes."""
    from ringleader.device.weights.gguf_checkpoint import _kept_quantized, open_gguf

    tensors = {t.name: t for t in open_gguf(path).tensors}
    for name in TRIAL_TENSORS:
        tensor = tensors.get(name)
        if tensor is not None and tensor.tensor_type.name in DIGIT_FORMS:
            return _kept_quantized(tensor, "cpu")
    return None


def time_forms(matrix: GGUFMatrix, rows: tuple[int, ...] = TRIAL_ROWS, repeats: int = TRIAL_REPEATS) -> dict:
    """form -> rows -> median microseconds of x @ W.T, the forms interleaved call by call."""
    from ringleader.device.weights.cpu_quant_matmul import CpuQuantMatmul
    from ringleader.device.weights.weight_kernels import DenseMatmul

    forms = {
        "quantized": CpuQuantMatmul.from_gguf(matrix),
        "fp32": DenseMatmul(matrix.dense(torch.float32), torch.get_num_threads()),
    }
    samples: dict[str, dict[int, list[float]]] = {f: {m: [] for m in rows} for f in forms}
    with torch.inference_mode():
        xs = {m: torch.randn(m, matrix.shape[1], generator=torch.Generator().manual_seed(m)) for m in rows}
        for _ in range(repeats + 1):  # the first round warms caches and builds: not kept
            for m, x in xs.items():
                for name, fn in forms.items():
                    t = time.perf_counter()
                    fn(x)
                    samples[name][m].append((time.perf_counter() - t) * 1e6)
    return {f: {m: round(statistics.median(v[1:]), 1) for m, v in by.items()} for f, by in samples.items()}


def choose_cpu_weights(path: str) -> WeightChoice:
    """The form `--weights auto` takes for the GGUF file at `path` on this machine."""
    matrix = trial_matrix(path)
    if matrix is None:
        return WeightChoice("fp32")  # nothing the quantized kernel takes: the dense form
    us = time_forms(matrix)
    cost = {form: by_rows[TRIAL_ROWS[0]] * by_rows[TRIAL_ROWS[-1]] for form, by_rows in us.items()}
    choice = WeightChoice(min(cost, key=cost.__getitem__), matrix.name, us)
    log.info("--weights auto: %s", choice.describe())
    return choice
