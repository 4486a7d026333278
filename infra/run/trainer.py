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
from pathlib import Path

import torch

from aepo_core.config import ExperimentConfig
from aepo_core.cost import Spend, cost_metrics, tool_calls_by_tool
from aepo_core.rollout.scheduler import RolloutResult
from aepo_core.rollout.tree import RolloutTree
from aepo_core.scoring import LeafScore
from infra.data.rows import QuestionRow
from infra.engines.weights import PolicyWeights
from infra.models import load_policy
from infra.numerics import Numerics, autocast_dtype
from infra.ranks import Ranks
from infra.run.checkpoints import as_store
from infra.run.runtime import PolicyRuntime
from infra.training.backend import TrainBackend
from infra.training.backends import FrozenBackend, TorchBackend
from infra.training.batching import samples_from_trees
from infra.training.checkpoint import load_checkpoint
from infra.training.checkpoint_store import CheckpointStore
from infra.training.data_order import DataCursor, DataOrder
from infra.training.update import MicroBatchObserver, PolicyUpdater

log = logging.getLogger(__name__)


def build_backend(cfg: ExperimentConfig, model: torch.nn.Module, numerics: Numerics, total_steps: int
                  ) -> TrainBackend:
    """The configured training backend over ``model`` (torch in one process, or DeepSpeed)."""
    if cfg.train.backend != "deepspeed" and Ranks.current().distributed:
        raise ValueError("train.backend=torch trains in one process: under a torchrun/deepspeed launcher use "
                         "train.backend=deepspeed, whose ranks all-reduce their gradients")
    if Ranks.current().distributed and cfg.train.sft.enabled:
        raise ValueError("train.sft.enabled: cold-start SFT runs in one process; run it before launching ranks")
    cfg.check_ranks(Ranks.current().world_size)  # ZeRO-3: no forward of the training model in the rollout
    if cfg.train.backend == "deepspeed":
        from infra.training.deepspeed_backend import DeepSpeedBackend

        return DeepSpeedBackend.from_config(model, cfg.optim, cfg.train, total_steps)
    return TorchBackend(model, cfg.optim, total_steps, compute_dtype=autocast_dtype(numerics.compute_dtype))


def build_updater(cfg: ExperimentConfig, backend: TrainBackend, numerics: Numerics, pad_id: int,
                  observer: MicroBatchObserver | None = None) -> PolicyUpdater:
    """The policy updater over ``backend``, with a frozen reference model when the KL term is on (``observer``: see
    :class:`PolicyUpdater`)."""
    ref = None
    if cfg.algorithm.kl_coef > 0:
        ref_model, _ = load_policy(cfg.model)
        ref = FrozenBackend(ref_model, autocast_dtype(numerics.compute_dtype))
    return PolicyUpdater(backend, cfg, pad_id=pad_id, ref_backend=ref, numerics=numerics,
                         observer=observer)


def training_rows(cfg: ExperimentConfig, rows: Sequence[QuestionRow]) -> list[QuestionRow]:
    """The rows a run of ``cfg`` trains on: the first ``data.max_questions`` (all when None)."""
    return list(rows)[: cfg.data.max_questions] if cfg.data.max_questions is not None else list(rows)


def data_order(cfg: ExperimentConfig, rows: int) -> DataOrder:
    """The order in which a run of ``cfg`` draws its batches from ``rows`` training rows."""
    return DataOrder(rows, cfg.train.batch_size, cfg.seed, shuffle=cfg.data.shuffle)


def total_steps(cfg: ExperimentConfig, order: DataOrder) -> int:
    """The run's RL steps: ``train.steps``, else ``train.epochs`` passes over the data order's batches."""
    return cfg.train.steps or cfg.train.epochs * order.batches_per_epoch


