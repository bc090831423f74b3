"""`--weights auto` on the CPU for a GGUF file: the form of its matrices that runs fastest on this
machine, measured at start-up rather than assumed.

The file loads with its quantization kept (what `auto` serves unless the trial says otherwise);
the trial then takes the loaded model's first feed-forward matrix (gate|up, the largest in a
layer) and times it in each form at 1 row (a decode step at one stream) and TRIAL_ROWS[-1] rows
(many streams, or a prefill chunk's slice), interleaved, median of TRIAL_REPEATS, on this
process's threads:
- "quantized": the file's codes through cpu_quant_matmul.py (int8 activations, this CPU's ISA);
- "fp32": the same matrix dequantized to float32 through the thread-split dense matmul.
The form with the lower product of the two times wins (each load point weighs the same); only
then is the file read again, dense. On the 2-core EPYC VM the quantized form is 3-5x faster on
both ISAs (bench/results/2026-11-29-cpu-shared/); a machine whose dense GEMM outruns the integer
kernel would choose fp32. The trial costs ~50 ms; the matrix comes from the loaded model, so
the file (whose metadata takes ~2 s to parse for SmolLM2) is not read for it.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ringleader.device.model.llama import LlamaModel
    from ringleader.device.weights.cpu_quant_matmul import CpuQuantMatmul

log = logging.getLogger("ringleader.cpu")

TRIAL_ROWS = (1, 16)
TRIAL_REPEATS = 7


@dataclass
class WeightChoice:
    form: str  # "quantized" or "fp32"
    matrix: str = ""  # the matrix timed
    us: dict[str, dict[int, float]] = field(default_factory=dict)  # form -> rows -> median us

    def describe(self) -> str:
        times = "; ".join(
            f"{form} " + ", ".join(f"{us:.0f} us at {rows}" for rows, us in by_rows.items())
            for form, by_rows in self.us.items()
        )
        return f"{self.form} (measured on {self.matrix}: {times})" if self.us else self.form

    def as_description(self) -> dict:
        return {"form": self.form, "matrix": self.matrix, "us": self.us}


def trial_kernel(model: LlamaModel) -> CpuQuantMatmul | None:
    """The loaded model's first gate|up matrix when it runs through the CPU quantized kernel
    (one band); None when it does not (a file without quantized feed-forward matrices)."""
    from ringleader.device.weights.cpu_quant_matmul import CpuQuantMatmul

    linear = model.layers[0].gate_up if len(model.layers) else None
    bands = getattr(linear, "bands", [])
    return bands[0] if len(bands) == 1 and isinstance(bands[0], CpuQuantMatmul) else None


def time_forms(
    kernel: CpuQuantMatmul, rows: tuple[int, ...] = TRIAL_ROWS, repeats: int = TRIAL_REPEATS
) -> dict:
    """form -> rows -> median microseconds of x @ W.T, the forms interleaved call by call."""
    from ringleader.device.weights.weight_kernels import DenseMatmul

    forms = {
        "quantized": kernel,
        "fp32": DenseMatmul(kernel.dequantized(), torch.get_num_threads()),
    }
    samples: dict[str, dict[int, list[float]]] = {f: {m: [] for m in rows} for f in forms}
    with torch.inference_mode():
        xs = {m: torch.randn(m, kernel.k, generator=torch.Generator().manual_seed(m)) for m in rows}
        for _ in range(repeats + 1):  # the first round warms caches and builds: not kept
            for m, x in xs.items():
                for name, fn in forms.items():
                    t = time.perf_counter()
                    fn(x)
                    samples[name][m].append((time.perf_counter() - t) * 1e6)
    return {f: {m: round(statistics.median(v[1:]), 1) for m, v in by.items()} for f, by in samples.items()}


def choose_cpu_weights(model: LlamaModel) -> WeightChoice:
    """The form `--weights auto` serves for a GGUF file, from its model loaded quantized."""
    kernel = trial_kernel(model)
    if kernel is None:
        return WeightChoice("fp32")  # nothing the quantized kernel takes: the dense form
    us = time_forms(kernel)
    cost = {form: by_rows[TRIAL_ROWS[0]] * by_rows[TRIAL_ROWS[-1]] for form, by_rows in us.items()}
    choice = WeightChoice(min(cost, key=cost.__getitem__), "layers.0.gate_up", us)
    log.info("--weights auto: %s", choice.describe())
    return choice
