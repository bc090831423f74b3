"""The installed command line, as a user runs it: serve, generate (text and ids), stats,
graceful stop on SIGTERM and SIGINT, build-kernel."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import RawPeer
from tests.test_nvrtc import KERNEL_FUNCTIONS

CLI = [sys.executable, "-m", "ringleader.hostctl.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        CLI + ["serve", "--model", "tiny", "--bind", addr, "--slots", "4", "--max-ctx", "256"],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = subprocess.run(
            CLI + ["stats", "--connect", addr, "--timeout", "1"], capture_output=True, text=True
        )
        if r.returncode == 0:
            break
        assert proc.poll() is None, proc.stderr.read()
    yield addr, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_generate_streams_text_and_ids(served):
    addr, _ = served
    r = subprocess.run(
        CLI + ["generate", "Hello", "--max-tokens", "12", "--ignore-eos", "--connect", addr],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "[length: 6 prompt + 12 completion tokens]" in r.stderr
    r = subprocess.run(
        CLI + ["generate", "--prompt-ids", "1,2,3", "--max-tokens", "8", "--ignore-eos", "--connect", addr],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    ids = [int(x) for x in r.stdout.split()]
    assert len(ids) == 8 and all(0 <= i < 264 for i in ids)


def test_stats_prints_json(served):
    addr, _ = served
    r = subprocess.run(CLI + ["stats", "--connect", addr], capture_output=True, text=True, timeout=30)
    stats = json.loads(r.stdout)
    assert stats["model"] == "tiny" and stats["backend"]["device"] == "cpu"
    assert stats["process_cpu_s"] > 0


def test_a_plain_install_serves_without_the_http_extras():
    """`pip install ringleader` has neither aiohttp nor prometheus_client: serve must not need
    them unless --http or --metrics asks (here both imports fail, as on a plain install)."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    code = (
        "import sys; sys.modules['aiohttp'] = None; sys.modules['prometheus_client'] = None; "
        "from ringleader.hostctl.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "serve", "--bind", addr, "--slots", "2", "--max-ctx", "128"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        peer = RawPeer(addr)
        peer.send({"op": "generate", "id": 1, "prompt_ids": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
        msgs = peer.recv_until(lambda m: m["op"] == "done")
        assert msgs[-1]["finish_reason"] == "length", msgs[-1]
        peer.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_gracefully_with_requests_in_flight(sig):
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        CLI + ["serve", "--bind", addr, "--max-ctx", "1024", "--drain-timeout", "0.3"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        peer = RawPeer(addr)
        peer.ping()
        for i in range(3):
            peer.send({"op": "generate", "id": i, "prompt_ids": [1], "max_tokens": 1000, "ignore_eos": True})
        peer.recv_until(lambda m: m["op"] == "token")
        proc.send_signal(sig)
        dones = {}
        deadline = time.monotonic() + 30
        while len(dones) < 3 and time.monotonic() < deadline:
            m = peer.recv(30)
            if m["op"] == "done":
                assert m["id"] not in dones
                dones[m["id"]] = m
        assert set(dones) == {0, 1, 2}
        assert {d["error"]["code"] for d in dones.values()} == {"shutdown"}
        assert proc.wait(timeout=30) == 0
        peer.close()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_build_kernel_reports_resources():
    pytest.importorskip("cuda.bindings.nvrtc")
    r = subprocess.run(CLI + ["build-kernel", "--arch", "sm_90"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "registers/thread" in r.stdout and "0 bytes spilled" in r.stdout


def test_doctor_reports_versions_kernel_and_why_cuda_would_fail(tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    import torch

    out = tmp_path / "doctor.json"
    r = subprocess.run(CLI + ["doctor", "--json", str(out)], capture_output=True, text=True, timeout=180)
    report = json.loads(out.read_text())
    assert report["versions"]["torch"] and report["kernel"]["arch"]
    fns = report["kernel"]["functions"]
    assert set(fns) == KERNEL_FUNCTIONS
    assert all(f["registers"] and f["spill_bytes"] == 0 for f in fns.values())
    assert "rl_scheduler_persistent:" in r.stdout and "registers" in r.stdout
    if torch.cuda.is_available():
        return  # on a GPU machine the verdict depends on it; the bring-up records it
    assert r.returncode == 1 and report["cuda_ready"] is False
    assert any("no CUDA GPU is visible" in p for p in report["problems"])
    assert "a CUDA run would fail here" in r.stdout


def test_doctor_names_an_unsafe_variable():
    pytest.importorskip("cuda.bindings.nvrtc")
    import os

    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    r = subprocess.run(CLI + ["doctor"], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 1
    assert "PROBLEM: PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync" in r.stdout


def test_serve_offers_the_launch_modes():
    r = subprocess.run(CLI + ["serve", "--help"], capture_output=True, text=True, timeout=60)
    assert "{auto,pingpong,resident,pump}" in r.stdout and "--gpu-memory-fraction" in r.stdout


def test_serve_options_are_the_engine_config_and_its_defaults():
    from ringleader.device.engine_config import EngineConfig
    from ringleader.hostctl.cli import build_parser
    from ringleader.hostctl.commands.serve_flags import engine_config_from_args

    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["serve"])) == EngineConfig()
    args = parser.parse_args(
        ["serve", "--slots", "4", "--max-ctx", "256", "--trace", "t.json", "--seed", "3"]
    )
    assert engine_config_from_args(args) == EngineConfig(n_slots=4, max_ctx=256, trace_path="t.json", seed=3)
    args = parser.parse_args(["serve", "--run-budget-s", "90"])
    assert engine_config_from_args(args).run_budget_s == 90.0


def test_serve_options_are_the_server_config_and_its_defaults():
    from ringleader.hostctl.cli import build_parser
    from ringleader.hostctl.commands.serve_flags import serve_flags, server_config_from_args
    from ringleader.hostctl.serving.config import ServerConfig

    parser = build_parser()
    assert server_config_from_args(parser.parse_args(["serve"])) == ServerConfig()
    args = parser.parse_args(["serve", "--max-queue", "7", "--drain-timeout", "0.5", "--watchdog-s", "3"])
    assert server_config_from_args(args) == ServerConfig(max_queued=7, drain_timeout_s=0.5, watchdog_s=3.0)
    # the bench writes a server's flags from the fields of both configs
    assert serve_flags(n_slots=4, threads=None, max_queued=7) == ["--slots", "4", "--max-queue", "7"]
    cpu, gpu = ServerConfig().resolved("cpu"), ServerConfig().resolved("NVIDIA H100 80GB HBM3")
    assert (cpu.watchdog_s, gpu.watchdog_s) == (60.0, 2.0)
    assert ServerConfig(watchdog_s=5.0).resolved("cpu").watchdog_s == 5.0


def test_serve_refuses_a_bad_engine_option_in_one_line_before_loading_anything():
    r = subprocess.run(CLI + ["serve", "--run-budget-s", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        r.stderr.strip()
        == "ringleader: cannot start: --run-budget-s (run_budget_s) must be a positive number of seconds, got 0.0"
    )


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--slots", "0"], "--slots (n_slots) must be an integer in [1, 65535], got 0"),
        (["--slots", "70000"], "--slots (n_slots) must be an integer in [1, 65535], got 70000"),
        (["--max-ctx", "1"], "--max-ctx (max_ctx) must be an integer >= 2, got 1"),
        (["--max-ctx", "-1"], "--max-ctx (max_ctx) must be an integer >= 2, got -1"),
        (["--token-budget", "0"], "--token-budget (token_budget) must be an integer >= 1, got 0"),
        (["--threads", "0"], "--threads (threads) must be an integer >= 1, got 0"),
        (["--gpu-memory-fraction", "1.5"], "--gpu-memory-fraction must be in (0, 1], got 1.5"),
        (["--page-size", "24"], "--page-size (page_size) must be a power of two, got 24"),
        (
            ["--weights", "quantized"],
            "--weights quantized keeps a GGUF file's quantization; tiny is not a .gguf file "
            "(use --weights auto, fp32 or bf16)",
        ),
    ],
)
def test_serve_refuses_an_option_out_of_range_by_its_flag(flags, said):
    r = subprocess.run(CLI + ["serve", *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == f"ringleader: cannot start: {said}"


def test_a_kv_cache_that_holds_no_whole_request_says_what_would():
    from ringleader.device.backends.kv_pool import plan_pool

    with pytest.raises(MemoryError) as one_page:  # 40 KiB: one page of 16 tokens at 2 KiB each
        plan_pool(pool_bytes=40 << 10, bytes_per_token=2048, page_size=16, max_ctx=2048, n_slots=4)
    assert str(one_page.value).endswith(
        "the KV cache of 40.0 KiB holds 1 pages of 16 tokens (2.0 KiB per token), and one request of "
        "--max-ctx 2048 needs 128: raise --kv-cache-memory to at least 4.0 MiB or lower --max-ctx to 16 or less"
    )
    with pytest.raises(MemoryError) as no_page:  # no context fits: only raising the memory helps
        plan_pool(pool_bytes=1 << 10, bytes_per_token=2048, page_size=16, max_ctx=2048, n_slots=4)
    assert str(no_page.value).endswith("raise --kv-cache-memory to at least 4.0 MiB")


def test_engine_config_fills_the_per_device_defaults_in_one_place():
    from ringleader.device.engine_config import EngineConfig

    cpu, cuda = EngineConfig().resolved("cpu"), EngineConfig().resolved("cuda")
    assert (cpu.device, cpu.scheduler, cpu.max_ctx, cpu.dtype) == ("cpu", "host", 2048, "float32")
    assert (cuda.device, cuda.scheduler, cuda.max_ctx, cuda.dtype) == ("cuda", "device", None, "bfloat16")
    assert (cpu.n_slots, cpu.token_budget) == (cuda.n_slots, cuda.token_budget) == (128, 256)
    assert (cpu.kv_cache_memory, cuda.kv_cache_memory, cpu.page_size) == (512 << 20, None, 16)
    given = EngineConfig(scheduler="host", max_ctx=512, dtype="float16").resolved("cuda")
    assert (given.scheduler, given.max_ctx, given.dtype) == ("host", 512, "float16")
    with pytest.raises(ValueError, match="needs CUDA"):
        EngineConfig(scheduler="device").resolved("cpu")
    with pytest.raises(ValueError, match="no.* timeline|has none"):
        EngineConfig(trace_path="t.json").resolved("cpu")
    with pytest.raises(ValueError, match="policy must be one of"):
        EngineConfig(policy="lifo")
