"""The bring-up's stages: each run's stages in their order (A and B: the first GPU run; C and D:
the second pass; E and F: every goal in one 15-minute window, the fused step beside the
layered one), what each runs, its timeout and what it needs; a JSON stage table in their place
(tests, custom runs); the selection of one run's stages, and the table `--list` prints."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # every stage runs here, with it on PYTHONPATH

# No lazy module loading beside a spinning kernel on a first run, and 32 hardware queues so no
# stream lands behind the never-ending persistent-kernel launch.
DEVICE_ENV = {"CUDA_MODULE_LOADING": "EAGER", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}
RUNS = ("A", "B", "C", "D", "E", "F")
RUN_LIMIT_S = 540.0  # each run's stage timeouts sum to at most this (a device call: 600 s)
# The second pass (C, D) fits a session's 15 minutes of device time: two calls back to back on one
# warm machine, the SmolLM2 GGUF carried half in each (bench/lab/gpu_model_pieces.py).
# E and F likewise: the goals measured in one window, nothing carried between them but the wheels.
RUN_LIMITS = {"A": RUN_LIMIT_S, "B": RUN_LIMIT_S, "C": 330.0, "D": 330.0, "E": 330.0, "F": 330.0}
# run F's bubble-resident and bubble-pingpong: each one server and three load points (~30 s)
LAUNCH_BUBBLE_S = 40.0
# goals-layered's server: the decode step's old kernels (EngineConfig.step_kernels)
LAYERED_SERVER = "--server-arg=--step-kernels --server-arg=layered"
CARRY_STASH = "/tmp/ringleader-carry"  # outside the working tree: kept from call C to call D
CARRY_MODELS = "/tmp/ringleader-models"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOG_TAIL = 4000  # characters of the end of a stage's log kept in its record

# The tests stage: the GPU-only tests no other stage already runs, in one pytest process.
# The cudaFree test comes last: cudaFree waits beside a persistent kernel (seen on the H100),
# and should the server's stop not release it, pytest-timeout ends the process there.
TESTS_STAGE_NODES = (
    "tests/test_gguf_quants.py::test_cuda_decode_matches_reference_bitwise",
    "tests/test_gpu_backend.py::test_gpu_256_streams_each_get_one_done",
    "tests/test_gpu_backend.py::test_gpu_allocation_while_the_kernel_runs",
    "tests/test_gpu_backend.py::test_gpu_kernel_that_ends_on_its_own_becomes_engine_dead",
    "tests/test_gpu_backend.py::test_gpu_abort_and_shutdown_in_flight",
    "tests/test_gpu_backend.py::test_gpu_logprobs_and_choices_match_the_cpu_backend",
    "tests/test_gpu_backend.py::test_gpu_null_model_in_every_mode",
    "tests/test_triton_quant_matmul.py::test_compiled_kernel_on_the_gpu",
    "tests/test_seeded_weights.py::test_the_same_preset_weights_on_the_gpu",
    "tests/test_gpu_backend.py::test_gpu_prefix_caching_serves_the_cpu_backends_tokens_and_hits",
    "tests/test_fused_step.py::test_fused_step_on_the_gpu",
    "tests/test_gpu_backend.py::test_gpu_structured_output_matches_the_cpu_backend[device]",
    # speculative decoding: drafts verified on the device (null model), greedy tokens unchanged (tiny)
    "tests/test_gpu_spec_decode.py::test_gpu_drafts_are_verified_and_accepted_on_the_device",
    "tests/test_gpu_spec_decode.py::test_gpu_greedy_tokens_are_the_same_with_drafts",
    "tests/test_gpu_backend.py::test_gpu_structured_output_matches_the_cpu_backend[host]",
    "tests/test_gpu_backend.py::test_gpu_free_while_the_kernel_runs_waits_and_stop_releases_it",
)
# Every other GPU-only test, and the stage that covers what it checks (a CPU test holds this
# table and TESTS_STAGE_NODES against the GPU-only tests pytest collects).
COVERED_BY_STAGE = {
    "tests/test_gpu_graphs.py::test_the_scheduler_module_loads_with_every_kernel": "module",
    "tests/test_gpu_graphs.py::test_captured_graphs_match_the_eager_step[float32]": "graphs-fp32",
    "tests/test_gpu_graphs.py::test_captured_graphs_match_the_eager_step[bfloat16]": "graphs-bf16",
    "tests/test_gpu_backend.py::test_gpu_mode_parity_timeline_and_stop[device-pingpong]": "tests-all",
    "tests/test_gpu_backend.py::test_gpu_mode_parity_timeline_and_stop[device-resident]": "backend-resident",
    "tests/test_gpu_backend.py::test_gpu_mode_parity_timeline_and_stop[device-pump]": "backend-pump",
    "tests/test_gpu_backend.py::test_gpu_mode_parity_timeline_and_stop[host-loop]": "backend-host",
    "tests/test_gpu_limits_build.py::test_quick_probe_on_gpu": "gpu-limits",
}


@dataclass
class Stage:
    name: str
    argv: list[str]
    timeout_s: float
    needs: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    run: str = "A"


@dataclass
class StageResult:
    name: str
    status: str  # passed | failed | timeout | skipped | killed
    seconds: float = 0.0
    returncode: int | None = None
    command: str = ""
    needs: tuple[str, ...] = ()
    reason: str | None = None
    figures: dict | None = None
    log_tail: str = ""
    run: str | None = None
    timeout_s: float | None = None  # the timeout it was given (the budget may cut it)


# Run E's tests: every GPU test in one process (the stages' own checks of runs A/B included), so
# one window proves the device path and everything that landed since; the cudaFree test last.
ALL_GPU_TESTS_NODES = (
    "tests/test_gpu_graphs.py::test_the_scheduler_module_loads_with_every_kernel",
    *(n for n in COVERED_BY_STAGE if "test_gpu_mode_parity_timeline_and_stop" in n),
    *TESTS_STAGE_NODES,
)


def tests_stage_argv(nodes=TESTS_STAGE_NODES) -> list[str]:
    argv = ["{py}", "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "--junitxml", "{dir}/junit.xml"]
    if importlib.util.find_spec("pytest_timeout") is not None:  # on the GPU image; maybe not here
        argv += ["--timeout", "45", "--timeout-method", "thread"]  # a stuck CUDA call ends the process
    return argv + list(nodes)


def builtin_stages() -> list[Stage]:
    checks = ["{py}", "-m", "ringleader.bench.lab.bringup_checks"]
    budget = ["--server-arg=--run-budget-s", "--server-arg={run_budget_s}"]
    bench = ["{py}", "-m", "ringleader.hostctl.cli", "bench", "--device", "cuda", "--model", "llama-1b"]
    lengths = ["--input-len", "128", "--output-len", "128", "--ignore-eos", "--no-plots"]
    pieces = ["{py}", "-m", "ringleader.bench.lab.gpu_model_pieces"]
    parity = ["{py}", "-m", "ringleader.bench.lab.parity", "--device", "cuda", "--json", "{dir}/parity.json"]
    # llama-1b bf16 decode steps (1 and 32 rows) against the memory roofline
    roofline = [
        "{py}",
        "-m",
        "ringleader.bench.roofline",
        "--model",
        "llama-1b",
        "--rows",
        "1,32",
        "--ctx",
        "512",
    ]
    roofline += ["--json", "{dir}/result.json"]
    gpu_limits = ["{py}", "-m", "ringleader.bench.lab.gpu_limits", "--quick", "--out-dir", "{dir}"]

    def bubble(c: int, n: int) -> Stage:  # resident mode at c streams, with its raw device timeline
        argv = bench + ["--compare", "device", "--launch", "resident", "--concurrency", str(c)]
        argv += ["--requests", str(n), *lengths, "--server-arg=--trace"]
        argv += ["--server-arg={dir}/device-trace.json", *budget, "--out", "{dir}"]
        return Stage(f"bubble-c{c}", argv, 80, ("backend-resident",), dict(DEVICE_ENV), "A")

    def stage(name, argv, timeout, needs=(), run="A") -> Stage:
        return Stage(name, argv, timeout, tuple(needs), dict(DEVICE_ENV), run)

    def measured(name, flags: str, timeout, needs=(), run="A") -> Stage:
        """`ringleader bench` on llama-1b, 128 in / 128 out, the kernel's run budget, out to {dir}."""
        return stage(name, bench + flags.split() + [*lengths, *budget, "--out", "{dir}"], timeout, needs, run)

    def launch_bubble(launch: str, signal: str) -> Stage:
        """Run F: device mode in one launch mode at goals-f's loads, its raw trace kept (each
        run's entry carries its void steps too).  Expected ~30 s: the server's
        start (~17 s on the H200), 16/128/512 requests (~8 s), the process (~5 s)."""
        flags = f"--compare device --launch {launch} --concurrency 1,32,256 --slots 256 --requests 16,128,512"
        flags += f" --server-arg=--step-signal --server-arg={signal}"
        flags += " --server-arg=--trace --server-arg={dir}/device-trace.json"
        return measured(f"bubble-{launch}", flags, LAUNCH_BUBBLE_S, run="F")

    return [
        # ---- run A: does the device path run at all, and what is its bubble -----------------
        stage("env", ["{py}", "-m", "ringleader.hostctl.cli", "doctor", "--json", "{dir}/doctor.json"], 30),
        stage("module", checks + ["module"], 30),
        stage("graphs-fp32", checks + ["graphs", "--dtype", "float32"], 60),
        # llama-1b bf16 step graphs, and the resident launch graph instantiated around them
        stage("graphs-bf16", checks + ["graphs", "--dtype", "bfloat16", "--embed", "llama-1b"], 100),
        # llama-1b bf16 decode steps (1 and 32 rows) against the memory roofline
        stage(
            "roofline",
            roofline,
            40,
            ["graphs-bf16"],
        ),
        stage(
            "backend-resident",
            checks + ["backend", "--scheduler", "device", "--launch", "resident"],
            120,
            ["module", "graphs-fp32"],
        ),
        bubble(1, 16),
        bubble(64, 128),
        # ---- run B: the other modes, device vs host, the tests left over, three probes -------
        stage("backend-host", checks + ["backend", "--scheduler", "host"], 110, ["graphs-fp32"], "B"),
        measured(
            "perf",
            "--compare device,host --concurrency 1,32 --requests 64",
            150,
            ["backend-host", "backend-resident"],
            "B",
        ),
        stage(
            "backend-pump",
            checks + ["backend", "--scheduler", "device", "--launch", "pump"],
            110,
            ["module", "graphs-fp32"],
            "B",
        ),
        stage("tests", tests_stage_argv(), 110, ["graphs-fp32"], "B"),
        stage(
            "gpu-limits",
            [
                "{py}",
                "-m",
                "ringleader.bench.lab.gpu_limits",
                "--quick",
                "--only",
                "2,3,5",
                "--max-seconds",
                "50",
            ]
            + ["--out-dir", "{dir}"],
            60,
            run="B",
        ),
        # ---- run C (second pass, call 1): parity on tiny and a transformers-made checkpoint,
        # device vs host vs static at 256 streams, CPU interference; half of SmolLM2 kept -----
        stage("model-stash", pieces + ["stash", ".carry/piece-1", "--to", CARRY_STASH], 10, run="C"),
        stage("parity", parity + ["--model", "tiny", "--model", "hf-random"], 150, run="C"),
        measured(
            "compare-256",
            "--compare device,host,static --concurrency 256 --slots 256 --requests 512",
            100,
            run="C",
        ),
        measured(
            "interference",
            "--compare device,host --concurrency 32 --requests 128 --cpu-interference 16",
            70,
            run="C",
        ),
        # ---- run D (call 2, the same warm machine): SmolLM2 whole again, its parity, transformers'
        # continuous batching beside ours, an open-loop sweep, the gpu_limits probes not yet run --
        stage(
            "model-join",
            pieces + ["join", CARRY_STASH, ".carry/piece-2", "--out", CARRY_MODELS],
            15,
            run="D",
        ),
        stage(
            "parity-smollm2", parity + ["--model", f"{CARRY_MODELS}/{SMOLLM2_FILE}"], 100, ["model-join"], "D"
        ),
        measured("compare-hf", "--compare device,hf --concurrency 1,32 --requests 64", 90, run="D"),
        measured("sweep", "--compare device,host --request-rate 50,150 --requests 128", 60, run="D"),
        stage(
            "gpu-limits-rest",
            [
                "{py}",
                "-m",
                "ringleader.bench.lab.gpu_limits",
                "--only",
                "1,4,6,7",
                "--max-seconds",
                "55",
                "--out-dir",
                "{dir}",
            ],
            65,
            run="D",
        ),
        # ---- run E (every goal, call 1): the GPU tests, the goals bench device then host at 1,
        # 32 and 256 streams (per-run timelines, both modes' bubbles), the fused and the layered
        # step side by side against their floor, each with its kernels (10 profiled steps, not
        # 20: the four profiles record as many steps as the two did).  Dropped for the second kind's
        # 20 s: doctor (every run's bringup.json names the GPU, driver, CUDA, NVRTC, torch and
        # Triton in its versions line; run A's env stage is the doctor) ----
        stage("tests-all", tests_stage_argv(ALL_GPU_TESTS_NODES), 140, run="E"),
        measured(
            "goals-e",
            "--compare device,host --concurrency 1,32,256 --slots 256 --requests 16,128,512",
            100,
            run="E",
        ),
        stage(
            "roofline-profile",
            roofline + ["--step-kernels", "fused,layered", "--profile", "--profile-steps", "10"],
            90,
            run="E",
        ),
        # ---- run F (call 2, the same warm machine): the bubble and the critical phase of the
        # resident and the ping-pong launch side by side (first: what the bubble goal now hangs
        # on; resident before the new launch, so a ping-pong stop that hangs cannot cost its
        # figures), the launch probes (devices launching graphs, two WHILE graphs taking turns: the
        # ping-pong design's floor), CPU interference in both modes, open loop at 256 slots, the
        # layered step's device runs at goals-f's loads, then the goals bench again in the other
        # order (the spread between E and F is part of the result; its device runs are the fused
        # step's, beside the layered ones).  Dropped for the launch pair's 80 s: probe 10
        # (a WHILE around the real step: the resident loop's cost, which bubble-resident now
        # measures on the real server) and prefix-device (no goal reads it; prefix caching on
        # the device is proven by its GPU test in E's tests-all).  Dropped for goals-layered's
        # 42 s: token-path (the null model's host token path has no step kernels in it, no goal
        # row reads it, and its before/after stands measured in results/2026-11-28-cpu-token-path;
        # `python -m ringleader.bench.lab.token_path` runs it by hand) ----
        launch_bubble("resident", "node"),  # the launch as it was measured on the H100
        launch_bubble("pingpong", "auto"),  # the design: the signal in the step where it builds
        stage("launch-probes", gpu_limits + ["--only", "8,9", "--max-seconds", "15"], 18, run="F"),
        measured(
            "interference-both",
            "--compare device,host --concurrency 32 --requests 128 --cpu-interference 16",
            60,
            run="F",
        ),
        measured(
            "open-loop-256",
            "--compare device,host --request-rate 200,800 --slots 256 --requests 256,512",
            62,
            run="F",
        ),
        # goals-f's device runs with the old step (cuBLAS projections, a kernel per pointwise
        # op) in place of the fused default: the two kinds' throughput at 1, 32 and 256 streams.
        # Expected ~30 s, as a bubble stage: the server's start, 16/128/512 requests, the process
        measured(
            "goals-layered",
            f"--compare device --concurrency 1,32,256 --slots 256 --requests 16,128,512 {LAYERED_SERVER}",
            42,
            run="F",
        ),
        measured(
            "goals-f",
            "--compare host,device --concurrency 1,32,256 --slots 256 --requests 16,128,512",
            68,
            run="F",
        ),
    ]


