"""RayServeArgs, checked once for the CLI, `serve run key=value` and config files, without Ray;
and ray stays an optional extra: nothing outside hostctl/ray_serve/ imports it."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from ringleader.hostctl.cli import build_parser
from ringleader.hostctl.commands.ray_serve import args_from_cli
from ringleader.hostctl.ray_serve.args import ArgsError, RayServeArgs

ROOT = Path(__file__).resolve().parents[1]


def cli(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["ray-serve", *argv])


def test_serve_run_strings_and_config_values_read_alike():
    """`serve run` passes strings; a config file passes YAML's types; serve options by flag or
    field name, at the top level or under `engine`."""
    from_strings = RayServeArgs.from_dict(
        {"model": "tiny", "replicas": "2", "routing": "pow2", "slots": "16", "prefix-caching": "false"}
    )
    from_yaml = RayServeArgs.from_dict(
        {
            "replicas": 2,
            "routing": "pow2",
            "engine": {"model": "tiny", "n_slots": 16, "prefix_caching": False},
        }
    )
    assert from_strings == from_yaml
    assert from_strings.engine == {"model": "tiny", "n_slots": 16, "prefix_caching": False}
    assert from_strings.engine_argv() == ["--model", "tiny", "--slots", "16", "--no-prefix-caching"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicas": 0}, "replicas: must be at least 1"),
        ({"replicas": "two"}, "replicas: cannot read 'two'"),
        ({"min_replicas": 1}, "give both"),
        ({"min_replicas": 3, "max_replicas": 2}, "min_replicas/max_replicas"),
        ({"routing": "random"}, "routing: one of prefix, pow2"),
        ({"slots": "many"}, "slots: expected int"),
        ({"device": "tpu"}, "device: one of"),
        ({"frobnicate": 1}, "unknown option 'frobnicate'"),
        ({"bind": "tcp://0.0.0.0:5555"}, "set by each replica"),
        ({"engine": ["--slots", "4"]}, "expected a mapping"),
        ({"health_check_period_s": 0}, "must be positive"),
    ],
)
def test_bad_values_are_named(values, message):
    with pytest.raises(ArgsError, match=message):
        RayServeArgs.from_dict(values)


def test_the_command_line_passes_only_what_differs_from_serves_defaults(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    args = args_from_cli(
        cli("--model", "m.gguf", "--slots", "64", "--max-queue-ms", "500", "--replicas", "3")
    )
    # the model's path is made absolute: the replica's engine starts in Ray's folder
    assert args.engine == {"model": str(model), "n_slots": 64, "max_queue_ms": 500.0}
    assert args.replicas == 3 and args.routing == "prefix" and not args.autoscaling
    scaled = args_from_cli(
        cli("--min-replicas", "1", "--max-replicas", "4", "--target-ongoing-requests", "8")
    )
    assert scaled.autoscaling and (scaled.min_replicas, scaled.max_replicas) == (1, 4)
    assert scaled.engine == {"model": "tiny"}


def test_ray_is_imported_by_the_ray_serve_package_alone():
    """Statically: no module outside hostctl/ray_serve/ (and the bench's own Ray run) names ray;
    dynamically: the CLI, the gateway and the ray-serve command's parsing load no ray."""
    users = []
    for path in [*ROOT.glob("ipc/**/*.py"), *ROOT.glob("hostctl/**/*.py"), *ROOT.glob("device/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            if any(n.split(".")[0] in ("ray", "starlette") for n in names):
                users.append(str(path.relative_to(ROOT)))
    assert users and all(u.startswith("hostctl/ray_serve/") for u in users), sorted(set(users))
    code = (
        "import sys; import ringleader.hostctl.cli as c, ringleader.hostctl.gateway.app, "
        "ringleader.hostctl.commands.ray_serve as r; r.args_from_cli(c.build_parser().parse_args(['ray-serve'])); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'starlette')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
