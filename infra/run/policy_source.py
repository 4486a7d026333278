"""Which policy an evaluation (or a rollout study) reads, with which config, and the MLflow run it records in.

A policy is a checkpoint directory (``step-NNNNNN``, a run's checkpoint folder or a run name's, local or
``s3://…``), a registered policy version (``models:/<name>/<version>``, ``/latest`` or ``@<alias>``, downloaded
under ``<runs_dir>/cache/models``), or neither: the configured model. The config to evaluate with is the given one,
else the checkpoint's own (a registered policy's: its training run's), else the defaults; then the dotted overrides
and the dataset list. ``aepo eval`` locates the policy before it starts the flow (bad input exits 2 without a
server), and the flow locates it again from what the CLI hands on (:attr:`PolicySource.reference`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from aepo_core.config import ExperimentConfig, StorageConfig
from aepo_core.config_keys import ConfigError
from aepo_core.overrides import build_config
from infra.fs import StorageError
from infra.numerics import Numerics
from infra.run.checkpoints import CheckpointError, checkpoint_config, checkpoint_source, find_checkpoint
from infra.run.runtime import PolicyRuntime
from infra.tracking.client import RunOrigin
from infra.tracking.registry import (
    RegisteredPolicy,
    RegistryError,
    fetch_registered,
    is_registered_model,
    link_model,
)
from infra.tracking.run import Tracker

MODEL_CACHE = Path("cache") / "models"
"""Under the runs dir: the downloaded copies of registered policies, ``<name>/<version>/``."""

POLICY_ERRORS = (ConfigError, CheckpointError, StorageError, RegistryError)
"""What locating a policy raises for the user's input (a bad config, checkpoint, storage or registered model)."""


def _given_tree(config: ExperimentConfig | None) -> dict[str, object] | None:
    return config.to_dict() if config is not None else None


def resolve_eval_config(config: ExperimentConfig | None, checkpoint: Path | None, overrides: Sequence[str] | None,
                        datasets: Sequence[str] | None, registered: RegisteredPolicy | None = None
                        ) -> ExperimentConfig:
    """The config to evaluate with: the given one, else the checkpoint's own (a registered policy's: its training
    run's), else the defaults; then the dotted overrides and the dataset list."""
    tree = _given_tree(config)
    if tree is None and registered is not None:
        tree = dict(registered.config)
    if tree is None:
        tree = checkpoint_config(checkpoint) if checkpoint is not None else {}
    cfg = build_config(tree, list(overrides or []), source="evaluate parameters")
    if datasets:
        cfg = build_config(cfg.to_dict(), {"eval.datasets": list(datasets)}, source="evaluate datasets")
    return cfg


def _locating_config(config: ExperimentConfig | None, overrides: Sequence[str] | None) -> ExperimentConfig:
    """The config a checkpoint or registered policy is found with, before its own config is known: the given
    config (the defaults without one) with the ``storage.…`` and ``tracking.…`` overrides."""
    sets = [o for o in overrides or [] if o.startswith(("storage.", "tracking."))]
    return build_config(_given_tree(config) or {}, sets, source="evaluate storage")


def eval_storage(config: ExperimentConfig | None, overrides: Sequence[str] | None) -> StorageConfig:
    """The storage a checkpoint is read with (e.g. ``storage.s3_endpoint_url``): :func:`_locating_config`'s."""
    return _locating_config(config, overrides).storage


def fetch_registered_policy(uri: str, config: ExperimentConfig | None, overrides: Sequence[str] | None,
                            runs_dir: str | os.PathLike[str]) -> RegisteredPolicy:
    """A registered policy version (``models:/<name>/<version>``) from the registry of the given config's tracking
    URI (default: the runs dir's store), downloaded under ``<runs_dir>/cache/models``."""
    tracker = Tracker.from_config(_locating_config(config, overrides), runs_dir, system_metrics=False)
    return fetch_registered(tracker, uri, Path(runs_dir) / MODEL_CACHE)


