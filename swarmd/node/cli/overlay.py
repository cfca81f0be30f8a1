"""Option defaults from a TOML file and SWARMD_* variables, below the command line.

They become the parsers' defaults rather than a second parse, so argparse still decides what
the command line overrides, and every value goes through the option's own type: a bad one
fails as clearly as on the command line.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swarmd.node.cli.options import EXIT_USAGE, CliError


def apply_overlays(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Sets defaults from the TOML file and SWARMD_* variables, below the command line."""
    file_values = _read_config(argv)
    for p in _subparsers(parser):
        command = p.prog.split()[-1]
        table = file_values.get(command, {})
        overlay: dict[str, Any] = {}
        for action in p._actions:
            if not action.option_strings or action.dest in ("help", "config"):
                continue
            key = action.dest.replace("_", "-")
            if isinstance(table, dict) and key in table:
                overlay[action.dest] = _from_file(action, table[key])
            elif key in file_values and not isinstance(file_values[key], dict):
                overlay[action.dest] = _from_file(action, file_values[key])
            env = os.environ.get("SWARMD_" + action.dest.upper())
            if env is not None:
                overlay[action.dest] = _convert(action, env)
        if overlay:
            p.set_defaults(**overlay)


def _read_config(argv: Sequence[str]) -> dict[str, Any]:
    """The --config (or SWARMD_CONFIG) file's values; read before the real parse, which
    needs them as defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path)
    known, _ = pre.parse_known_args(argv)
    config_path = known.config or (
        Path(os.environ["SWARMD_CONFIG"]) if os.environ.get("SWARMD_CONFIG") else None
    )
    if config_path is None:
        return {}
    try:
        return tomllib.loads(config_path.read_text())
    except FileNotFoundError:
        raise CliError(f"config file {config_path} does not exist", EXIT_USAGE) from None
    except tomllib.TOMLDecodeError as exc:
        raise CliError(f"config file {config_path} is not valid TOML: {exc}", EXIT_USAGE) from None


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found.extend(_subparsers(child))
    return found


def _convert(action: argparse.Action, text: str) -> Any:
    if isinstance(action, argparse._AppendAction):  # a repeatable option: one value here
        return [_convert_one(action, text)]
    return _convert_one(action, text)


def _convert_one(action: argparse.Action, text: str) -> Any:
    if action.nargs == 0:  # a flag
        return text.strip().lower() in ("1", "true", "yes", "on")
    if action.type is None:
        return text
    convert: Callable[[str], Any] = action.type  # type: ignore[assignment]
    try:
        return convert(text)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise CliError(f"bad value for {action.option_strings[0]}: {exc}", EXIT_USAGE) from None


def _from_file(action: argparse.Action, value: Any) -> Any:
    if isinstance(action, argparse._AppendAction) and isinstance(value, list):
        return [_convert_one(action, v if isinstance(v, str) else str(v)) for v in value]
    return _convert(action, value if isinstance(value, str) else str(value))
