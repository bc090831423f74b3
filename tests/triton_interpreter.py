"""Runs a test module's Triton checks under the Triton interpreter, in a child process.

TRITON_INTERPRET=1 must be set before triton is first imported, and the parent pytest process
has long imported it, so each kernel test starts a child with the variable set that imports
the test module and calls its `run_interpreted_checks()`; the kernels then run on CPU tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringleader.device.step.triton_attention import HAVE_TRITON

REPO = Path(__file__).resolve().parents[1]


def run_interpreted_checks_of(module: str, passed_marker: str, timeout: float = 300) -> None:
    """Skips without triton; fails with the child's output unless it exits 0 and prints the marker."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = f"import {module} as t; t.run_interpreted_checks()"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert passed_marker in proc.stdout
