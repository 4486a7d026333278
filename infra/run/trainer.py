"""The trainer of one RL run: backend, policy updater, data order and cursor, step counter, checkpoints.

Built only by the train flow, on top of a :class:`~infra.run.runtime.PolicyRuntime` (which samples and scores).
The trainer is the only owner of the step counter: it advances after each update and is restored by
:meth:`Trainer.resume`.  Every verb is deterministic given the config seed and the step, so a resumed run repeats
nothing and skips nothing: rollout seeds derive from (seed, step), the data order from (seed, epoch), and the
checkpoint holds the weights, optimizer, schedule, RNG states and data cursor.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aepo_core.config import ExperimentConfig
from aepo_core.rollout.scheduler import RolloutResult
from aepo_core.rollout.tree import RolloutTree
from aepo_core.scoring import StepScores
from infra.data.rows import QuestionRow
from infra.engines.weights import PolicyWeights
from infra.models import load_policy
from infra.ranks import Ranks
from infra.run.runtime import PolicyRuntime, checkpoint_root, checkpoint_store, open_checkpoints
from infra.tracking.client import param_value
from infra.tracking.run import NamedRun, Tracker
from infra.training.backends import FrozenBackend, TorchBackend, autocast_dtype
from infra.training.batching import samples_from_trees
from infra.training.checkpoint import CheckpointError, check_compatible, load_checkpoint, read_checkpoint_state
from infra.training.checkpoint_store import CheckpointStore
from infra.training.data_order import DataCursor, DataOrder
from infra.training.update import PolicyUpdater, TrainBackend

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


def _store(checkpoints: str | os.PathLike[str] | CheckpointStore) -> CheckpointStore:
    return checkpoints if isinstance(checkpoints, CheckpointStore) else CheckpointStore(checkpoints)


def latest_point(checkpoints: str | os.PathLike[str] | CheckpointStore, cfg: ExperimentConfig,
                 force: bool = False) -> ResumePoint | None:
    """The newest complete checkpoint of one run's store as a resume point (None: there is none); falls back past
    corrupt checkpoints and refuses one whose model or algorithm differs from ``cfg`` (unless ``force``). A remote
    root (``s3://…``) is read through a verified local copy (``ResumePoint.path``)."""
    store = _store(checkpoints)
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
    store = open_checkpoints(cfg, runs_dir, checkpoint_root(cfg, runs_dir, name))
    path = store.latest()
    if path is None or read_checkpoint_state(path).run_id != run_id:
        return None
    return _checked_point(path, store, cfg, force)


def find_resume_point(tracker: Tracker, cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], name: str,
                      force: bool = False) -> ResumePoint:
    """Where ``--resume`` of the run called ``name`` continues (:func:`run_to_resume`): its newest complete
    checkpoint, or step 0 of the same MLflow run when it has none, never a new run."""
    run = run_to_resume(tracker, cfg, name)
    store = checkpoint_store(cfg, runs_dir, name, run.run_id)
    point = latest_point(store, cfg, force) or _unkeyed_point(cfg, runs_dir, name, run.run_id, force)
    if point is None:
        log.warning("MLflow run %s (%s, %s) has no complete checkpoint under %s: resuming it from step 0", run.run_id,
                    name, run.status, store.uri)
        return ResumePoint(run.run_id, 0, None)
    if point.run_id != run.run_id:
        raise CheckpointError(f"{point.path} belongs to MLflow run {point.run_id!r}, not to {run.run_id!r} whose "
                              "checkpoints it is filed under")
    return point


def build_backend(runtime: PolicyRuntime, total_steps: int) -> TrainBackend:
    cfg = runtime.cfg
    if cfg.train.backend != "deepspeed" and Ranks.current().distributed:
        raise ValueError("train.backend=torch trains in one process: under a torchrun/deepspeed launcher use "
                         "train.backend=deepspeed, whose ranks all-reduce their gradients")
    if Ranks.current().distributed and cfg.train.sft.enabled:
        raise ValueError("train.sft.enabled: cold-start SFT runs in one process; run it before launching ranks")
    if Ranks.current().distributed and cfg.train.zero_stage == 3 and cfg.rollout.engine == "hf":
        raise ValueError("train.zero_stage=3 under several ranks needs rollout.engine=remote: the in-process engine "
                         "would generate on partitioned weights, whose every forward is a collective that the "
                         "ranks' different rollouts cannot keep in step")
    if cfg.train.backend == "deepspeed":
        from infra.training.deepspeed_backend import DeepSpeedBackend

        return DeepSpeedBackend.from_config(runtime.model, cfg.optim, cfg.train, total_steps)
    return TorchBackend(runtime.model, cfg.optim, total_steps,
                        compute_dtype=autocast_dtype(runtime.numerics.compute_dtype))


