"""The engine's flags on the command line, derived from EngineConfig's `flag` fields (their
names, types, Literal choices, defaults and help), and the EngineConfig arguments a parsed
command line makes: shared by the `ember` commands (server/cli.py) and `ember tune`
(bench/tune.py), so neither imports the other. A new engine flag is a new `flag` field."""

from __future__ import annotations

import argparse
from typing import Any

from ember.config import TUNING_KNOBS, EngineConfig, flag_fields, flag_types

# flags the loop below does not make: the model (a positional argument, or --model) and the
# runner (--task is its older name, so its own default must stay None)
_OWN_PARSING = ("model", "runner")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags under vLLM's names; defaults come from EngineConfig."""
    fields = {f.name: f for f in flag_fields()}
    parser.add_argument("model", nargs="?", default=None, help=fields["model"].metadata["help"])
    parser.add_argument("--model", "--model-path", dest="model_flag", default=None, metavar="MODEL",
                        help="the model, as the positional argument (give one or the other, or the same in both; "
                             "--model-path is SGLang's name)")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="flags from a YAML file (keys: flag names, with dashes or underscores); flags given "
                             "on the command line override it")
    parser.set_defaults(config_parser=parser)
    types = flag_types()
    for name, f in fields.items():
        if name in _OWN_PARSING:
            continue
        kind, choices, _ = types[name]
        meta = f.metadata
        options = dict(dest=name, default=f.default, help=meta["help"])
        if meta["metavar"]:
            options["metavar"] = meta["metavar"]
        if meta["action"]:
            options["action"] = meta["action"]
        elif kind is bool:  # an off-by-default switch, else --x / --no-x
            options["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
        elif choices:
            options["choices"] = choices
        elif kind in (int, float):
            options["type"] = kind
        parser.add_argument(*(meta["flags"] or ("--" + name.replace("_", "-"),)), **options)
    parser.add_argument("--runner", default=None, choices=types["runner"][1], help=fields["runner"].metadata["help"])
    parser.add_argument("--task", default=None, choices=["generate", "embed", "classify", "score"],
                        help="vLLM's older name: --task embed, classify or score is --runner pooling")


def engine_args(ns: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's arguments from a namespace that add_engine_args parsed."""
    from_file = getattr(ns, "from_config_file", {})
    sources = {n: "config file" if n in from_file else "flag" for n in TUNING_KNOBS}
    own = {"model": model_arg(ns), "runner": runner_arg(ns), "setting_sources": sources}
    return own | {f.name: getattr(ns, f.name) for f in flag_fields() if f.name not in _OWN_PARSING}


def runner_arg(ns: argparse.Namespace) -> str:
    """--runner, or --task (its older name: embed, classify and score are pooling); ValueError if they disagree."""
    from_task = {"embed": "pooling", "classify": "pooling", "score": "pooling", "generate": "generate",
                 None: None}[ns.task]
    if ns.runner is not None and from_task is not None and ns.runner != from_task:
        raise ValueError(f"--task {ns.task} means --runner {from_task}, but --runner {ns.runner} is given: give one")
    return ns.runner or from_task or EngineConfig.runner


def model_arg(ns: argparse.Namespace) -> str | None:
    """The model: the positional argument or --model (ValueError if they differ)."""
    if ns.model is not None and ns.model_flag is not None and ns.model != ns.model_flag:
        raise ValueError(f"the model is given twice, as {ns.model!r} and --model {ns.model_flag!r}: give one")
    return ns.model if ns.model is not None else ns.model_flag
