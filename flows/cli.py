"""The ``aepo`` command line: train, evaluate, sweep, serve, and look at what runs left behind.

All state lives under one runs directory (``--runs-dir``, else ``$AEPO_RUNS_DIR``, else the config's
``storage.runs_dir``, default ``./runs``)::

    runs/mlflow.db  runs/mlartifacts/   MLflow tracking store and artifacts
    runs/prefect/                       PREFECT_HOME (the ephemeral API's SQLite database, results, profiles)
    runs/trajectories/                  Parquet trajectory store (trajectories/ and nodes/ tables)
    runs/checkpoints/<run name>/<run id>/   checkpoints, one folder per MLflow run (storage.checkpoints_uri:
                                        elsewhere, s3:// too)
    runs/eval/<run name>/<dataset>.parquet   per-question evaluation results (storage.evaluations_uri: elsewhere)
    runs/cache/checkpoints/             verified local copies of remote checkpoints, staging of remote saves
    runs/sweeps/<sweep name>/           sweep comparison tables and plot

Prefect reads its settings when it is imported, so this module imports no flow (hence no Prefect) at the top:
each command validates its inputs first — a bad config exits with status 2 and a one-line message before
anything is created — then sets ``PREFECT_HOME`` and the ephemeral-server settings, then imports its flow.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import yaml
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from aepo_core.config import RUNS_DIR_ENV, ExperimentConfig
from aepo_core.config_keys import ConfigError
from aepo_core.overrides import build_config
from tasks.progress import Progress as ProgressEvent
from tasks.progress import progress_of

log = logging.getLogger(__name__)

RUNS_ENV = RUNS_DIR_ENV
DEFAULT_RUNS_DIR = "runs"
EXIT_USAGE = 2
CLI_TAGS = ("aepo", "cli")
"""Prefect tags of the flow runs the CLI starts (deployments' runs carry ``aepo`` alone)."""
PREFECT_ENV = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "DO_NOT_TRACK": "1"}  # the client's telemetry banner too ("Prefect collects anonymous usage data")
QUIET_ENV = {
    # Prefect's console: warnings and errors only ("Finished in state Completed()" per task, the temporary server's
    # start/stop); the progress bar says where the run is, and the flow/task logs still reach the Prefect UI.
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    # MLflow's INFO lines: table creation on a new store, system-metrics monitor start/stop.
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    # transformers' "Loading weights" bar at every model load (transformers reads it from huggingface_hub at import).
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
"""Settings of a quiet terminal (the default; ``-v`` leaves every library at its own level). Set before Prefect and
MLflow are imported, which read them once."""

app = typer.Typer(name="aepo", help="Agentic entropy-balanced policy optimization: experiments on Prefect + MLflow.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
_verbosity = 0
"""``-v`` count of this invocation (:func:`main_options`)."""
config_app = typer.Typer(help="Inspect experiment configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="Experiment config YAML.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="Dotted override key=value (repeatable).")]
RunsOpt = Annotated[str | None, typer.Option("--runs-dir", envvar=RUNS_ENV, show_envvar=True,
                                             help="Where all state goes (default: the config's storage.runs_dir, "
                                                  "./runs).")]
TrackingOpt = Annotated[str | None, typer.Option("--tracking-uri", help="MLflow tracking URI, e.g. an `mlflow "
                                                 "server` (http://host:5000, `aepo ui`); default: the runs dir's "
                                                 "SQLite store.")]


# ---------------------------------------------------------------------------------------------- plumbing


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
    global _verbosity
    _verbosity = verbose


def _out() -> Console:
    return Console()


def _err() -> Console:
    return Console(stderr=True)


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """One line on stderr, then exit (2: bad input, nothing was created)."""
    _err().print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def resolve_runs_dir(option: str | None, cfg: ExperimentConfig | None = None) -> Path:
    """--runs-dir / $AEPO_RUNS_DIR (typer fills ``option`` from both), else the config's, else ./runs."""
    raw = option or (cfg.storage.runs_dir if cfg is not None else DEFAULT_RUNS_DIR)
    return Path(raw).expanduser().resolve()


def prepare_environment(runs: Path, rank: int = 0) -> None:
    """Point Prefect at ``<runs>/prefect`` before it is imported (afterwards its settings are fixed: then this
    only warns, e.g. under a test harness that already configured Prefect).

    A data-parallel ``rank`` > 0 (under ``torchrun``/``deepspeed``) runs the same flow against a private ephemeral
    Prefect API in ``<runs>/prefect-rank<N>`` (``PREFECT_API_URL`` dropped): the flow run, its task runs and
    artifacts that people and the Prefect UI see are rank 0's alone.
    """
    home = runs / ("prefect" if rank == 0 else f"prefect-rank{rank}")
    if "prefect" in sys.modules:
        log.debug("prefect already imported: PREFECT_HOME stays %s", os.environ.get("PREFECT_HOME"))
        return
    home.mkdir(parents=True, exist_ok=True)
    os.environ["PREFECT_HOME"] = str(home)
    if rank:
        os.environ.pop("PREFECT_API_URL", None)
    for key, value in quiet_environment(_verbosity).items():
        os.environ.setdefault(key, value)


def quiet_environment(verbosity: int) -> dict[str, str]:
    """The environment a command sets (unless already set) before importing Prefect and MLflow: Prefect's
    temporary-server settings, and at verbosity 0 :data:`QUIET_ENV` plus ``DS_ACCELERATOR=cpu`` on a machine
    without CUDA (DeepSpeed's auto-detection warns "Setting accelerator to CPU" on every import; named, it logs that
    at INFO, below its WARNING level)."""
    env = dict(PREFECT_ENV)
    if verbosity == 0:
        env.update(QUIET_ENV)
        import torch

        if not torch.cuda.is_available():
            env["DS_ACCELERATOR"] = "cpu"
    return env


def start_prefect_api() -> None:
    """Start Prefect's temporary API server (when there is no ``PREFECT_API_URL``) here, in the main thread, so
    that it dies with this process even when SIGKILL leaves no time to stop it (:mod:`infra.prefect_api`)."""
    from infra.prefect_api import start_temporary_api

    start_temporary_api()


def check_datasets(cfg: ExperimentConfig, training: bool = True) -> None:
    """Every dataset the job reads must exist and pass ``data.on_bad_row`` (synthetic ones always do): a bad row is
    the user's error like a bad config, so it fails here, before any Prefect or MLflow run is created.

    Reading the training data here costs one extra pass over it (the flow's cached ``prepare_data`` reads it
    again); the alternative, failing inside the flow, leaves a failed flow run and Prefect's traceback behind.
    ``training=False`` (evaluation): only the evaluation datasets; the training data need not exist there.
    """
    from infra.data.loaders import is_synthetic, load_dataset_rows

    specs = [("data.train", cfg.data.train)] if training else []
    specs += [("data.validation", cfg.data.validation)]
    specs += [(f"eval.datasets[{i}]", d) for i, d in enumerate(cfg.eval.datasets)]
    for key, spec in specs:
        if spec and not is_synthetic(spec):
            try:
                load_dataset_rows(spec, cfg.data.on_bad_row, data_root=cfg.data.data_root)
            except (OSError, ValueError) as exc:  # missing / unreadable file, bad rows, unsupported or corrupt file
                raise ConfigError(f"{key}: {exc}") from None


def load_checked_config(path: Path | None, sets: Sequence[str] | None, training: bool = True) -> ExperimentConfig:
    """The config with overrides, its datasets checked; exits 2 with the problem named."""
    from infra.config_files import load_config

    try:
        cfg = load_config(path, list(sets or []))
        check_datasets(cfg, training)
    except ConfigError as exc:
        fail(str(exc))
    return cfg


def check_storage(cfg: ExperimentConfig, runs: Path, run_name: str) -> None:
    """Every remote store the run writes (``s3://`` trajectories, checkpoints) must be reachable: exits 2 naming the
    location."""
    from infra.fs import StorageError, probe, storage_options
    from infra.run.runtime import checkpoint_root

    try:
        for uri in (cfg.storage.trajectories_uri, checkpoint_root(cfg, runs, run_name)):
            if uri:
                probe(uri, storage_options(cfg.storage, uri))
    except StorageError as exc:
        fail(str(exc))


def check_resume(cfg: ExperimentConfig, runs: Path, run_name: str) -> None:
    """``--resume`` needs a run of that name in the tracking store (then it continues that run, from its newest
    complete checkpoint or, without one, from step 0): exits 2 when there is none, local and remote checkpoints
    alike, before anything is created. Rank 0 alone asks (the others follow its choice)."""
    from infra.ranks import Ranks
    from infra.run.trainer import NothingToResumeError, nothing_to_resume, run_to_resume
    from infra.tracking.run import Tracker, resolve_tracking

    if not Ranks.current().is_main:
        return
    uri, _ = resolve_tracking(cfg, runs)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        fail(f"--resume: {nothing_to_resume(run_name, cfg.tracking.experiment, uri)}")  # not even a store yet
    try:
        run_to_resume(Tracker.from_config(cfg, runs), cfg, run_name)
    except NothingToResumeError as exc:
        fail(f"--resume: {exc}")


def _with_runs_dir(cfg: ExperimentConfig, runs: Path) -> ExperimentConfig:
    """Record the runs dir actually used in the config (so the logged config re-runs the same way)."""
    return build_config(cfg.to_dict(), {"storage.runs_dir": str(runs)})


class _ProgressHandler(logging.Handler):
    """Feeds the structured progress events on the flows' log records (:mod:`tasks.progress`) to a callback; the
    message text is never read, so the flows stay unaware of the CLI and a reworded log line breaks nothing."""

    def __init__(self, on_event: Callable[[ProgressEvent], None]) -> None:
        super().__init__(logging.INFO)
        self.on_event = on_event

    def emit(self, record: logging.LogRecord) -> None:
        event = progress_of(record)
        if event is not None:
            self.on_event(event)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While inside (main thread only), SIGTERM raises SystemExit: ``finally`` blocks run, a flow and its MLflow
    run end as failed, and Prefect's temporary API server is stopped instead of being left orphaned.

    The exit is re-raised on the way out if something in between swallowed it (seen once: a SIGTERM that landed
    while Prefect's engine was handling a task's result let the command exit 0), so a stopped run never exits as
    a success."""
    received: list[int] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        received.append(signum)
        raise SystemExit(128 + signum)

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if received:
        raise SystemExit(128 + received[0])


@contextmanager
def flow_progress(label: str, total: int | None,
                  on_event: Callable[[Progress, Any, ProgressEvent], None]) -> Iterator[Progress]:
    """A rich progress bar fed by the progress events of the Prefect run loggers while a flow runs
    (``on_event(bar, task, event)``).

    SIGTERM (``kill``, a scheduler's stop) unwinds like Ctrl-C while it runs (:func:`sigterm_unwinds`). The flow
    run (and every run it starts) is tagged :data:`CLI_TAGS`, so the Prefect UI tells runs started from a shell
    from those of deployments and schedules.
    """
    from prefect import tags

    # -v: the libraries' log lines instead of a bar (their console handlers write to the stderr they saw at import,
    # past rich's redirection, and would tear a live bar).
    progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=_err(), transient=False, disable=_verbosity > 0)
    task = progress.add_task(label, total=total)
    handler = _ProgressHandler(lambda event: on_event(progress, task, event))
    loggers = [logging.getLogger("prefect.task_runs"), logging.getLogger("prefect.flow_runs")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with sigterm_unwinds(), progress, tags(*CLI_TAGS):
            yield progress
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def print_numerics(cfg: ExperimentConfig) -> None:
    """The dtypes the run will compute in and the machine they were chosen for, once, on stderr."""
    from infra.numerics import numerics_for

    _err().print(escape(numerics_for(cfg).describe()), soft_wrap=True, highlight=False)


def _train_progress(bar: Progress, task: Any, event: ProgressEvent) -> None:
    if event.stage == "start":
        bar.update(task, total=event.total, completed=event.done, description=f"{event.name}: training")
    elif event.stage == "rollout":
        bar.update(task, description=f"step {event.done}: update")
    elif event.stage == "update":
        bar.update(task, completed=event.done, description=f"step {event.done} done")
    elif event.stage == "evaluate":
        bar.update(task, description=f"evaluated {event.name} ({event.label})")


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return "–" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def _eval_table(title: str, summaries: dict[str, dict[str, float]], k: int,
                extra: dict[str, float] | None = None, stages: dict[str, dict[str, dict[str, float]]] | None = None,
                ) -> Table:
    """One row per dataset (or per stage × dataset when ``stages`` is given: start, sft, …, final); fits a
    100-column terminal without folding a number (``test_cli``)."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    if stages is not None:
        table.add_column("stage")
    table.add_column("dataset", overflow="fold")
    for col in ("n", "pass@1", "95% CI", f"pass@{k}", "F1", "tools/q", "answered"):
        table.add_column(col, justify="right", no_wrap=True)
    if extra is not None:
        table.add_column("judge", justify="right", no_wrap=True)
    rows = ([(stage, ds, s) for stage, by_ds in stages.items() for ds, s in by_ds.items()] if stages is not None
            else [(None, ds, s) for ds, s in summaries.items()])
    for stage, ds, s in rows:
        row = ([stage] if stage is not None else []) + [ds, _fmt(s.get("questions"), 0), _fmt(s["pass@1"]),
               f"{_fmt(s['pass@1_ci_low'])}–{_fmt(s['pass@1_ci_high'])}",
               _fmt(s.get(f"pass@{k}")), _fmt(s.get("f1")), _fmt(s.get("tool_calls_per_question"), 2),
               _fmt(s.get("answered_rate"), 2)]
        if extra is not None:
            row.append(_fmt(extra.get(ds)))
        table.add_row(*row)
    return table


def _where_table(rows: Sequence[tuple[str, str]]) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    return table


def _ui_hint(tracking_uri: str, runs: Path) -> str:
    if _is_http(tracking_uri):
        return f"browse: {tracking_uri} (the MLflow server); `aepo runs --tracking-uri {tracking_uri}` lists the runs"
    return (f"browse: `mlflow ui --backend-store-uri {tracking_uri}` or `aepo ui --runs-dir {runs}` "
            "(Prefect + MLflow)")


def _is_http(uri: str | None) -> bool:
    return bool(uri) and str(uri).startswith(("http://", "https://"))


def _healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    """``<base_url>/health`` answers 200 (a Prefect API URL or an MLflow server URL)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


def check_tracking_server(uri: str | None) -> None:
    """An ``http(s)://`` tracking URI must answer before anything starts: MLflow's client would otherwise retry
    a refused connection for minutes, and a run would fail half-created. Exits 1 with the URI named."""
    if _is_http(uri) and not _healthy(str(uri), timeout_s=5.0):
        fail(f"no MLflow server answers at {uri} (tracking.tracking_uri / --tracking-uri): start one with "
             "`aepo ui`, or check the host and port", code=1)


def _tracking_uri(runs: Path, tracking_uri: str | None, required: bool = True) -> str | None:
    """The tracking URI a reading command uses: ``--tracking-uri`` (checked: a server must answer), else the runs
    dir's SQLite store, which must exist (``required=False``: None where it does not)."""
    from infra.tracking.run_index import tracking_uri_for

    check_tracking_server(tracking_uri)
    uri = tracking_uri or tracking_uri_for(runs)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        if not required and tracking_uri is None:
            return None
        fail(f"no MLflow store at {uri} (nothing has run with --runs-dir {runs} yet)", code=1)
    return uri


# ---------------------------------------------------------------------------------------------- train


@app.command()
def train(
    config: ConfigOpt,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help=(
        "Continue the newest MLflow run of this name (of those with this model and algorithm: else the newest) in "
        "the same run, from its last complete checkpoint, or from step 0 when it has none. No run of this name: "
        "exits 2, nothing started."))] = False,
    runs_dir: RunsOpt = None,
    run_name: Annotated[str | None, typer.Option("--run-name", help="Run name (default: the config's).")] = None,
    force_resume: Annotated[bool, typer.Option("--force-resume", help="Resume despite config changes.")] = False,
) -> None:
    """Train a policy (cold-start SFT if configured, RL steps, final evaluation), tracked in MLflow."""
    cfg = load_checked_config(config, set_)
    try:
        cfg.check_trainable()
    except ConfigError as exc:
        fail(str(exc))
    check_tracking_server(cfg.tracking.tracking_uri)
    runs = resolve_runs_dir(runs_dir, cfg)
    cfg = _with_runs_dir(cfg, runs)
    check_storage(cfg, runs, cfg.run_name_for(run_name))
    if resume:
        check_resume(cfg, runs, cfg.run_name_for(run_name))
    from infra.ranks import Ranks

    prepare_environment(runs, rank=Ranks.current().rank)
    print_numerics(cfg)
    start_prefect_api()
    from flows.train import train as train_flow
    from tasks.retry import USER_ERRORS

    try:
        with flow_progress(f"{cfg.run_name_for(run_name)}: starting", cfg.train.steps,
                           _train_progress):
            result = train_flow(config=cfg, resume=resume, runs_dir=str(runs), run_name=run_name,
                                force_resume=force_resume)
    except USER_ERRORS as exc:  # the user's input (a bad row, a bad config), found by the flow: as before it
        fail(str(exc))
    except Exception as exc:
        fail(f"training failed: {exc}", code=1)
    Ranks.current().finish()  # under a launcher: every rank ends together, the process group torn down
    out = _out()
    out.print(_eval_table(f"aepo train: {result.run_name} — evaluations ({result.steps} RL steps)",
                          result.final_eval, cfg.eval.pass_k, stages=result.evals))
    for name, by_ds in result.comparisons.items():
        for ds, c in by_ds.items():
            out.print(f"{name.replace('_', ' ')} on {ds}: pass@1 {c['diff']:+.3f} [{c['ci_low']:+.3f}, "
                      f"{c['ci_high']:+.3f}] (paired over {c['questions']:.0f} questions)")
    out.print(_where_table([
        ("MLflow run", f"{result.run_id}  ({result.tracking_uri})"),
        *([("registered policy", result.model_version)] if result.model_version else []),
        ("checkpoints", result.checkpoint_dir),
        ("trajectories", result.trajectories),
        ("runs dir", result.runs_dir),
    ]))
    out.print(escape(_ui_hint(result.tracking_uri, runs)))


