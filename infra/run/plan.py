"""What a training run is, decided once (:func:`plan_run`) from the config and the command's options: its runs dir,
that it can train on the launcher's ranks, its name, the MLflow run ``--resume`` continues and the numerics it
computes in. ``aepo train`` plans for its early checks (exit 2 before anything is created), the ``aepo-train`` flow
for the run it opens (:func:`infra.run.session.open_run`).

Light at import (no MLflow, no Prefect): the command plans before it sets up the environment those libraries read
once at import (:mod:`flows.cli.environment`); the tracking store is opened only to find a run to resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aepo_core.config import ExperimentConfig
from aepo_core.config_keys import ConfigError
from infra.numerics import DeviceFacts, Numerics, recorded_numerics
from infra.ranks import Ranks
from infra.run.preflight import InputError, check_not_running, resolve_runs_dir
from infra.run.runtime import planned_numerics
from infra.tracking.client import resolve_tracking

if TYPE_CHECKING:
    from infra.tracking.run import NamedRun, Tracker


@dataclass(frozen=True)
class RunPlan:
    """What a training run is, decided once from the config and the command's options."""

    cfg: ExperimentConfig
    """The config as given: its hash is the run's identity (a sweep finds its finished cells by it), so the runs dir
    a flow is given is not written into it (the CLI records its own, :func:`~infra.run.preflight.with_runs_dir`)."""
    runs: Path
    name: str
    ranks: Ranks
    """The launcher's data-parallel ranks (the process group itself starts with the DeepSpeed backend)."""
    resume: NamedRun | None = None
    """Rank 0, ``--resume``: the MLflow run it continues (:func:`~infra.run.resume.run_to_resume`); else None."""
    resuming: bool = False
    force_resume: bool = False
    machine: DeviceFacts | None = None
    """The device facts a sweep decided its ``auto`` numerics from, the same for every cell; None: this machine's."""

    @property
    def is_main(self) -> bool:
        return self.ranks.is_main

    def numerics(self) -> Numerics:
        """The dtypes the run computes in: a resumed run's own (recorded at its start: it does not probe the machine
        again), else ``auto`` resolved for the sweep's machine or this one
        (:func:`~infra.run.runtime.planned_numerics`)."""
        if self.resume is not None:
            recorded = recorded_numerics(self.cfg, self.resume.params, self.resume.tags, self.resume.run_id)
            if recorded is not None:
                return recorded
        return planned_numerics(self.cfg, self.machine)

    def mlflow(self) -> Tracker | None:
        """Rank 0's MLflow run (it alone records); None on the other ranks."""
        from infra.tracking.run import Tracker

        return Tracker.from_config(self.cfg, self.runs) if self.is_main else None


def plan_run(cfg: ExperimentConfig, runs_dir: str | None, run_name: str | None = None, *, resume: bool = False,
             force_resume: bool = False, machine: Mapping[str, Any] | None = None) -> RunPlan:
    """Decide the run: its runs dir (:func:`~infra.run.preflight.resolve_runs_dir`), that the config trains on the
    launcher's world size, its name, and with ``resume`` (rank 0 alone asks; the others follow its choice) the MLflow
    run it continues. ``machine``: a sweep's device facts (``DeviceFacts.as_dict``). Raises
    :class:`~infra.run.preflight.InputError` on a config that cannot train or nothing to resume, before the model
    loads or anything is created (not even an MLflow store)."""
    ranks = Ranks.current()
    try:
        cfg.check_trainable(world_size=ranks.world_size)
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    runs = resolve_runs_dir(runs_dir, cfg.storage.runs_dir)
    name = cfg.run_name_for(run_name)
    found = _run_to_resume(cfg, runs, name) if resume and ranks.is_main else None
    return RunPlan(cfg, runs, name, ranks, found, resume, force_resume,
                   DeviceFacts.from_dict(machine) if machine else None)


def _run_to_resume(cfg: ExperimentConfig, runs: Path, name: str) -> NamedRun:
    from infra.run.resume import NothingToResumeError, nothing_to_resume, run_to_resume
    from infra.tracking.run import Tracker

    uri, _ = resolve_tracking(cfg, runs)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise InputError(f"--resume: {nothing_to_resume(name, cfg.tracking.experiment, uri)}")  # no store yet
    try:
        return run_to_resume(Tracker.from_config(cfg, runs), cfg, name)
    except NothingToResumeError as exc:
        raise InputError(f"--resume: {exc}") from None


def check_plan(plan: RunPlan) -> None:
    """The CLI's early no for a resume: the run must not be trained by another live process, and its stored
    trajectory parts must read (a damaged part would stay in the run's trajectories, unread until someone analyses
    them). :class:`~infra.run.preflight.InputError`."""
    from infra.store import StoreError, TrajectoryStore

    if plan.resume is None:
        return
    check_not_running(plan.runs, run_id=plan.resume.run_id)
    try:
        TrajectoryStore.from_config(plan.cfg.storage, runs_dir=plan.runs).check_parts(plan.resume.run_id)
    except StoreError as exc:
        raise InputError(f"--resume: {exc}; move it away to resume (a step after the last checkpoint is then sampled "
                         "again, an earlier one stays missing from the trajectories)") from None
