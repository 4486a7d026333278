"""Where a run's checkpoints live: the one place that turns a config, a runs dir and a run into a checkpoint store.

Layout (local runs dir, or an object store through ``storage.checkpoints_uri``)::

    <root>               checkpoint.dir, else <storage.checkpoints_uri>/<run name>, else <runs_dir>/checkpoints/<name>
    <root>/<run id>/     one MLflow run's checkpoints (step-NNNNNN, see infra.training.checkpoint)
    <root>/step-NNNNNN   the layout before run ids (still resumed from, see infra.run.resume)
    <runs_dir>/cache/checkpoints[-rank<r>]/   staging of remote saves, verified local copies of remote checkpoints

The train flow, the trainer, the resume search, the evaluation flow and the CLI's storage check all ask here; the
store itself (commit protocol, remote copies) is :class:`~infra.training.checkpoint_store.CheckpointStore`, which
the flows (kept out of the training internals) get from here with its error, :class:`CheckpointError`.
"""

from __future__ import annotations

import os
from pathlib import Path

from aepo_core.config import ExperimentConfig, StorageConfig
from infra.fs import is_remote, storage_options
from infra.ranks import Ranks
from infra.training.checkpoint import CheckpointError, read_checkpoint_state
from infra.training.checkpoint_store import CheckpointStore, open_checkpoint

__all__ = ["CHECKPOINT_CACHE", "CheckpointError", "CheckpointStore", "as_store", "checkpoint_config", "checkpoint_root",
           "checkpoint_source", "checkpoint_store", "find_checkpoint", "open_checkpoints", "unkeyed_checkpoint_store"]

CHECKPOINT_CACHE = Path("cache") / "checkpoints"
"""Under the runs dir: the staging folder of remote saves and the verified local copies of remote checkpoints."""


def _checkpoint_cache(runs_dir: str | os.PathLike[str] | None) -> Path | None:
    """``<runs_dir>/cache/checkpoints``, one folder per data-parallel rank (each rank reads a resume's checkpoint)."""
    if runs_dir is None:
        return None
    rank = Ranks.current().rank
    return Path(runs_dir) / (CHECKPOINT_CACHE if rank == 0 else Path(f"{CHECKPOINT_CACHE}-rank{rank}"))


def checkpoint_root(cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], run_name: str) -> str:
    """The folder of a run name's checkpoints: ``checkpoint.dir``, else ``<storage.checkpoints_uri>/<run name>``, else
    ``<runs_dir>/checkpoints/<run name>``; local or remote (``s3://``). One subfolder per MLflow run id under it."""
    if cfg.checkpoint.dir:
        return cfg.checkpoint.dir
    if cfg.storage.checkpoints_uri:
        return f"{cfg.storage.checkpoints_uri.rstrip('/')}/{run_name}"
    return str(Path(runs_dir) / "checkpoints" / run_name)


def checkpoint_store(cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], run_name: str,
                     run_id: str) -> CheckpointStore:
    """One run's checkpoints: ``<checkpoint_root>/<MLflow run id>``. Keyed by the id, not the name (a label that the
    common "same config, ``--set algorithm.loss=…``" pattern shares between runs), so that a new run never replaces
    another run's checkpoints. The endpoint of an ``s3://`` root comes from ``storage.s3_endpoint_url``."""
    return open_checkpoints(cfg, runs_dir, f"{checkpoint_root(cfg, runs_dir, run_name).rstrip('/')}/{run_id}")


def unkeyed_checkpoint_store(cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], run_name: str
                             ) -> CheckpointStore:
    """A run name's checkpoints in the layout before run ids (``<checkpoint_root>/step-NNNNNN``), which a run started
    before the change still resumes from."""
    return open_checkpoints(cfg, runs_dir, checkpoint_root(cfg, runs_dir, run_name))


def open_checkpoints(cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], location: str) -> CheckpointStore:
    """The checkpoints at ``location``, local or remote (the endpoint of ``storage.s3_endpoint_url``; verified copies
    under ``<runs_dir>/cache/checkpoints``)."""
    return CheckpointStore(location, storage_options(cfg.storage, location), cache_dir=_checkpoint_cache(runs_dir))


def as_store(checkpoints: str | os.PathLike[str] | CheckpointStore) -> CheckpointStore:
    """A store as given, or the store of a plain directory (local, default options and cache)."""
    return checkpoints if isinstance(checkpoints, CheckpointStore) else CheckpointStore(checkpoints)


def find_checkpoint(path: str | os.PathLike[str], storage: StorageConfig | None = None,
                    runs_dir: str | os.PathLike[str] | None = None) -> Path:
    """A checkpoint directory (``step-NNNNNN``) or a run's checkpoint root (its newest complete checkpoint), local or
    remote (``s3://…``: copied into ``<runs_dir>/cache/checkpoints`` and verified there, the endpoint from
    ``storage``); a local directory either way."""
    options = storage_options(storage, str(path)) if storage is not None else None
    return open_checkpoint(path, options, cache_dir=_checkpoint_cache(runs_dir))


def checkpoint_source(location: str | None, local: Path | None) -> str | None:
    """What an evaluation records as its checkpoint: the local directory, or for a remote location the remote
    checkpoint itself (``…/step-NNNNNN``, also when ``location`` named its run's folder or its run name's). The
    verified copy mirrors the remote path (``…/<run id>/step-NNNNNN``), so its last two names complete ``location``."""
    if location is None or local is None:
        return None
    if not is_remote(location):
        return str(local)
    text = location.rstrip("/")
    last = text.rsplit("/", 1)[-1]
    if last == local.name:
        return text
    if last == local.parent.name:  # one run's folder
        return f"{text}/{local.name}"
    return f"{text}/{local.parent.name}/{local.name}"  # a run name's folder: its one run's


def checkpoint_config(path: str | os.PathLike[str]) -> dict[str, object]:
    """The resolved config a checkpoint was written with, as a plain tree (empty when it has none)."""
    return read_checkpoint_state(path).config or {}
