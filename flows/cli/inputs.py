"""The inputs the commands share: their common options, the runs dir, and the checks that run before anything is
created (a bad config or dataset exits 2 with one line; an MLflow server that does not answer exits 1)."""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from aepo_core.config import RUNS_DIR_ENV, ExperimentConfig
from aepo_core.config_keys import ConfigError
from aepo_core.overrides import build_config
from flows.cli.render import OutputFormat, fail, is_http

RUNS_ENV = RUNS_DIR_ENV
DEFAULT_RUNS_DIR = "runs"

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="Experiment config YAML.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", metavar="KEY=VALUE",
                                                  help="Dotted override key=value (repeatable).")]
RunsOpt = Annotated[str | None, typer.Option("--runs-dir", envvar=RUNS_ENV, show_envvar=True, metavar="DIR",
                                             help="Where all state goes (default: the config's storage.runs_dir, "
                                                  "./runs).")]
FormatOpt = Annotated[OutputFormat, typer.Option("--format", help="table (for a person), csv or json (every value "
                                                "unrounded, for a program).")]
TrackingOpt = Annotated[str | None, typer.Option("--tracking-uri", help="MLflow tracking URI, e.g. an `mlflow "
                                                 "server` (http://host:5000, `aepo ui`); default: the runs dir's "
                                                 "SQLite store.")]


def resolve_runs_dir(option: str | None, cfg: ExperimentConfig | None = None) -> Path:
    """--runs-dir / $AEPO_RUNS_DIR (typer fills ``option`` from both), else the config's, else ./runs."""
    raw = option or (cfg.storage.runs_dir if cfg is not None else DEFAULT_RUNS_DIR)
    return Path(raw).expanduser().resolve()


def with_runs_dir(cfg: ExperimentConfig, runs: Path) -> ExperimentConfig:
    """Record the runs dir actually used in the config (so the logged config re-runs the same way)."""
    return build_config(cfg.to_dict(), {"storage.runs_dir": str(runs)})


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


def check_storage(cfg: ExperimentConfig, runs: Path, run_name: str | None = None) -> None:
    """Every remote store the run writes must be usable with the credentials at hand — ``s3://`` trajectories,
    checkpoints (with a ``run_name``: a training run), evaluation results, MLflow artifacts — or the command exits 2
    naming the location and S3's reason (wrong keys, no bucket, no endpoint), before anything starts. Unchecked, a
    wrong key for the evaluations or the artifacts failed the run at its first write: after training."""
    from infra.fs import StorageError, probe, storage_options
    from infra.run.checkpoints import checkpoint_root

    checkpoints = checkpoint_root(cfg, runs, run_name) if run_name is not None else None
    try:
        for uri in (cfg.storage.trajectories_uri, checkpoints, cfg.storage.evaluations_uri,
                    cfg.tracking.artifact_location):
            if uri:
                probe(uri, storage_options(cfg.storage, uri))
    except StorageError as exc:
        fail(str(exc))


def check_not_running(runs: Path, run_id: str | None = None, sweep: str | None = None) -> None:
    """The run or sweep must not be in progress in another process (:mod:`infra.run.lock`): exits 2 naming its
    pid, before anything is created. (The flow claims it again for the whole run; this is the early, quiet no.)"""
    from infra.run.lock import BusyError, Claims

    try:
        with Claims(runs, run_id=run_id, sweep=sweep):
            pass
    except BusyError as exc:
        fail(str(exc))


def healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    """``<base_url>/health`` answers 200 (a Prefect API URL or an MLflow server URL)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


def check_tracking_store(uri: str | None, runs: Path) -> None:
    """The MLflow store a command will use must work before anything starts: an ``http(s)://`` tracking URI must
    answer (MLflow's client would otherwise retry a refused connection for minutes, and a run would fail
    half-created; exits 1 with the URI named), and a SQLite store (``uri``, else the runs dir's) must read as one
    (a damaged file failed the run with a SQLAlchemy traceback; exits 2 naming it, the file untouched)."""
    from infra.tracking.client import tracking_uri_for, unreadable_sqlite_store

    if is_http(uri) and not healthy(str(uri), timeout_s=5.0):
        fail(f"no MLflow server answers at {uri} (tracking.tracking_uri / --tracking-uri): start one with "
             "`aepo ui`, or check the host and port", code=1)
    problem = unreadable_sqlite_store(uri or tracking_uri_for(runs))
    if problem is not None:
        fail(f"the MLflow store is not a readable SQLite database ({problem}): move it aside (a new one is then "
             "created) or restore it from a copy; nothing was written")


def reading_tracking_uri(runs: Path, tracking_uri: str | None, required: bool = True) -> str | None:
    """The tracking URI a reading command uses: ``--tracking-uri`` (checked: a server must answer), else the runs
    dir's SQLite store, which must exist (``required=False``: None where it does not)."""
    from infra.tracking.client import tracking_uri_for

    check_tracking_store(tracking_uri, runs)
    uri = tracking_uri or tracking_uri_for(runs)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        if not required and tracking_uri is None:
            return None
        fail(f"no MLflow store at {uri} (nothing has run with --runs-dir {runs} yet)", code=1)
    return uri
