"""The research grids' command lines: one dataclass each, parsed with the entry points' conventions
(:mod:`shift_lightning.recipes.cli`), and the command that reproduces a run (recorded in every result file)."""

from __future__ import annotations

from typing import Callable

from shift_lightning.recipes.cli import dataclass_parser, entry, parse_args, setup_logging


def rerun_command(module: str, cfg, always: tuple[str, ...] = ("model",),
                  skip: tuple[str, ...] = ("out", "render_only")) -> str:
    """The command that reproduces ``cfg``: the options that differ from the defaults (plus
    ``always``); where the files went is not part of the result. A nested settings dataclass (a recipe's
    ``grid``) gives its own differing options as ``--grid.<option>`` (its ``out`` too: there it is where
    the recipe reads the grid's rows). Values are shell-quoted (a list is JSON in single quotes), so the command
    pastes into a shell and parses back to the same settings."""
    import dataclasses
    import json
    import shlex

    def options(obj, default, prefix: str, skipped: tuple[str, ...]) -> list[str]:
        out = []
        for f in dataclasses.fields(obj):
            v, d = getattr(obj, f.name), getattr(default, f.name)
            if f.name in skipped:
                continue
            if dataclasses.is_dataclass(v) and not isinstance(v, type):
                out += options(v, d if type(d) is type(v) else type(v)(), f"{prefix}{f.name}.", ("render_only", "fill"))
            elif v != d or (not prefix and f.name in always):
                out.append(f"--{prefix}{f.name} {shlex.quote(v if isinstance(v, str) else json.dumps(v))}")
        return out

    return " ".join([f"python -m {module}", *options(cfg, type(cfg)(), "", skip)])


def dataclass_main(cfg_cls, run: Callable, description: str, argv: list[str] | None = None):
    """Parse ``cfg_cls`` from the command line (with the entry points' conventions) and ``run`` it."""
    import dataclasses

    def parse_cfg(args):
        p = dataclass_parser(cfg_cls, description)
        init = p.instantiate_classes(parse_args(p, args))
        return cfg_cls(**{f.name: init[f.name] for f in dataclasses.fields(cfg_cls)})

    def go(cfg):
        setup_logging()
        return run(cfg)

    return entry(go, argv, parse_cfg)
