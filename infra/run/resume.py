"""Where ``--resume`` continues: the MLflow run of a name and its newest complete checkpoint, checked against the
config.

The search runs on rank 0 before the model loads (a wrong name, runs dir or tracking URI fails fast), reads only
checkpoint metadata, and never starts a new run: a run without a complete checkpoint resumes from step 0 in the same
MLflow run. The trainer then restores the point (:meth:`~infra.run.trainer.Trainer.resume`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from aepo_core.config import ExperimentConfig
from infra.numerics import Numerics, recorded_numerics
from infra.run.checkpoints import as_store, checkpoint_store, unkeyed_checkpoint_store
from infra.tracking.client import param_value
from infra.tracking.run import NamedRun, Tracker
from infra.training.checkpoint import CheckpointError, check_compatible, read_checkpoint_state
from infra.training.checkpoint_store import CheckpointStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePoint:
    """Where a resume continues: the MLflow run (its id also keys its checkpoints) and its newest complete checkpoint,
    checked against the config before anything is touched. ``step`` 0 and no ``path``: the run has no complete
    checkpoint (killed before the first one committed, or every one corrupt) and starts over in the same run."""

    run_id: str
    step: int
    path: Path | None
    where: str = ""
    """The store holding the checkpoint (its URI; each rank reads it from there)."""
    numerics: Numerics | None = None
    """The numerics the run started with (its ``numerics.*`` params, ``system.*`` tags): the resume computes in them
    and does not probe the machine again. None: the run recorded none (this machine's ``auto`` decides)."""


class NothingToResumeError(CheckpointError):
    """``--resume`` where the tracking store has no run of that name: nothing to continue, and starting a new run
    instead would hide a wrong name, runs dir or tracking URI."""


RUN_IDENTITY_KEYS = ("model.name", "algorithm.")
"""Params that make a run another experiment (what :func:`~infra.training.checkpoint.check_compatible` compares)."""


def _same_experiment(run: NamedRun, cfg: ExperimentConfig) -> bool:
    """Whether the run started with the config's model and algorithm (params it predates are not held against it)."""
    wanted = {k: param_value(v) for k, v in cfg.flat().items() if k.startswith(RUN_IDENTITY_KEYS)}
    return all(run.params.get(k, v) == v for k, v in wanted.items())


def run_to_resume(tracker: Tracker, cfg: ExperimentConfig, name: str) -> NamedRun:
    """The run ``--resume`` continues: of the runs called ``name``, the newest with the config's model and algorithm
    (runs of one name that differ only in ``--set algorithm.loss=…`` each resume their own), else the newest (whose
    checkpoint the compatibility check then refuses unless forced). Raises :class:`NothingToResumeError`."""
    runs = tracker.runs_named(name)
    if not runs:
        raise NothingToResumeError(nothing_to_resume(name, tracker.experiment, tracker.tracking_uri))
    return next((r for r in runs if _same_experiment(r, cfg)), runs[0])


def nothing_to_resume(name: str, experiment: str, tracking_uri: str) -> str:
    return (f"nothing to resume: no MLflow run named {name!r} in experiment {experiment!r} at {tracking_uri} "
            "(drop --resume to start a new run)")


def latest_point(checkpoints: str | os.PathLike[str] | CheckpointStore, cfg: ExperimentConfig,
                 force: bool = False) -> ResumePoint | None:
    """The newest complete checkpoint of one run's store as a resume point (None: there is none); falls back past
    corrupt checkpoints and refuses one whose model or algorithm differs from ``cfg`` (unless ``force``). A remote
    root (``s3://…``) is read through a verified local copy (``ResumePoint.path``)."""
    store = as_store(checkpoints)
    path = store.latest()
    return _checked_point(path, store, cfg, force) if path is not None else None


def _checked_point(path: Path, store: CheckpointStore, cfg: ExperimentConfig, force: bool) -> ResumePoint:
    state = read_checkpoint_state(path)
    check_compatible(state, cfg, force=force)
    return ResumePoint(state.run_id or "", state.step, path, store.uri)


def _unkeyed_point(cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], name: str, run_id: str,
                   force: bool) -> ResumePoint | None:
    """A checkpoint of the layout before run ids (``<root>/<run name>/step-NNNNNN``) if it is this run's: a run
    started before the change resumes from it (and saves under its run id from then on) instead of from step 0.
    Another run's is none of this run's business (not even its compatibility)."""
    store = unkeyed_checkpoint_store(cfg, runs_dir, name)
    path = store.latest()
    if path is None or read_checkpoint_state(path).run_id != run_id:
        return None
    return _checked_point(path, store, cfg, force)


def find_resume_point(tracker: Tracker, cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], name: str,
                      force: bool = False) -> ResumePoint:
    """Where ``--resume`` of the run called ``name`` continues (:func:`run_to_resume`, :func:`resume_point`)."""
    return resume_point(run_to_resume(tracker, cfg, name), cfg, runs_dir, name, force)


def resume_point(run: NamedRun, cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], name: str,
                 force: bool = False) -> ResumePoint:
    """Where ``--resume`` of ``run`` (called ``name``) continues: its newest complete checkpoint, or step 0 of the
    same MLflow run when it has none, never a new run."""
    store = checkpoint_store(cfg, runs_dir, name, run.run_id)
    point = latest_point(store, cfg, force) or _unkeyed_point(cfg, runs_dir, name, run.run_id, force)
    numerics = recorded_numerics(cfg, run.params, run.tags, run.run_id)
    if point is None:
        log.warning("MLflow run %s (%s, %s) has no complete checkpoint under %s: resuming it from step 0", run.run_id,
                    name, run.status, store.uri)
        return ResumePoint(run.run_id, 0, None, numerics=numerics)
    if point.run_id != run.run_id:
        raise CheckpointError(f"{point.path} belongs to MLflow run {point.run_id!r}, not to {run.run_id!r} whose "
                              "checkpoints it is filed under")
    return dataclasses.replace(point, numerics=numerics)
