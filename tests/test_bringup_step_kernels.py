"""Runs E and F measure the fused step beside the layered one: E's roofline-profile times and
profiles both kinds at 1 and 32 rows, F's goals-layered serves goals-f's loads with the layered
step, its flags reaching `ringleader serve` through --server-arg; the figures name the kind."""

from __future__ import annotations

import argparse
import json

from ringleader.bench.cli import build_parser as bench_parser
from ringleader.bench.lab.bringup_figures import stage_figures
from ringleader.bench.lab.bringup_stages import RUN_LIMITS, builtin_stages
from ringleader.bench.lab.goals import server_flag
from ringleader.bench.roofline import build_parser as roofline_parser
from ringleader.bench.roofline import parse_kinds
from ringleader.hostctl.commands.serve_flags import add_engine_options, engine_config_from_args


def stages() -> dict:
    return {s.name: s for s in builtin_stages()}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_run_e_profiles_both_kinds_at_1_and_32_rows():
    stage = stages()["roofline-profile"]
    assert stage.run == "E" and stage.argv[:3] == ["{py}", "-m", "ringleader.bench.roofline"]
    args = roofline_parser().parse_args(stage.argv[3:])
    assert parse_kinds(args.step_kernels) == ("fused", "layered") and args.profile
    assert args.rows == "1,32" and args.model == "llama-1b" and str(args.json) == "{dir}/result.json"


def test_run_f_serves_the_layered_step_at_goals_f_loads():
    named = stages()
    layered, goals_f = named["goals-layered"], named["goals-f"]
    f = [s.name for s in builtin_stages() if s.run == "F"]
    assert layered.run == "F" and f.index("goals-layered") == f.index("goals-f") - 1  # just before
    assert flag(layered.argv, "--compare") == "device"
    for name in ("--concurrency", "--slots", "--requests", "--input-len", "--output-len", "--model"):
        assert flag(layered.argv, name) == flag(goals_f.argv, name), name
    assert flag(layered.argv, "--concurrency") == "1,32,256"
    # the bench hands its --server-arg values to `ringleader serve`, whose EngineConfig takes them
    bench = bench_parser().parse_args(layered.argv[layered.argv.index("bench") + 1 :])
    assert bench.server_arg[:2] == ["--step-kernels", "layered"]
    assert server_flag({"settings": {"server_arg": bench.server_arg}}, "--step-kernels") == "layered"
    serve = argparse.ArgumentParser()
    add_engine_options(serve)
    assert engine_config_from_args(serve.parse_args(bench.server_arg[:2])).step_kernels == "layered"
    assert "--server-arg={run_budget_s}" in layered.argv  # the kernel's run budget, as every bench
    # goals-e and goals-f serve the default step
    assert not any("--step-kernels" in a for s in ("goals-e", "goals-f") for a in named[s].argv)


def test_runs_e_and_f_still_fit_their_calls():
    for run in ("E", "F"):
        assert sum(s.timeout_s for s in builtin_stages() if s.run == run) == RUN_LIMITS[run] == 330


def test_the_layered_stage_figures_name_the_kind(tmp_path):
    stage = stages()["goals-layered"]
    doc = {
        "settings": {"server_arg": ["--step-kernels", "layered", "--run-budget-s", "300"]},
        "runs": [{"scheduler": "device", "concurrency": c, "output_tokens_per_s": 900.0} for c in (1, 32)],
    }
    (tmp_path / "results.json").write_text(json.dumps(doc))
    figures = stage_figures(stage, tmp_path, "")
    assert figures["device c=1 rate=None"]["step_kernels"] == "layered"
    assert figures["device c=32 rate=None"]["output_tokens_per_s"] == 900.0