class Trainer:
    """See the module docstring.  ``run_id`` names the run in the trajectory store and the checkpoints."""

    def __init__(self, runtime: PolicyRuntime, rows: Sequence[QuestionRow], *,
                 checkpoint_dir: str | os.PathLike[str] | CheckpointStore, run_id: str) -> None:
        cfg = runtime.cfg
        self.rows = list(rows)[: cfg.data.max_questions] if cfg.data.max_questions is not None else list(rows)
        if not self.rows:
            raise ValueError(f"data.train={cfg.data.train!r} has no usable rows")
        self.runtime = runtime
        self.run_id = run_id
        self.checkpoints = _store(checkpoint_dir)
        self.rows_by_id: dict[str, QuestionRow] = {r.id: r for r in self.rows}
        """Question id → row (text, golds, dataset): trees hold token ids only."""
        self.order = DataOrder(len(self.rows), cfg.train.batch_size, cfg.seed, shuffle=cfg.data.shuffle)
        self.total_steps = cfg.train.steps or cfg.train.epochs * self.order.batches_per_epoch
        self.backend = build_backend(runtime, self.total_steps)
        ref = None
        if cfg.algorithm.kl_coef > 0:
            ref_model, _ = load_policy(cfg.model)
            ref = FrozenBackend(ref_model, autocast_dtype(runtime.numerics.compute_dtype))
        self.updater = PolicyUpdater(self.backend, cfg, pad_id=runtime.pad_id, ref_backend=ref,
                                     generation_dtype=runtime.numerics.generation_dtype)
        if not cfg.clip_active():
            log.warning("algorithm.loss=%s runs fully on-policy (optim.ppo_epochs=1, optim.mini_batch_size=%d >= "
                        "train.batch_size=%d): every ratio is 1, nothing is clipped, and every clipping loss gives the "
                        "same gradient; use several mini-batches per step for the loss choice to matter",
                        cfg.algorithm.loss, cfg.optim.mini_batch_size, cfg.train.batch_size)
        self.cursor: DataCursor = self.order.start()
        self._step = 0

    @property
    def step(self) -> int:
        """Optimizer updates done so far (RL steps; 0 before the first)."""
        return self._step

    def question_texts(self, trees: Sequence[RolloutTree]) -> dict[str, str]:
        """Question id → text of ``trees``' questions (what a trace shows as its input)."""
        return {t.question_id: self.rows_by_id[t.question_id].question for t in trees}

    def next_batch(self) -> list[QuestionRow]:
        """The rows of the next step; advances the data cursor."""
        indices, self.cursor = self.order.next_batch(self.cursor)
        return [self.rows[i] for i in indices]

    def update(self, result: RolloutResult, scores: StepScores) -> dict[str, float]:
        """One policy update on the step's scored trees (uninformative groups left out); the engine then samples
        from the new weights."""
        trees, leaf_scores = scores.kept(result.trees)
        metrics = self.updater.update(samples_from_trees(trees, leaf_scores))
        self._step += 1
        self.runtime.weights_changed(self.weights())
        return metrics

    def weights(self) -> PolicyWeights:
        return PolicyWeights(self.runtime.model, self._step, self.backend.full_state_dict)

    @property
    def ranks(self) -> Ranks:
        """The backend's data-parallel ranks (one process: ``Ranks(0, 1)``)."""
        return self.backend.ranks

    def save(self) -> str:
        """An atomic checkpoint of everything a bit-identical resume needs; returns where it is (a local directory
        or a remote URL, see :class:`~infra.training.checkpoint_store.CheckpointStore`).

        Under several ranks every rank calls it: the optimizer state (each rank's ZeRO partition, gathered to
        rank 0) and under ZeRO-3 the full weights are collectives; rank 0 alone writes and commits the checkpoint,
        and every rank returns its location once it is committed.
        """
        optimizer, scheduler = self.backend.checkpoint_state()
        saved_optimizer = _Saved(optimizer.state_dict()) if optimizer is not None else None  # collective
        weights = self.backend.full_state_dict()  # collective under ZeRO-3
        rt = self.runtime
        path = None
        if self.ranks.is_main:
            path = self.checkpoints.save(
                self._step, model=rt.model, tokenizer=rt.tokenizer, config=rt.cfg,
                optimizer=saved_optimizer, scheduler=scheduler, data_cursor=self.cursor, run_id=self.run_id,
                extra={"order": self.order.state_dict(), "world_size": self.ranks.world_size},
                keep=rt.cfg.checkpoint.keep, state_dict=weights,
            )
        return str(self.ranks.broadcast(str(path)))

    def resume(self, path: Path, force: bool = False) -> int:
        """Restore the checkpoint at ``path`` (a :class:`ResumePoint`'s): weights, optimizer, schedule, RNG streams,
        data cursor; returns its step. Every rank reads the checkpoint and takes its own optimizer partition (same
        world size as the save)."""
        optimizer, scheduler = self.backend.checkpoint_state()
        model = None if self.backend.weights_from_optimizer_state else self.runtime.model
        state = load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler,
                                config=self.runtime.cfg, force=force)
        saved_order = state.extra.get("order")
        if saved_order is not None:
            self.order.check_resumable(saved_order)
        self._step = state.step
        self.cursor = state.data_cursor or self.order.start()
        self.runtime.weights_changed(self.weights())
        log.info("resumed %s at step %d (data cursor %s)", path, self._step, self.cursor)
        return self._step


class _Saved:
    """A state captured before the single writer runs (a collective on every rank), as ``Stateful``."""

    def __init__(self, state: dict[str, object]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, object]:
        return self._state

    def load_state_dict(self, state: dict[str, object]) -> None:
        raise TypeError("a saved snapshot is not loaded into")
