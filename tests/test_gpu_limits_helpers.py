"""The GPU-limits probe's helpers, on any machine: cuda_driver's check and call (the probe's own
are the runtime's), no driver binding of the probe's own, parse_ptxas, device_slug, summarize and
--only."""

from __future__ import annotations

import pytest

from tests.gpu_limits_probe import ROOT, cuda_driver, load


def test_check_names_the_failing_call():
    pytest.importorskip("cuda.bindings")
    gl = cuda_driver()  # the probe's check, call and CudaError are the runtime's
    from cuda.bindings import driver, nvrtc

    assert load("device").CudaError is gl.CudaError and load("common").CudaError is gl.CudaError

    ok = gl.check((driver.CUresult.CUDA_SUCCESS, 7))
    assert ok == 7
    assert gl.check((driver.CUresult.CUDA_SUCCESS, 1, 2)) == (1, 2)
    assert gl.check((driver.CUresult.CUDA_SUCCESS,)) is None
    with pytest.raises(gl.CudaError, match=r"cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY \(2\)"):
        gl.check((driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, 0), "cuMemAlloc")

    def cuFakeThing():
        return (driver.CUresult.CUDA_ERROR_INVALID_VALUE,)

    with pytest.raises(gl.CudaError, match="cuFakeThing failed: CUDA_ERROR_INVALID_VALUE"):
        gl.check(cuFakeThing())
    with pytest.raises(gl.CudaError, match="nvrtcCompileProgram failed: NVRTC_ERROR_COMPILATION"):
        gl.check((nvrtc.nvrtcResult.NVRTC_ERROR_COMPILATION,), "nvrtcCompileProgram")
    with pytest.raises(gl.CudaError, match="cuStreamQuery failed: CUDA_ERROR_INVALID_HANDLE"):
        gl.call(_named("cuStreamQuery", driver.CUresult.CUDA_ERROR_INVALID_HANDLE), 1)


def test_probe_reuses_the_runtime_driver_helpers():
    """The package makes no driver binding of its own: every call goes through cuda_driver."""
    for path in (ROOT / "bench" / "lab" / "gpu_limits").glob("*.py"):
        text = path.read_text()
        assert "import driver" not in text and "from cuda import cuda" not in text, path.name
        assert "cuda.bindings.driver" not in text, path.name


def _named(name, err):
    def f(*_a):
        return (err,)

    f.__name__ = name
    return f


def test_helpers():
    common, kernels, cli = load("common"), load("kernels"), load("__main__")
    assert common.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert common.device_slug("NVIDIA H100 PCIe") == "h100"
    assert common.device_slug("NVIDIA H200") == "h200"
    assert common.device_slug("NVIDIA GH200 480GB") == "gh200"
    assert common.device_slug("NVIDIA GeForce RTX 4090") == "rtx-4090"
    log = (
        "ptxas info    : Compiling entry function 'k1' for 'sm_90'\n"
        "ptxas info    : Function properties for k1\n"
        "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 380 bytes cmem[0]\n"
        "ptxas info    : Compiling entry function 'k2' for 'sm_90'\n"
        "ptxas info    : Function properties for k2\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 6 registers, used 0 barriers\n"
    )
    p = kernels.parse_ptxas(log)
    assert p["k1"] == {
        "regs": 40,
        "smem_bytes": 1024,
        "stack_bytes": 8,
        "spill_store_bytes": 4,
        "spill_load_bytes": 4,
        "cmem0_bytes": 380,
    }
    assert p["k2"]["regs"] == 6 and p["k2"]["smem_bytes"] == 0
    s = common.summarize([1000, 2000, 3000, 4000])
    assert s["n"] == 4 and s["median_us"] == 2.5 and s["min_us"] == 1.0 and s["max_us"] == 4.0
    assert common.summarize([]) == {"n": 0}
    assert cli.parse_args(["--only", "4,1,3-4"]).selected == [1, 3, 4]
    everything = cli.parse_args([]).selected
    assert sorted(everything) == list(range(1, 11)) and everything == list(common.RUN_ORDER)
    # the probes that depend on a graph builtin run last, device-side cudaGraphLaunch the very last
    assert set(everything[-5:]) == {3, 4, 9, 10, 8} and everything[-1] == 8
    with pytest.raises(SystemExit):
        cli.parse_args(["--only", "11"])
    assert cli.parse_args(["--only", "8-10"]).selected == [9, 10, 8]


def test_idle_gaps_put_two_graphs_steps_in_turn():
    import numpy as np

    graphpair = load("graphpair")
    # [wake, work start, release] per step, ns
    one = np.array([[0, 10, 50], [0, 53, 90], [0, 97, 120]])
    assert graphpair.idle_gaps([one]).tolist() == [3, 7]
    a = np.array([[0, 10, 50], [0, 130, 170]])  # role 0: steps 0 and 2
    b = np.array([[0, 60, 120], [0, 175, 200]])  # role 1: steps 1 and 3
    assert graphpair.idle_gaps([a, b]).tolist() == [10, 10, 5]
