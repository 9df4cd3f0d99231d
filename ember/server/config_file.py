"""`--config FILE.yaml`: any command-line flag from a YAML file, as vLLM reads one.

Keys are the flags' names, with dashes or underscores (`max-model-len: 512` or
`max_model_len: 512`; `model: path` for the positional model). The file's values become
the parser's defaults, so a flag given on the command line overrides the file. A key
that names no flag of the command is an error that names it; values are checked as the
flag's own type and choices check them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

_BOOLEAN_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """Set `parser`'s defaults from the YAML file at `path` (returned, by dest); a bad file,
    key or value exits through `parser.error`, naming it."""
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"--config {path}: {e}")
    if values is None:
        return {}
    if not isinstance(values, dict):
        parser.error(f"--config {path}: the file must hold a mapping of flag names to values")
    defaults: dict[str, Any] = {}
    for key, value in values.items():
        action = _action_for(parser, str(key))
        if action is None:
            parser.error(f"--config {path}: unknown key {key!r}: it names no flag of this command")
        defaults[action.dest] = _value(parser, action, key, value, path)
    parser.set_defaults(**defaults)
    return defaults


def _action_for(parser: argparse.ArgumentParser, key: str) -> argparse.Action | None:
    """The flag `key` names; a positional argument first (`model: ...` is the positional model)."""
    positional = next((a for a in parser._actions if not a.option_strings and a.dest == key.replace("-", "_")), None)
    flag = "--" + key.replace("_", "-")
    if positional is None and flag in parser._option_string_actions and flag not in ("--config", "--help"):
        return parser._option_string_actions[flag]
    return positional


def _value(parser: argparse.ArgumentParser, action: argparse.Action, key: str, value: Any, path: str) -> Any:
    where = f"--config {path}: {key}"
    if isinstance(action, _BOOLEAN_ACTIONS):
        if not isinstance(value, bool):
            parser.error(f"{where}: expected true or false, got {value!r}")
        return not value if isinstance(action, argparse._StoreFalseAction) else value
    many = action.nargs in ("+", "*") or isinstance(action, argparse._ExtendAction)
    items = value if many and isinstance(value, list) else [value]
    converted = []
    for item in items:
        if action.type is not None and (isinstance(item, str) or action.type in (int, float)):
            try:
                item = action.type(str(item))
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                parser.error(f"{where}: invalid {getattr(action.type, '__name__', 'value')} value {item!r}")
        if action.choices is not None and item not in action.choices:
            parser.error(f"{where}: invalid choice {item!r} (choose from {', '.join(map(str, action.choices))})")
        converted.append(item)
    return converted if many else converted[0]
