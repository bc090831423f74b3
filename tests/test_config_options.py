"""Options declared once, on their config's field (ringleader.ipc.config_options): the command
lines of `serve` and `ray-serve` are generated from EngineConfig's, ServerConfig's and
RayServeArgs' declarations, each option field is exactly one flag with the field's default, and
the flags written back from values (the bench's servers, each Ray Serve replica) parse to those
values.  So an option added to a config's field is on the command line, and nowhere else needs
a word of it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ringleader.device.engine_config import EngineConfig
from ringleader.hostctl.cli import build_parser
from ringleader.hostctl.commands import serve_flags
from ringleader.hostctl.ray_serve import args as ray_serve_args
from ringleader.hostctl.ray_serve.args import RayServeArgs
from ringleader.hostctl.serving.config import ServerConfig
from ringleader.ipc.config_options import ConfigOption, command_line, options_of

ROOT = Path(__file__).resolve().parents[1]
# (command, the configs whose option fields it takes)
COMMANDS = [
    ("serve", (EngineConfig, ServerConfig)),
    ("ray-serve", (EngineConfig, ServerConfig, RayServeArgs)),
]
CONFIGS = (EngineConfig, ServerConfig, RayServeArgs)


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _flags_of(declared: ConfigOption) -> list[str]:
    """The option strings a declaration makes: a switch has its --no- form too."""
    no = ["--no-" + declared.flag.removeprefix("--")] if declared.is_switch else []
    return [declared.flag, *no]


@pytest.mark.parametrize(("command", "configs"), COMMANDS)
def test_every_option_field_is_exactly_one_flag_with_the_fields_default(command, configs):
    parser = _subparser(command)
    for config in configs:
        for declared in options_of(config):
            actions = [a for a in parser._actions if a.dest == declared.name]
            assert len(actions) == 1, (command, declared.name, [a.option_strings for a in actions])
            (action,) = actions
            assert action.option_strings == _flags_of(declared), declared.name
            assert action.default == getattr(config(), declared.name), declared.name
            assert action.help == declared.help and action.choices == declared.choices


@pytest.mark.parametrize("config", [EngineConfig, ServerConfig])
def test_a_field_without_option_has_no_flag(config):
    """sq_size, max_frame_bytes...: set by a program that embeds the engine or the server."""
    dests = {a.dest for a in _subparser("serve")._actions}
    declared = {d.name for d in options_of(config)}
    undeclared = {f.name for f in dataclasses.fields(config)} - declared
    assert undeclared and not undeclared & dests, undeclared & dests


@pytest.mark.parametrize(("command", "configs"), COMMANDS)
def test_no_options_parse_to_the_configs_defaults(command, configs):
    args = build_parser().parse_args([command])
    for config in configs:
        assert serve_flags.config_from_args(args, config) == config()


def _another_value(declared: ConfigOption):
    """A value of the option's kind other than its default."""
    if declared.is_switch:
        return not declared.default
    if declared.choices is not None:
        return next(c for c in reversed(declared.choices) if c != declared.default)
    if declared.type is int:
        return 7 if declared.default != 7 else 8
    if declared.type is float:
        return 0.25
    assert declared.type is None, (declared.name, declared.type)
    return "some-text"


@pytest.mark.parametrize("config", CONFIGS)
def test_flags_written_from_values_parse_back_to_them(config):
    """command_line() is how the bench and each Ray Serve replica start a server: what it writes
    for a field, the parser reads back as that value (a switch both ways)."""
    command = "ray-serve" if config is RayServeArgs else "serve"
    options = {d.name: d for d in options_of(config)}
    for name, declared in options.items():
        for value in (_another_value(declared), *([declared.default] if declared.is_switch else [])):
            argv = command_line(options, {name: value})
            assert getattr(build_parser().parse_args([command, *argv]), name) == value, (name, argv)
    assert command_line(options, dict.fromkeys(options)) == []  # None: the command's default


def test_declarations_are_well_formed():
    for config in CONFIGS:
        for declared in options_of(config):
            assert declared.flag.startswith("--") and declared.help.strip(), declared.name
            if declared.is_switch:
                assert isinstance(declared.default, bool), declared.name
            if declared.choices is not None and declared.default is not None:
                assert declared.default in declared.choices, declared.name
    flags = [declared.flag for config in CONFIGS for declared in options_of(config)]
    assert len(flags) == len(set(flags))


def test_ray_serve_passes_serves_own_options():
    """Each replica's engine takes exactly `ringleader serve`'s config options, as serve's
    command line declares them."""
    assert ray_serve_args.SERVE_OPTIONS == serve_flags.SERVE_FLAGS
    engine = RayServeArgs.from_dict({"slots": "16", "prefix-caching": "false", "max_queue_ms": 5})
    assert engine.engine_argv() == serve_flags.serve_flags(n_slots=16, prefix_caching=False, max_queue_ms=5.0)


def test_the_ray_serve_library_reads_the_configs_not_the_command_line_and_no_torch():
    code = (
        "import json, sys; import ringleader.hostctl.ray_serve.args; print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert {"ringleader.device.engine_config", "ringleader.hostctl.serving.config"} <= loaded
    assert not {
        m for m in loaded if m.startswith("ringleader.hostctl.commands") or m.split(".")[0] == "torch"
    }