# ---------------------------------------------------------------------------------------------- eval


@app.command("eval")
def eval_(
    checkpoint: Annotated[str | None, typer.Option("--checkpoint", help="Checkpoint dir (step-NNNNNN) or a run's "
                                                   "checkpoint root (its newest), local or s3://… (the endpoint from "
                                                   "--config / --set storage.s3_endpoint_url), or a registered "
                                                   "policy models:/<name>/<version> (the registry of --set "
                                                   "tracking.tracking_uri, default the runs dir's); omit for the "
                                                   "configured model.")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Config YAML (default: the checkpoint's).")
                      ] = None,
    dataset: Annotated[list[str] | None, typer.Option("--dataset", "-d", help="Dataset to evaluate (repeatable; "
                                                      "default: eval.datasets).")] = None,
    set_: SetOpt = None,
    runs_dir: RunsOpt = None,
    run_name: Annotated[str | None, typer.Option("--run-name")] = None,
    compare_to: Annotated[str | None, typer.Option("--compare-to", help="A previous evaluation's per-question "
                                                   "Parquet (or its directory): paired Pass@1 difference.")] = None,
) -> None:
    """Evaluate a checkpoint: Pass@1/Pass@k with CIs, per-question Parquet, optional judge and paired comparison."""
    base = load_checked_config(config, [], training=False) if config is not None else None
    runs = resolve_runs_dir(runs_dir, base)
    from infra.fs import StorageError, is_remote, probe, storage_options

    if compare_to is not None and not is_remote(compare_to) and not Path(compare_to).exists():
        fail(f"--compare-to {compare_to}: no such file or directory")
    prepare_environment(runs)
    from flows.evaluate import (
        checkpoint_source,
        eval_storage,
        evaluate,
        fetch_registered_policy,
        resolve_checkpoint,
        resolve_eval_config,
    )
    from infra.run.runtime import CheckpointError
    from infra.tracking.run import RegistryError, is_registered_model
    from tasks.retry import USER_ERRORS

    try:
        registered = fetch_registered_policy(checkpoint, base, set_, runs) if is_registered_model(checkpoint) else None
        ckpt = resolve_checkpoint(checkpoint if registered is None else None, eval_storage(base, set_), runs)
        cfg = resolve_eval_config(base, ckpt, set_, dataset, registered)
        check_datasets(cfg, training=False)
        if cfg.storage.evaluations_uri:
            probe(cfg.storage.evaluations_uri, storage_options(cfg.storage, cfg.storage.evaluations_uri))
    except (ConfigError, CheckpointError, StorageError, RegistryError) as exc:
        fail(str(exc))
    check_tracking_server(cfg.tracking.tracking_uri)
    print_numerics(cfg)
    start_prefect_api()  # after every check: bad input exits without starting a server
    cfg = _with_runs_dir(cfg, runs)
    source = checkpoint if registered is not None else checkpoint_source(checkpoint, ckpt)
    try:
        with flow_progress("evaluating", len(cfg.eval.datasets) or None, _eval_progress):
            result = evaluate(config=cfg, checkpoint=source, runs_dir=str(runs),
                              compare_to=compare_to, run_name=run_name)
    except USER_ERRORS as exc:  # the user's input (a bad row, a bad config), found by the flow: as before it
        fail(str(exc))
    except Exception as exc:
        fail(f"evaluation failed: {exc}", code=1)
    out = _out()
    out.print(_eval_table(f"aepo eval: {result.run_name} (step {result.checkpoint_step})", result.summary,
                          result.pass_k, result.judge if result.judge else None))
    if result.compare:
        cmp = Table(title=f"paired Pass@1 difference vs {compare_to}", title_justify="left")
        for col in ("dataset", "questions", "diff", "95% CI"):
            cmp.add_column(col)
        for ds, c in result.compare.items():
            cmp.add_row(ds, _fmt(c["questions"], 0), f"{c['diff']:+.4f}", f"[{c['ci_low']:.4f}, {c['ci_high']:.4f}]")
        out.print(cmp)
    out.print(_where_table([("MLflow run", f"{result.run_id}  ({result.tracking_uri})"),
                            ("per-question results", result.results_dir)]))
    out.print(escape(_ui_hint(result.tracking_uri, runs)))


def _eval_progress(bar: Progress, task: Any, event: ProgressEvent) -> None:
    if event.stage == "evaluate":
        bar.update(task, advance=1, description=f"evaluated {event.name}")


# ---------------------------------------------------------------------------------------------- sweep


def _sweep_runs_dir(option: str | None, path: Path) -> Path:
    """--runs-dir / $AEPO_RUNS_DIR, else the sweep file's runs_dir (relative to the file), else ./runs."""
    if option:
        return Path(option).expanduser().resolve()
    from infra.config_files import read_config_text

    try:
        raw = yaml.safe_load(read_config_text(path, "sweep file")) or {}
    except ConfigError as exc:
        fail(str(exc))
    except yaml.YAMLError as exc:
        fail(f"cannot read sweep file {path}: {exc}")
    value = raw.get("runs_dir") if isinstance(raw, dict) else None
    if value:
        p = Path(str(value)).expanduser()
        return (p if p.is_absolute() else path.resolve().parent / p).resolve()
    return Path(DEFAULT_RUNS_DIR).resolve()


@app.command("sweep")
def sweep_cmd(
    config: Annotated[Path, typer.Option("--config", "-c", help="Sweep YAML (format: flows/sweep.py).")],
    runs_dir: RunsOpt = None,
    shard: Annotated[str | None, typer.Option("--shard", help="Run only shard i/N of the (cell, seed) list (every "
                                              "N-th from the i-th); superseded by --deployment and a work pool.")
                     ] = None,
    deployment: Annotated[str | None, typer.Option(
        "--deployment", help="Submit each (cell, seed) as a flow run of this deployment (e.g. aepo-train/train) "
                             "to the Prefect server at $PREFECT_API_URL; default: run them here, one by one.")] = None,
    max_parallel: Annotated[int, typer.Option("--max-parallel", min=1, help="With --deployment: child flow runs "
                                              "in flight at once.")] = 4,
    child_timeout: Annotated[float | None, typer.Option(
        "--child-timeout", help="With --deployment: seconds after which an unfinished child is cancelled and "
                                "reported failed (default: wait).")] = None,
    child_lost_after: Annotated[float | None, typer.Option(
        "--child-lost-after", help="With --deployment: seconds without a heartbeat after which a running child "
                                   "counts as lost with its worker: marked Crashed and reported failed (default: "
                                   "3 × PREFECT_FLOWS_HEARTBEAT_FREQUENCY, 180 s unless set).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help="Dotted override key=value for every cell, "
                                                   "applied after the cell's own (repeatable).")] = None,
    cells: Annotated[list[str] | None, typer.Option("--cells", help="Run only these cells (comma-separated or "
                                                    "repeated), e.g. --cells aepo,grpo.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List the runs (cell, seed, run name, overrides) and "
                                          "exit: nothing is started or created.")] = False,
) -> None:
    """Run a grid of training runs (cells × seeds) nested under one MLflow run, then compare them."""
    if not config.is_file():
        fail(f"sweep file not found: {config}")
    from flows.sweep_spec import load_sweep, shard_runs

    only = [c.strip() for item in cells for c in item.split(",") if c.strip()] if cells else None
    try:
        spec = load_sweep(config, list(set_ or []), only)
        selected = shard_runs(spec.runs, shard)
        for run in selected:
            check_datasets(run.config)
    except ConfigError as exc:
        fail(str(exc))
    if dry_run:
        _out().print(_sweep_plan(spec, selected))
        return
    runs = _sweep_runs_dir(runs_dir, config)
    if deployment is not None:
        api_url = os.environ.get("PREFECT_API_URL")
        if not api_url:
            fail("--deployment needs a Prefect server with workers: export PREFECT_API_URL=http://127.0.0.1:4200/api "
                 "(README, 'Scaling out')")
        if not _healthy(api_url):
            fail(f"--deployment: no Prefect server at PREFECT_API_URL={api_url}", code=1)
    prepare_environment(runs)
    from flows.sweep import sweep
    from tasks.retry import USER_ERRORS

    check_tracking_server(spec.base.tracking.tracking_uri)
    start_prefect_api()  # after every check: bad input exits without starting a server

    def on_event(bar: Progress, task: Any, event: ProgressEvent) -> None:
        if event.stage == "cell":
            bar.update(task, completed=event.done, total=event.total, description=event.name)

    try:
        with flow_progress(f"sweep {spec.name}", len(selected), on_event) as progress:
            result = sweep(sweep_config=str(config.resolve()), runs_dir=str(runs), shard=shard,
                           deployment=deployment, max_parallel=max_parallel, child_timeout_s=child_timeout,
                           child_lost_after_s=child_lost_after, overrides=list(set_ or []) or None, cells=only)
            progress.update(progress.task_ids[0], completed=len(selected), description=f"sweep {result.name} done")
    except USER_ERRORS as exc:  # the user's input (a bad row, a bad config), found by the flow: as before it
        fail(str(exc))
    except Exception as exc:
        fail(f"sweep failed: {exc}", code=1)
    table = Table(title=f"aepo sweep: {result.name} (parent MLflow run {result.parent_run_id})",
                  title_justify="left")
    for col in ("cell", "seed", "status", "dataset", "pass@1", "95% CI", "pass@k", "tool calls/q", "reward"):
        table.add_column(col, overflow="fold")
    for r in result.runs:
        table.add_row(r["cell"], str(r["seed"]), r["status"], r["dataset"], _fmt(r["pass@1"]),
                      f"[{_fmt(r['pass@1_ci_low'])}, {_fmt(r['pass@1_ci_high'])}]", _fmt(r["pass@k"]),
                      _fmt(r["tool_calls_per_question"], 2), _fmt(r["reward_mean"]))
    out = _out()
    out.print(table)
    if result.reused:
        out.print(f"already FINISHED in MLflow, not run again: {', '.join(result.reused)}")
    out.print(_where_table([(k, v) for k, v in result.files.items()]))
    out.print(escape(_ui_hint(result.tracking_uri, runs)))


def _sweep_plan(spec: Any, selected: Sequence[Any]) -> Table:
    """``aepo sweep --dry-run``: the runs a sweep (a ``SweepSpec``) would start, each with its cell's overrides;
    the ones every cell shares in the caption."""
    def joined(overrides: dict[str, Any]) -> str:
        return ", ".join(f"{k}={v}" for k, v in overrides.items()) or "–"

    table = Table(title=f"aepo sweep {spec.name}: {len(selected)} run(s), nothing started", title_justify="left",
                  caption=f"every cell (base {spec.base_source}): {joined(spec.overrides)}", caption_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("cell", "seed", "run name", "cell overrides"):
        table.add_column(col, overflow="fold")
    for run in selected:
        own = {k: v for k, v in run.overrides.items()
               if k != "seed" and (k not in spec.overrides or k in spec.forced or spec.overrides[k] != v)}
        table.add_row(run.cell, str(run.seed), run.run_name, joined(own))
    return table


# ---------------------------------------------------------------------------------------------- serve


@app.command()
def serve(
    runs_dir: RunsOpt = None,
    config: Annotated[Path, typer.Option("--config", "-c", help="Default config of the train/evaluate "
                                         "deployments.")] = Path("configs/tiny.yaml"),
    sweep_file: Annotated[Path, typer.Option("--sweep", help="Sweep file of the scheduled sweep deployment.")
                          ] = Path("configs/sweeps/tiny.yaml"),
    cron: Annotated[str, typer.Option("--cron", help="Schedule of the sweep deployment ('' for none).")
                    ] = "0 3 * * 1",
    api_url: Annotated[str, typer.Option("--api-url", envvar="PREFECT_API_URL", help="Prefect server API.")
                       ] = "http://127.0.0.1:4200/api",
) -> None:
    """Serve the train / evaluate / sweep deployments from this process (no work pool needed; Ctrl-C stops)."""
    load_checked_config(config, [])
    if not sweep_file.is_file():
        fail(f"sweep file not found: {sweep_file}")
    runs = resolve_runs_dir(runs_dir)
    if not _healthy(api_url):
        fail(f"no Prefect server at {api_url}: start one with `aepo ui --runs-dir {runs}` (or `prefect server "
             "start`), or pass --api-url", code=1)
    os.environ["PREFECT_API_URL"] = api_url
    prepare_environment(runs)
    from prefect import serve as prefect_serve

    from flows.serve import build_deployments

    deployments = build_deployments(runs, config, sweep_file, cron or None)
    _out().print(f"serving {', '.join(d.name for d in deployments)} against {api_url}; runs dir {runs}; "
                 f"trigger them from the UI or `prefect deployment run 'aepo-train/{deployments[0].name}'`")
    prefect_serve(*deployments)


# ---------------------------------------------------------------------------------------------- runs


def _first_metric(metrics: Mapping[str, float], pattern: re.Pattern[str]) -> float | None:
    for key, value in metrics.items():
        if pattern.match(str(key)) and value is not None and not (isinstance(value, float) and math.isnan(value)):
            return float(value)
    return None


@app.command()
def runs(
    runs_dir: RunsOpt = None,
    experiment: Annotated[str, typer.Option("--experiment", "-e", help="MLflow experiment.")] = "aepo",
    limit: Annotated[int, typer.Option("--limit", "-n", help="Newest N runs.")] = 30,
    tracking_uri: TrackingOpt = None,
) -> None:
    """Table of MLflow runs: name, kind, status, algorithm, final Pass@1 and reward."""
    rdir = resolve_runs_dir(runs_dir)
    uri = _tracking_uri(rdir, tracking_uri)
    assert uri is not None
    from infra.tracking.run_index import newest_runs

    found = newest_runs(uri, experiment, limit)
    table = Table(title=f"MLflow runs in {experiment!r} at {uri}", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    for col in ("started", "name", "run id", "kind", "status", "algorithm", "mode", "seed", "pass@1", "reward"):
        wraps = col in ("name", "kind")
        table.add_column(col, overflow="fold", no_wrap=not wraps,
                         justify="right" if col in ("seed", "pass@1", "reward") else "left")
    pass1 = re.compile(r"^eval/.+/pass_at_1$")
    for run in found:
        kind = run.tags.get("kind") or "train"
        if run.tags.get("sweep_name") and kind == "train":
            kind = f"train ({run.tags['sweep_name']})"
        started = run.start_time.strftime("%m-%d %H:%M") if run.start_time is not None else "–"
        table.add_row(started, run.run_name, run.run_id[:12], kind, run.status, run.tags.get("algorithm", "–"),
                      run.tags.get("mode", "–"), run.tags.get("seed", "–"), _fmt(_first_metric(run.metrics, pass1)),
                      _fmt(run.metrics.get("rollout/reward_mean")))
    out = _out()
    out.print(table)
    if not found:
        out.print("no runs yet")


# ---------------------------------------------------------------------------------------------- trajectories


def _resolve_store_run(store: Any, run: str, uri: str | None, experiment: str) -> str:
    """A stored run id from a run id, a unique prefix of one, or an MLflow run name."""
    stored = store.run_ids()
    if run in stored:
        return run
    prefixed = [r for r in stored if r.startswith(run)]
    if len(prefixed) == 1:
        return prefixed[0]
    if uri is not None:
        from infra.tracking.run import Tracker

        frame = Tracker(uri, experiment=experiment).search_runs(filter_string=f"attributes.run_name = '{run}'")
        ids = [r for r in frame["run_id"] if r in stored] if not frame.empty else []
        if ids:
            return ids[0]  # newest first
    listed = ", ".join(stored[:10]) + (" …" if len(stored) > 10 else "")
    fail(f"no stored trajectories for run {run!r} in {store.uri} (stored runs: {listed or 'none'})", code=1)


@app.command()
def trajectories(
    run: Annotated[str, typer.Argument(help="MLflow run id (or a unique prefix) or run name.")],
    step: Annotated[int | None, typer.Option("--step", help="Per-question detail of one step.")] = None,
    show: Annotated[str | None, typer.Option("--show", help="With --step: the transcript of <question> (its tree) "
                                             "or <question>/<leaf> (one trajectory, in full).")] = None,
    runs_dir: RunsOpt = None,
    store_uri: Annotated[str | None, typer.Option("--store", help="Trajectory store (default: <runs>/trajectories;"
                                                  " s3://… works).")] = None,
    experiment: Annotated[str, typer.Option("--experiment", "-e")] = "aepo",
    tracking_uri: TrackingOpt = None,
) -> None:
    """Summary of a run's stored rollout trees: per step, or per question with --step; with --show, a question's
    tree or one trajectory's transcript (segments, tool results, entropies, branch points, reward). A run name is
    resolved through MLflow (--tracking-uri, else the runs dir's SQLite store where there is one)."""
    from infra.store import TrajectoryStore

    if show is not None and step is None:
        fail("--show needs --step N (the step whose tree to show)")
    rdir = resolve_runs_dir(runs_dir)
    uri = _tracking_uri(rdir, tracking_uri, required=False)
    store = TrajectoryStore(store_uri or rdir / "trajectories")
    run_id = _resolve_store_run(store, run, uri, experiment)
    if show is not None and step is not None:
        _show(store, run_id, step, show)
        return
    cols = ["step", "question_id", "leaf_id", "sample_kind", "reward", "status", "num_tool_calls", "tool_errors",
            "global_budget", "h_root"]
    traj = store.read_trajectories(run_id, step=step, columns=cols)
    nodes = store.read_nodes(run_id, step=step, columns=["step", "question_id", "branched"])
    if traj.empty:
        fail(f"run {run_id} has no stored trajectories{f' at step {step}' if step is not None else ''} "
             f"(steps: {store.steps(run_id)})", code=1)
    per_question = step is not None
    key = "question_id" if per_question else "step"
    title = (f"run {run_id} step {step}: per question" if per_question
             else f"run {run_id}: {traj['step'].nunique()} steps in {store.uri}")
    table = Table(title=title, title_justify="left")
    lead = ["question", "m", "H_root"] if per_question else ["step", "questions"]
    for col in (*lead, "leaves", "global", "branch", "branch points", "mean reward", "tool calls/leaf",
                "tool errors", "statuses"):
        table.add_column(col, overflow="fold")
    branches = nodes.groupby(key)["branched"].sum() if not nodes.empty else {}
    for value, g in traj.groupby(key, sort=True):
        statuses = g["status"].value_counts()
        first = ([str(value), str(int(g["global_budget"].iloc[0])), _fmt(float(g["h_root"].iloc[0]))]
                 if per_question else [str(value), str(g["question_id"].nunique())])
        table.add_row(*first, str(len(g)), str(int((g["sample_kind"] == "global").sum())),
                      str(int((g["sample_kind"] == "branch").sum())), str(int(branches.get(value, 0))),
                      _fmt(float(g["reward"].mean())), _fmt(float(g["num_tool_calls"].mean()), 2),
                      str(int(g["tool_errors"].sum())), ", ".join(f"{s}:{n}" for s, n in statuses.items()))
    _out().print(table)


def _show(store: Any, run_id: str, step: int, value: str) -> None:
    """``--show``: one question's tree or one leaf's transcript at ``step``."""
    from flows.transcript import ShowError, render_show

    traj = store.read_trajectories(run_id, step=step)
    if traj.empty:
        fail(f"run {run_id} has no stored trajectories at step {step} (steps: {store.steps(run_id)})", code=1)
    try:
        view = render_show(run_id, step, value, traj, store.read_nodes(run_id, step=step))
    except ShowError as exc:
        fail(str(exc), code=1)
    _out().print(view)


# ---------------------------------------------------------------------------------------------- ui

WILDCARD_HOSTS = ("0.0.0.0", "::")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
SQL_DRIVERS = {"postgresql": "psycopg2", "postgresql+psycopg2": "psycopg2", "postgresql+psycopg": "psycopg",
               "postgresql+pg8000": "pg8000"}  # MLflow's SQLAlchemy store: URI scheme → the driver it imports


def _check_listen(host: str, port: int, option: str) -> None:
    """The server can listen on ``host:port``: the host is an address of this machine and the port is free."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        fail(f"--host {host}: unknown host name")
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: a TIME_WAIT port is free
        try:
            sock.bind(address)
        except OSError as exc:
            fail(f"{option} {port}: cannot listen on {host}:{port} ({exc.strerror})")


def _public_host(host: str) -> str:
    """The host name that other machines use: ``host`` itself, or for a wildcard (0.0.0.0, ::) the address of
    the interface of the default route (no packet is sent), else the host name."""
    if host not in WILDCARD_HOSTS:
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))
            return str(sock.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _redacted(uri: str) -> str:
    """A database URI without its password (for messages)."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.password is None:
        return uri
    netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parsed._replace(netloc=netloc))


def _backend_store(value: str | None, rdir: Path) -> str:
    """``--backend-store-uri``: the runs dir's SQLite store by default, another SQLite file, or PostgreSQL (its
    driver must be installed: the server would otherwise die at start with an import error)."""
    from infra.tracking.run import tracking_uri_for

    if value is None:
        return tracking_uri_for(rdir)
    scheme = value.split("://", 1)[0] if "://" in value else ""
    if scheme == "sqlite":
        path = Path(value.removeprefix("sqlite:///")).expanduser() if value.startswith("sqlite:///") else None
        if path is None or not path.name:
            fail(f"--backend-store-uri {value}: a SQLite store is sqlite:///<path of the .db file> "
                 "(sqlite:////abs/path/mlflow.db)")
        if not path.resolve().parent.is_dir():
            fail(f"--backend-store-uri {value}: no such directory {path.resolve().parent}")
        return f"sqlite:///{path.resolve()}"
    if scheme in SQL_DRIVERS:
        if not urllib.parse.urlsplit(value).path.strip("/"):
            fail(f"--backend-store-uri {_redacted(value)}: name the database ({scheme}://user:password@host:5432/db)")
        driver = SQL_DRIVERS[scheme]
        if importlib.util.find_spec(driver) is None:
            fail(f"--backend-store-uri {scheme}://…: its driver {driver} is not installed in this environment "
                 f"(pip install {'psycopg2-binary' if driver == 'psycopg2' else driver})")
        return value
    fail(f"--backend-store-uri {_redacted(value)}: expected sqlite:///path/mlflow.db or "
         "postgresql://user:password@host:5432/db")


def _artifacts_destination(value: str | None, rdir: Path, s3_endpoint_url: str | None) -> str:
    """``--artifacts-destination``: where the MLflow server keeps the artifacts its clients send it (they go
    through the server: the clients need no access to it): ``<runs>/mlartifacts`` by default, a directory, or
    ``s3://bucket/prefix`` (``--s3-endpoint-url`` for MinIO, moto, …)."""
    from infra.tracking.run import ARTIFACTS_DIR

    if value is None:
        dest = str(rdir / ARTIFACTS_DIR)
    elif value.startswith("s3://"):
        if not value.removeprefix("s3://").split("/", 1)[0]:
            fail(f"--artifacts-destination {value}: name a bucket (s3://bucket/prefix)")
        if importlib.util.find_spec("boto3") is None:
            fail("--artifacts-destination s3://…: the MLflow server needs boto3 (pip install boto3)")
        dest = value.rstrip("/")
    elif "://" in value and not value.startswith("file://"):
        fail(f"--artifacts-destination {value}: expected a directory or s3://bucket/prefix")
    else:
        path = Path(urllib.parse.urlsplit(value).path if value.startswith("file://") else value).expanduser()
        if path.exists() and not path.is_dir():
            fail(f"--artifacts-destination {value}: not a directory")
        dest = str(path.resolve())
    if s3_endpoint_url is not None:
        if not dest.startswith("s3://"):
            fail("--s3-endpoint-url: only for an s3:// --artifacts-destination")
        if not _is_http(s3_endpoint_url):
            fail(f"--s3-endpoint-url {s3_endpoint_url}: expected http(s)://host:port")
    return dest


def _mlflow_allowed_hosts(public: str) -> list[str]:
    """Host headers the MLflow server accepts when it listens beyond loopback: its defaults (localhost, private
    IPs) plus this machine's names, so that workers may use the host name too."""
    try:
        from mlflow.server.security_utils import get_default_allowed_hosts

        defaults = list(get_default_allowed_hosts())
    except ImportError:  # pragma: no cover - an MLflow without host checks
        return []
    names = sorted({public, socket.gethostname(), socket.getfqdn()})
    return [*defaults, *(n for name in names for n in (name, f"{name}:*"))]


def _local_artifact_experiments(mlflow_url: str) -> list[str]:
    """Experiments of the server whose artifacts live on a local path (created by runs that logged straight to
    the SQLite store): a run on another machine would write its artifacts to its own disk there."""
    body = json.dumps({"max_results": 1000}).encode()
    request = urllib.request.Request(f"{mlflow_url}/api/2.0/mlflow/experiments/search", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            experiments = json.load(resp).get("experiments", [])
    except (OSError, ValueError):
        return []
    return [f"{e['name']} ({e['artifact_location']})" for e in experiments
            if str(e.get("artifact_location", "")).startswith(("file:", "/"))]


def _wait_http(url: str, procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        if _healthy(url):
            return True
        time.sleep(0.5)
    return False


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each server's process group (a server and the workers it started), SIGKILL what is left."""
    for p in procs:
        with suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        with suppress(subprocess.TimeoutExpired):
            p.wait(timeout=15)
        with suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@app.command()
def ui(
    runs_dir: RunsOpt = None,
    host: Annotated[str, typer.Option("--host", help="Interface both servers listen on: 127.0.0.1 (this machine "
                                      "only) or 0.0.0.0 (workers on other machines can log to them).")
                    ] = "127.0.0.1",
    prefect_port: Annotated[int, typer.Option("--prefect-port", min=1, max=65535)] = 4200,
    mlflow_port: Annotated[int, typer.Option("--mlflow-port", min=1, max=65535)] = 5000,  # tracking.UI_MLFLOW_PORT
    backend_store_uri: Annotated[str | None, typer.Option(
        "--backend-store-uri", help="MLflow's database: sqlite:///path/mlflow.db or postgresql://user:password@host"
                                    ":5432/db (default: <runs dir>/mlflow.db).")] = None,
    artifacts_destination: Annotated[str | None, typer.Option(
        "--artifacts-destination", help="Where the MLflow server stores the artifacts its clients send it: a "
                                        "directory or s3://bucket/prefix (default: <runs dir>/mlartifacts).")] = None,
    s3_endpoint_url: Annotated[str | None, typer.Option(
        "--s3-endpoint-url", help="S3-compatible endpoint of an s3:// destination (MinIO, …): the server's "
                                  "MLFLOW_S3_ENDPOINT_URL.")] = None,
    no_prefect: Annotated[bool, typer.Option("--no-prefect", help="Start the MLflow server only.")] = False,
    startup_timeout: Annotated[float, typer.Option("--startup-timeout", help="Seconds to wait for each server.")
                               ] = 180,
) -> None:
    """Start the MLflow tracking server and the Prefect server (UIs and APIs); Ctrl-C or SIGTERM stops both.

    Workers on other machines log to them with --host 0.0.0.0: their runs set tracking.tracking_uri to the
    printed MLflow URL, their Prefect clients PREFECT_API_URL to the printed API URL. Artifacts go through the
    MLflow server to --artifacts-destination, so the workers need no access to it."""
    rdir = resolve_runs_dir(runs_dir)
    servers = [("mlflow", mlflow_port, "--mlflow-port")] + ([] if no_prefect else [("prefect", prefect_port,
                                                                                     "--prefect-port")])
    for _, port, option in servers:
        _check_listen(host, port, option)
    backend = _backend_store(backend_store_uri, rdir)
    dest = _artifacts_destination(artifacts_destination, rdir, s3_endpoint_url)
    public = _public_host(host)
    local_only = host in LOOPBACK_HOSTS
    hostport = f"[{public}]" if ":" in public else public
    mlflow_url, prefect_url = f"http://{hostport}:{mlflow_port}", f"http://{hostport}:{prefect_port}"

    rdir.mkdir(parents=True, exist_ok=True)
    if not dest.startswith("s3://"):
        Path(dest).mkdir(parents=True, exist_ok=True)
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PREFECT_HOME": str(rdir / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": f"{prefect_url}/api"}
    env.pop("PREFECT_API_URL", None)
    # MLflow's job runners (five huey consumers, for GenAI scorer jobs, which no run here submits) poll while the
    # server idles: 23 s of CPU a minute against 0.2 without them (AMD EPYC, 2 cores). Set the variable to true
    # to have them.
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    if s3_endpoint_url:
        env["MLFLOW_S3_ENDPOINT_URL"] = s3_endpoint_url
    mlflow_cmd = [str(bindir / "mlflow"), "server", "--host", host, "--port", str(mlflow_port),
                  "--backend-store-uri", backend, "--artifacts-destination", dest, "--workers", "1"]
    if not local_only:
        allowed = _mlflow_allowed_hosts(public)
        mlflow_cmd += ["--allowed-hosts", ",".join(allowed)] if allowed else []
    commands = {"mlflow": mlflow_cmd}
    if not no_prefect:
        (rdir / "prefect").mkdir(parents=True, exist_ok=True)
        commands["prefect"] = [str(bindir / "prefect"), "server", "start", "--host", host, "--port",
                               str(prefect_port)]
    logs = rdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    out = _out()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops the servers too (finally)
    try:
        for name, cmd in commands.items():  # each in its own process group: _stop reaches its workers too
            with open(logs / f"{name}-server.log", "ab") as fh:
                procs.append(subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        local = hostport if host not in WILDCARD_HOSTS else "[::1]" if host == "::" else "127.0.0.1"  # reachable here
        health = {"mlflow": f"http://{local}:{mlflow_port}", "prefect": f"http://{local}:{prefect_port}/api"}
        with out.status(f"starting {' and '.join(commands)}…"):
            for name in commands:
                if not _wait_http(health[name], procs, startup_timeout):
                    fail(f"the {name} server did not come up (log: {logs / f'{name}-server.log'})", code=1)
        out.print(_where_table([
            ("MLflow", f"{mlflow_url}   (runs: {_redacted(backend)}; artifacts: {dest})"),
            *([] if no_prefect else [("Prefect", prefect_url)]),
            ("runs dir", str(rdir)),
            ("server logs", str(logs)),
        ]))
        out.print(f"Workers {'on this machine' if local_only else 'and clients'} use them with:\n"
                  f"  --set tracking.tracking_uri={mlflow_url}   (or tracking.tracking_uri in the config / the "
                  "sweep file's overrides; `aepo runs --tracking-uri` reads them)"
                  + ("" if no_prefect else f"\n  export PREFECT_API_URL={prefect_url}/api"))
        if local_only:
            out.print(f"(listening on {host} only: --host 0.0.0.0 lets workers on other machines in)")
        else:
            _err().print("[yellow]warning:[/] the servers have no authentication: whoever reaches "
                         f"{public} can read and write the runs")
            for exp in _local_artifact_experiments(f"http://{local}:{mlflow_port}"):
                _err().print(f"[yellow]warning:[/] experiment {escape(exp)} keeps its artifacts on a local path: "
                             "runs of other machines would write them to their own disks (use another "
                             "tracking.experiment)", soft_wrap=True)
        out.print("Ctrl-C stops the servers")
        while all(p.poll() is None for p in procs):
            time.sleep(1.0)
        dead = [name for name, p in zip(commands, procs, strict=True) if p.poll() is not None]
        fail(f"{', '.join(dead)} server exited (logs in {logs})", code=1)
    except KeyboardInterrupt:
        out.print("stopping…")
    finally:
        _stop(procs)
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------- config


@config_app.command("show")
def config_show(config: Annotated[Path | None, typer.Option("--config", "-c", help="Experiment config YAML "
                                                            "(default: the built-in defaults).")] = None,
                set_: SetOpt = None,
                describe: Annotated[bool, typer.Option("--describe", help="Each key preceded by its description "
                                                       "(a comment; the output still loads as the config).")
                                    ] = False) -> None:
    """Print the resolved config (defaults + file + overrides) as YAML."""
    cfg = load_checked_config(config, set_)
    typer.echo(cfg.to_yaml(describe=describe), nl=False)


def main() -> None:  # pragma: no cover - console entry point alternative
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
