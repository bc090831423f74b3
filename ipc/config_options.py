"""Config options declared once, on the field they set.

A config dataclass's field made with `option(default, flag=..., help=...)` carries its
command-line flag, help, type, choices and metavar beside its default (`ConfigOption`, the
field's metadata).  Everything else is generated from the declarations, as SamplingParams'
fields generate `ringleader generate`'s options:

- the command lines that take a config (`serve` takes EngineConfig's and ServerConfig's,
  `ray-serve` RayServeArgs' too): hostctl/commands/serve_flags.py adds one argparse option per
  declaration, in the fields' order, and builds the config back from the parsed args;
- a serve command line from field values (`ConfigOption.argv`): what the bench and each Ray Serve
  replica start their servers with;
- Ray Serve's reading of config-file and `serve run` values by field or flag name.

A field without `option()` has no flag: a program that embeds the engine or the server sets it.
Adding an option: declare it on its config's field; the flag, its help and its parsing follow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# the key of a field's metadata under which its declaration is kept
_METADATA_KEY = "option"


@dataclass(frozen=True)
class ConfigOption:
    """One option's declaration: the metadata of the config field it sets."""

    flag: str  # on the command line (--slots); the parsed args hold it under the field's name
    help: str  # argparse's help: %(default)s is the default, %% a percent sign
    # argparse's type (int, float; None: the text as it is); bool: a --flag/--no-flag switch
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None  # None: the flag in capitals (BYTES for --bytes), unless choices or a switch
    name: str = ""  # the field's name, filled in by options_of
    default: Any = None  # the field's default, filled in by options_of

    @property
    def is_switch(self) -> bool:
        return self.type is bool

    @property
    def shown_metavar(self) -> str | None:
        """The placeholder of the value in --help (none for a switch, argparse's for choices)."""
        if self.metavar is not None or self.is_switch or self.choices is not None:
            return self.metavar
        return self.flag.removeprefix("--").upper().replace("-", "_")

    def argv(self, value: Any) -> list[str]:
        """This option set to `value` on a command line: a switch as --x or --no-x; none for None
        (the command's default)."""
        if value is None:
            return []
        if isinstance(value, bool):
            return [self.flag if value else "--no-" + self.flag.removeprefix("--")]
        return [self.flag, str(value)]


def option(
    default: Any,
    *,
    flag: str,
    help: str,
    type: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
) -> Any:
    """A config field with this default that the command line sets with `flag` (the other
    arguments: ConfigOption's)."""
    declared = ConfigOption(flag=flag, help=help, type=type, choices=choices, metavar=metavar)
    return dataclasses.field(default=default, metadata={_METADATA_KEY: declared})


def options_of(config: type) -> tuple[ConfigOption, ...]:
    """The options a config dataclass declares, in its fields' order, each with its field's name
    and default."""
    return tuple(
        dataclasses.replace(field.metadata[_METADATA_KEY], name=field.name, default=field.default)
        for field in dataclasses.fields(config)
        if _METADATA_KEY in field.metadata
    )


def options_by_name(*configs: type) -> dict[str, ConfigOption]:
    """The options of several configs by field name (the configs' field names are distinct)."""
    out: dict[str, ConfigOption] = {}
    for config in configs:
        for declared in options_of(config):
            if declared.name in out:
                raise ValueError(f"{declared.name} is declared by two configs")
            out[declared.name] = declared
    return out


def named(config: type, name: str) -> str:
    """How a message names the field `name` of `config`: by its flag, with the field's name after
    it ("--page-size (page_size)"), where it has one; else by the field's name alone (a field that
    only a program embedding the config sets)."""
    flags = {declared.name: declared.flag for declared in options_of(config)}
    return f"{flags[name]} ({name})" if name in flags else name


def command_line(options: Mapping[str, ConfigOption], values: Mapping[str, Any]) -> list[str]:
    """The flags that set these fields (by name, each in `options`) to these values; a None
    value is left to the command's default."""
    return [word for name, value in values.items() for word in options[name].argv(value)]
