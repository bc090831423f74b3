"""The command-line options of config fields, generated from their declarations: each field of
EngineConfig (device/engine_config.py), ServerConfig (hostctl/serving/config.py) or RayServeArgs
(hostctl/ray_serve/args.py) made with option() (ringleader.ipc.config_options) is one argparse
option, with its flag, help, type, choices and metavar from there and the field's default; None
there means "per device", which the config's resolved() fills in and the help says.  The serve
and ray-serve commands add these options; the bench writes them for the servers it starts
(serve_flags)."""

from __future__ import annotations

import argparse
from typing import Any, TypeVar

from ringleader.device.engine_config import EngineConfig
from ringleader.hostctl.serving.config import ServerConfig
from ringleader.ipc.config_options import ConfigOption, command_line, options_by_name

Config = TypeVar("Config")

ENGINE_FLAGS: dict[str, ConfigOption] = options_by_name(EngineConfig)
SERVER_FLAGS: dict[str, ConfigOption] = options_by_name(ServerConfig)
SERVE_FLAGS: dict[str, ConfigOption] = {**ENGINE_FLAGS, **SERVER_FLAGS}


def add_config_options(p: argparse.ArgumentParser, config: type) -> None:
    """One option per field of `config` declared with option(), in the fields' order, on args
    under the field's name, defaulting to the field's default."""
    for declared in options_by_name(config).values():
        p.add_argument(
            declared.flag,
            dest=declared.name,
            default=declared.default,
            help=declared.help,
            **_argparse_options(declared),
        )


def _argparse_options(declared: ConfigOption) -> dict[str, Any]:
    if declared.is_switch:  # --x / --no-x
        return {"action": argparse.BooleanOptionalAction}
    options: dict[str, Any] = {"metavar": declared.shown_metavar}
    if declared.type is not None:
        options["type"] = declared.type
    if declared.choices is not None:
        options["choices"] = declared.choices
    return options


def config_from_args(args: argparse.Namespace, config: type[Config]) -> Config:
    """The `config` of the parsed options that add_config_options added."""
    return config(**{name: getattr(args, name) for name in options_by_name(config)})


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The EngineConfig fields `serve` takes, on args under their field names."""
    add_config_options(p, EngineConfig)


def add_server_options(p: argparse.ArgumentParser) -> None:
    """The ServerConfig fields `serve` takes, on args under their field names."""
    add_config_options(p, ServerConfig)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(args, EngineConfig)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return config_from_args(args, ServerConfig)


def serve_flags(**fields: object) -> list[str]:
    """`ringleader serve` flags for EngineConfig and ServerConfig fields given by name (None: the
    server's default)."""
    return command_line(SERVE_FLAGS, fields)
