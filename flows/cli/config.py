"""``aepo config``: inspect experiment configs (``config show``: the resolved config as YAML)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.inputs import SetOpt, load_checked_config

config_app = typer.Typer(help="Inspect experiment configs.", no_args_is_help=True, rich_markup_mode=None)


@config_app.command("show")
def config_show(config: Annotated[Path | None, typer.Option("--config", "-c", help="Experiment config YAML "
                                                            "(default: the built-in defaults).")] = None,
                set_: SetOpt = None,
                describe: Annotated[bool, typer.Option("--describe", help="Each key preceded by its description "
                                                       "(a comment; the output still loads as the config).")
                                    ] = False) -> None:
    """Print the resolved config (defaults + file + overrides) as YAML.

    \b
    Examples:
      aepo config show -c configs/demo.yaml --set rollout.k=8 --describe"""
    cfg = load_checked_config(config, set_)
    typer.echo(cfg.to_yaml(describe=describe), nl=False)