def load_stages(path: str | None) -> list[Stage]:
    if path is None:
        return builtin_stages()
    rows = json.loads(Path(path).read_text())
    return [
        Stage(
            r["name"],
            list(r["argv"]),
            float(r["timeout_s"] if "timeout_s" in r else r["timeout"]),
            tuple(r.get("needs", ())),
            dict(r.get("env", {})),
            str(r.get("run", "A")),
        )
        for r in rows
    ]


def select(stages: list[Stage], run: str | None, only: list[str], skip: list[str]) -> list[Stage]:
    def hit(name, patterns):
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    return [
        s
        for s in stages
        if (run is None or s.run == run) and (not only or hit(s.name, only)) and not hit(s.name, skip)
    ]


def run_totals(stages: list[Stage]) -> dict:
    runs = sorted({s.run for s in stages})
    return {r: sum(s.timeout_s for s in stages if s.run == r) for r in runs}


def list_stages(stages: list[Stage], as_json: bool) -> None:
    totals = run_totals(stages)
    if as_json:
        rows = [
            {
                "name": s.name,
                "run": s.run,
                "timeout_s": s.timeout_s,
                "needs": list(s.needs),
                "argv": s.argv,
                "env": s.env,
            }
            for s in stages
        ]
        print(json.dumps({"stages": rows, "totals": totals}, indent=2))
        return
    print(f"{'stage':<17} {'run':<3} {'timeout':>7}  {'needs':<30} command")
    for s in stages:
        env = "" if s.env == DEVICE_ENV else " ".join(f"{k}={v}" for k, v in s.env.items())
        print(
            f"{s.name:<17} {s.run:<3} {s.timeout_s:>6.0f}s  {','.join(s.needs) or '-':<30} "
            f"{(env + ' ') if env else ''}{shlex.join(s.argv)}"
        )
    for r, total in totals.items():
        n = sum(1 for s in stages if s.run == r)
        print(
            f"run {r}: {n} stages, timeouts sum to {total:.0f} s (a run's limit: {RUN_LIMITS.get(r, RUN_LIMIT_S):.0f} s)"
        )
    device = " ".join(f"{k}={v}" for k, v in DEVICE_ENV.items())
    print(f"every stage runs with {device} unless its line says otherwise")
