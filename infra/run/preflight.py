"""The checks a command runs before anything is created: a bad config or dataset, an unusable store, a run another
process trains, an MLflow store that does not work. Each raises :class:`InputError` naming the problem and the exit
code it deserves (2: the user's input; 1: a service that does not answer); the CLI prints the one line and exits.

Importing this module is cheap: the adapters are imported inside the checks, after the command has prepared the
environment Prefect and MLflow read once at import (:mod:`flows.cli.environment`).
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

from aepo_core.config import RUNS_DIR_ENV, ExperimentConfig
from aepo_core.config_keys import ConfigError
from aepo_core.overrides import build_config

EXIT_USAGE = 2
EXIT_FAILED = 1
DEFAULT_RUNS_DIR = "runs"


class InputError(Exception):
    """A command's input cannot work: ``code`` 2 for the user's input, 1 for a service that does not answer."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def resolve_runs_dir(given: str | os.PathLike[str] | None, configured: str | None = None) -> Path:
    """Where a command or flow keeps its state: ``given`` (``--runs-dir``, a flow's ``runs_dir`` parameter), else
    ``$AEPO_RUNS_DIR`` (a deployment's run then lands where the worker or ``aepo serve`` process says), else the
    config's ``storage.runs_dir``, else ``./runs``. Relative stays relative (a flow records the runs dir it was
    given); the commands make it absolute (:func:`flows.cli.inputs.resolve_runs_dir`)."""
    raw = given or os.environ.get(RUNS_DIR_ENV) or configured or DEFAULT_RUNS_DIR
    return Path(raw).expanduser()


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


def load_checked_config(path: Path | None, sets: list[str], training: bool = True) -> ExperimentConfig:
    """The config file with overrides, its datasets checked (:func:`check_datasets`); :class:`InputError`."""
    from infra.config_files import load_config

    try:
        cfg = load_config(path, sets)
        check_datasets(cfg, training)
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    return cfg


def read_config_file(path: Path | None, sets: list[str] | None = None) -> ExperimentConfig:
    """The config file with overrides (defaults without a file), unchecked; raises ``ConfigError``."""
    from infra.config_files import load_config

    return load_config(path, list(sets or []))


def check_storage(cfg: ExperimentConfig, runs: Path, run_name: str | None = None) -> None:
    """Every remote store the run writes must be usable with the credentials at hand — ``s3://`` trajectories,
    checkpoints (with a ``run_name``: a training run), evaluation results, MLflow artifacts — or :class:`InputError`
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
        raise InputError(str(exc)) from None


def check_not_running(runs: Path, run_id: str | None = None, sweep: str | None = None) -> None:
    """The run or sweep must not be in progress in another process (:mod:`infra.run.lock`): :class:`InputError`
    naming its pid. (The flow claims it again for the whole run; this is the early, quiet no.)"""
    from infra.run.lock import BusyError, Claims

    try:
        with Claims(runs, run_id=run_id, sweep=sweep):
            pass
    except BusyError as exc:
        raise InputError(str(exc)) from None


def is_http(uri: str | None) -> bool:
    return bool(uri) and str(uri).startswith(("http://", "https://"))


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
    half-created; code 1 with the URI named), and a SQLite store (``uri``, else the runs dir's) must read as one
    (a damaged file failed the run with a SQLAlchemy traceback; code 2 naming it, the file untouched)."""
    from infra.tracking.client import tracking_uri_for, unreadable_sqlite_store

    if is_http(uri) and not healthy(str(uri), timeout_s=5.0):
        raise InputError(f"no MLflow server answers at {uri} (tracking.tracking_uri / --tracking-uri): start one "
                         "with `aepo ui`, or check the host and port", code=EXIT_FAILED)
    problem = unreadable_sqlite_store(uri or tracking_uri_for(runs))
    if problem is not None:
        raise InputError(f"the MLflow store is not a readable SQLite database ({problem}): move it aside (a new one "
                         "is then created) or restore it from a copy; nothing was written")


def reading_tracking_uri(runs: Path, tracking_uri: str | None, required: bool = True) -> str | None:
    """The tracking URI a reading command uses: ``tracking_uri`` (checked: a server must answer), else the runs
    dir's SQLite store, which must exist (``required=False``: None where it does not)."""
    from infra.tracking.client import tracking_uri_for

    check_tracking_store(tracking_uri, runs)
    uri = tracking_uri or tracking_uri_for(runs)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        if not required and tracking_uri is None:
            return None
        raise InputError(f"no MLflow store at {uri} (nothing has run with --runs-dir {runs} yet)")
    return uri