class Trainer:
    """See the module docstring.  ``run_id`` names the run in the trajectory store and the checkpoints."""

    def __init__(self, runtime: PolicyRuntime, rows: Sequence[QuestionRow], *,
                 checkpoint_dir: str | os.PathLike[str] | CheckpointStore, run_id: str) -> None:
        cfg = runtime.cfg
        self.rows = training_rows(cfg, rows)
        if not self.rows:
            raise ValueError(f"data.train={cfg.data.train!r} has no usable rows")
        self.runtime = runtime
        self.run_id = run_id
        self.checkpoints = as_store(checkpoint_dir)
        self.rows_by_id: dict[str, QuestionRow] = {r.id: r for r in self.rows}
        """Question id → row (text, golds, dataset): trees hold token ids only."""
        self.order = data_order(cfg, len(self.rows))
        self.total_steps = total_steps(cfg, self.order)
        self.backend = build_backend(cfg, runtime.model, runtime.numerics, self.total_steps)
        self.updater = build_updater(cfg, self.backend, runtime.numerics, runtime.pad_id)
        if not cfg.clip_active():
            log.warning("algorithm.loss=%s runs fully on-policy (optim.ppo_epochs=1, optim.mini_batch_size=%d >= "
                        "train.batch_size=%d): every ratio is 1, nothing is clipped, and every clipping loss gives the "
                        "same gradient; use several mini-batches per step for the loss choice to matter",
                        cfg.algorithm.loss, cfg.optim.mini_batch_size, cfg.train.batch_size)
        self.cursor: DataCursor = self.order.start()
        self._step = 0
        self.spent = Spend()
        """The run's spend through the last step (:mod:`aepo_core.cost`); checkpointed, so a resumed run goes on."""

    @property
    def step(self) -> int:
        """Optimizer updates done so far (RL steps; 0 before the first)."""
        return self._step

    def question_rows(self, trees: Sequence[RolloutTree]) -> dict[str, QuestionRow]:
        """Question id → row of ``trees``' questions (a trace's inputs: the text and the gold answers)."""
        return {t.question_id: self.rows_by_id[t.question_id] for t in trees}

    def question_texts(self, trees: Sequence[RolloutTree]) -> dict[str, str]:
        """Question id → text of ``trees``' questions (a trajectory sample's column)."""
        return {qid: row.question for qid, row in self.question_rows(trees).items()}

    def next_batch(self) -> list[QuestionRow]:
        """The rows of the next step; advances the data cursor."""
        indices, self.cursor = self.order.next_batch(self.cursor)
        return [self.rows[i] for i in indices]

    def update(self, trees: Sequence[RolloutTree], scores: Sequence[Sequence[LeafScore]]) -> dict[str, float]:
        """One policy update on the groups of the step's batch (:attr:`FilledBatch.trees
        <aepo_core.dynamic_sampling.FilledBatch.trees>`: informative ones, their advantages over exactly them) and
        their leaves' scores; the engine then samples from the new weights — on-policy. Under
        ``train.max_staleness`` > 0 the engine may be sampling a later step from older weights meanwhile: the flow
        hands it new ones when it is idle."""
        metrics = self.updater.update(samples_from_trees(trees, scores))
        self._step += 1
        if not self.runtime.cfg.train.max_staleness:
            self.runtime.weights_changed(self.weights())
        return metrics

    def account(self, rounds: Sequence[RolloutResult], rollout_cpu_s: float, update_cpu_s: float,
                rollout_wall_s: float, update_wall_s: float) -> dict[str, float]:
        """Add one step's spend to the run's and return both as ``cost/…`` metrics: ``rounds`` are every rollout
        of the step (DAPO refills included; tokens already summed over ranks), the seconds this rank's. Every rank
        calls it (CPU and GPU seconds are summed over ranks, a collective)."""
        per_rank = self.ranks.all_gather((rollout_cpu_s, update_cpu_s,
                                          self.runtime.gpus * (rollout_wall_s + update_wall_s)))
        step = Spend(generated_tokens=sum(r.stats.get("tokens_generated", 0.0) for r in rounds),
                     prompt_tokens=sum(r.stats.get("prompt_tokens", 0.0) for r in rounds),
                     tool_calls=tool_calls_by_tool([t for r in rounds for t in r.trees], sorted(self.runtime.tools)),
                     rollout_cpu_s=sum(c[0] for c in per_rank), update_cpu_s=sum(c[1] for c in per_rank),
                     gpu_s=sum(c[2] for c in per_rank))
        self.spent = self.spent + step
        return cost_metrics(step, self.spent)

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
                extra={"order": self.order.state_dict(), "world_size": self.ranks.world_size,
                       "spent": self.spent.state_dict()},
                keep=rt.cfg.checkpoint.keep, state_dict=weights,
            )
        return str(self.ranks.broadcast(str(path)))

    def resume(self, path: Path, force: bool = False) -> int:
        """Restore the checkpoint at ``path`` (a :class:`~infra.run.resume.ResumePoint`'s): weights, optimizer,
        schedule, RNG streams, data cursor; returns its step. Every rank reads the checkpoint and takes its own
        optimizer partition (same world size as the save)."""
        optimizer, scheduler = self.backend.checkpoint_state()
        model = None if self.backend.weights_from_optimizer_state else self.runtime.model
        state = load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler,
                                config=self.runtime.cfg, force=force)
        saved_order = state.extra.get("order")
        if saved_order is not None:
            self.order.check_resumable(saved_order)
        self._step = state.step
        self.cursor = state.data_cursor or self.order.start()
        spent = state.extra.get("spent")
        if spent is None and self._step > 0:
            log.warning("checkpoint %s predates the run's spend: the cost/total_* metrics count from step %d on",
                        path, self._step + 1)
        self.spent = Spend.from_state_dict(spent) if isinstance(spent, dict) else Spend()
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
