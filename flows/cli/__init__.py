"""The ``aepo`` command line: train, evaluate, sweep, serve, and look at what runs left behind.

All state lives under one runs directory (``--runs-dir``, else ``$AEPO_RUNS_DIR``, else the config's
``storage.runs_dir``, default ``./runs``)::

    runs/mlflow.db  runs/mlartifacts/   MLflow tracking store and artifacts
    runs/prefect/                       PREFECT_HOME (the ephemeral API's SQLite database, results, profiles)
    runs/trajectories/  runs/nodes/     Parquet trajectory store: one table each (a leaf a row, a node a row)
    runs/checkpoints/<run name>/<run id>/   checkpoints, one folder per MLflow run (storage.checkpoints_uri:
                                        elsewhere, s3:// too)
    runs/eval/<run name>/<dataset>.parquet   per-question evaluation results (storage.evaluations_uri: elsewhere)
    runs/cache/checkpoints/             verified local copies of remote checkpoints, staging of remote saves
    runs/sweeps/<sweep name>/           sweep comparison tables and plot
    runs/compare/<sweep name>/          aepo compare's figures

This package assembles the app from one module per command (``train``, ``evaluate``, ``sweep``, ``compare``,
``serve``, ``runs``, ``trajectories``, ``replay``, ``ui``, ``config``); what they share is in
:mod:`~flows.cli.inputs` (options, the runs dir, checks before anything is created), :mod:`~flows.cli.environment`
(Prefect's home, a quiet terminal, SIGTERM) and :mod:`~flows.cli.render` (tables, the progress bar, a user error's
line and exit status).

Prefect reads its settings when it is imported, so no command module imports a flow (hence no Prefect) at the top:
each command validates its inputs first — a bad config exits with status 2 and a one-line message before
anything is created — then sets ``PREFECT_HOME`` and the ephemeral-server settings, then imports its flow.
"""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli import compare, config, evaluate, replay, runs, serve, sweep, train, trajectories, ui
from flows.cli.environment import set_verbosity

app = typer.Typer(name="aepo", help="Agentic entropy-balanced policy optimization: experiments on Prefect + MLflow.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None)
app.add_typer(config.config_app, name="config")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"aepo {version('aepo')}")
        raise typer.Exit()


@app.callback()
def main_options(
    verbose: Annotated[int, typer.Option("--verbose", "-v", count=True,
                                         help="Library log lines on the terminal (Prefect task states, MLflow INFO, "
                                              "DeepSpeed); with it, log lines replace the progress bar.")] = 0,
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Agentic entropy-balanced policy optimization: experiments on Prefect + MLflow."""
    set_verbosity(verbose)


app.command("train")(train.train)
app.command("eval")(evaluate.eval_)
app.command("sweep")(sweep.sweep_cmd)
app.command("compare")(compare.compare_cmd)
app.command("serve")(serve.serve)
app.command("runs")(runs.runs)
app.command("trajectories")(trajectories.trajectories)
app.command("replay")(replay.replay_cmd)
app.command("ui")(ui.ui)


def main() -> None:  # pragma: no cover - console entry point alternative
    app()