def resolve_checkpoint(path: str | os.PathLike[str] | None, storage: StorageConfig | None = None,
                       runs_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """A checkpoint directory (``step-NNNNNN``), a run's checkpoint folder or a run name's holding one run (its
    newest complete checkpoint), local or remote (``s3://…``, read through a verified copy under
    ``<runs_dir>/cache/checkpoints``): a local directory."""
    return find_checkpoint(path, storage, runs_dir) if path is not None else None


@dataclass(frozen=True)
class LoadedPolicy:
    """The policy as loaded into a runtime: the step it was trained to (0: the configured model) and the training
    run that wrote it (None: unknown or none)."""

    step: int
    trained_by: str | None


@dataclass(frozen=True)
class PolicySource:
    """What an evaluation reads: ``cfg``, and a local checkpoint directory, a registered policy or neither.

    ``asked`` is the checkpoint as given; ``source`` what the evaluation records as its checkpoint (the registered
    version's ``models:/`` URI, the checkpoint's :func:`~infra.run.checkpoints.checkpoint_source`, or None: the
    configured model)."""

    cfg: ExperimentConfig
    asked: str | None
    checkpoint: Path | None
    registered: RegisteredPolicy | None

    @property
    def source(self) -> str | None:
        if self.registered is not None:
            return self.registered.uri
        return checkpoint_source(self.asked, self.checkpoint)

    @property
    def reference(self) -> str | None:
        """What the flow locates the same policy from: a registered model as asked (its alias resolved there
        again), else :attr:`source`."""
        return self.asked if self.registered is not None else self.source

    def describe(self) -> str:
        """What is evaluated, in words: the source, else the configured model's name."""
        return self.source or self.cfg.model.name

    def load(self, runtime: PolicyRuntime) -> LoadedPolicy:
        """The policy's weights into ``runtime`` (a registered policy's with the system prompt it carries)."""
        if self.checkpoint is not None:
            state = runtime.load_checkpoint_weights(self.checkpoint)
            return LoadedPolicy(state.step, state.run_id)
        if self.registered is not None:
            runtime.load_policy_weights(self.registered.local_dir, self.registered.step, self.registered.protocol)
            return LoadedPolicy(self.registered.step, self.registered.run_id)
        return LoadedPolicy(0, None)

    def eval_tags(self, loaded: LoadedPolicy, compare_to: str | None) -> dict[str, str | int]:
        """The tags of an evaluation's MLflow run: ``kind=eval``, what it evaluated (``checkpoint``, its step, the
        training run that wrote it: ``source_run_id``) and the evaluation it is compared with."""
        return {"kind": "eval", "checkpoint": self.source or "", "checkpoint_step": loaded.step,
                "source_run_id": loaded.trained_by or "", "compare_to": compare_to or ""}

    def link(self, tracker: Tracker) -> None:
        """Record on the tracker's run that it used the registered policy (nothing for a checkpoint)."""
        if self.registered is not None:
            link_model(tracker, self.registered)


def locate_policy(config: ExperimentConfig | None, checkpoint: str | None, overrides: Sequence[str] | None,
                  datasets: Sequence[str] | None, runs_dir: Path, registry: bool = True) -> PolicySource:
    """The policy ``checkpoint`` names (see the module docstring), read with the given config's storage and
    tracking, and the config to evaluate it with; a remote checkpoint or a registered policy is fetched under
    ``runs_dir``. Without ``registry`` (the rollout study) ``checkpoint`` is a checkpoint location only."""
    registered = (fetch_registered_policy(checkpoint, config, overrides, runs_dir)
                  if registry and checkpoint is not None and is_registered_model(checkpoint) else None)
    local = resolve_checkpoint(checkpoint if registered is None else None, eval_storage(config, overrides), runs_dir)
    return PolicySource(resolve_eval_config(config, local, overrides, datasets, registered), checkpoint, local,
                        registered)


def start_side_run(cfg: ExperimentConfig, runs: Path, name: str, numerics: Numerics, tags: Mapping[str, str | int],
                   origin: RunOrigin) -> Tracker:
    """A run beside training (an evaluation, a rollout study), started in the config's tracking store (default the
    runs dir's) without system metrics: ``tags`` and the numerics' tags, the numerics as params."""
    tracker = Tracker.from_config(cfg, runs, system_metrics=False)
    tracker.start(cfg, run_name=name, tags={**tags, **numerics.tags()}, params=numerics.params(), origin=origin)
    return tracker
