"""A training run composed once: :func:`~infra.run.plan.plan_run` decides what the run is, :func:`open_run` opens
what it writes to.

Before, ``aepo train`` and the ``aepo-train`` flow each decided the runs dir, trainability and the run to resume
(the CLI for its early exit code 2, the flow for itself), in two spellings. Now both call
:func:`~infra.run.plan.plan_run`: the CLI for its early checks (:func:`~infra.run.plan.check_plan`), the flow for the
run itself (a deployment's flow run has no CLI in front of it, so the flow plans again from its parameters; the
decisions are the same function's).

:func:`open_run` then, in order: claims the run (one live process per run, :mod:`infra.run.lock`), builds the
runtime (policy, engine, tools) in the plan's numerics, reads the evaluation datasets (a bad row fails before an
MLflow run exists), starts or reopens the MLflow run, opens its checkpoints and trajectory store, builds the trainer
and restores the resume point on every rank. What it yields, :class:`RunSession`, is what a flow orchestrates with.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from aepo_core.activity import ACTIVITY_METRICS, idle_mechanisms
from aepo_core.config import ExperimentConfig
from aepo_core.cost import COST_PREFIX, TOTAL
from aepo_core.dynamic_sampling import FilledBatch
from aepo_core.evaluation import EvalSummary, PairedDiff
from aepo_core.rollout.tree import RolloutTree
from aepo_core.scoring import LeafScore
from infra.data.rows import QuestionRow
from infra.plots import curves_figure, rollout_tree_figure
from infra.run.checkpoints import CheckpointError, CheckpointStore, checkpoint_store, open_checkpoints
from infra.run.evaluation import EvalReport, EvalSource, ResultsDir, recorded_pass1
from infra.run.lock import Claims
from infra.run.plan import RunPlan
from infra.run.records import check_eval_datasets, dataset_record, log_eval_traces
from infra.run.resume import ResumePoint, resume_point
from infra.run.runtime import PolicyRuntime, build_runtime
from infra.run.start_evaluation import START_STAGES, SharedStart
from infra.run.trainer import Trainer
from infra.store import TrajectoryStore
from infra.tracking.client import RunOrigin
from infra.tracking.registry import PolicyProvenance, log_model, register_model
from infra.tracking.run import RankTracker, RunLogger, Tracker

log = logging.getLogger(__name__)

CURVE_METRICS = ("rollout/reward_mean", "rollout/accuracy", "train/entropy_mean", "rollout/delta_h_mean",
                 "rollout/branch_samples", "rollout/max_branches_per_path", "train/loss", "train/clip_frac_high")
"""The run's curves (``plots/curves.png``), beside each evaluated dataset's Pass@1."""
TOKENS_SPENT = f"{COST_PREFIX}{TOTAL}generated_tokens"
"""The x of the curves against the run's budget (:mod:`aepo_core.cost`)."""

BEFORE_SFT = "eval_start"
"""The metric prefix of the evaluation before cold-start SFT. ``eval/…`` is the RL curve, one point per step: at
step 0 the policy RL starts from (the SFT policy when SFT runs), so the start evaluation gets its own names
instead of a second point at step 0 (every eval chart began with a vertical segment)."""


@dataclass
class RunSession:
    """An open training run: what the flow orchestrates with (:func:`open_run`)."""

    plan: RunPlan
    runtime: PolicyRuntime
    trainer: Trainer
    tracker: RunLogger
    """What every rank logs through: rank 0's MLflow run, on the others a logger that records nothing."""
    mlflow: Tracker | None
    """Rank 0's MLflow run itself (its history, its model); None on the other ranks."""
    trajectories: TrajectoryStore
    checkpoints: CheckpointStore
    run_id: str
    run_url: str | None
    resumed: bool
    """Resumed past step 0 (the start and post-SFT evaluations and the SFT are not repeated)."""
    shared_starts: dict[str, SharedStart] = field(default_factory=dict)
    """The start stages evaluated so far, each with its weights' digest (:mod:`infra.run.start_evaluation`)."""

    @property
    def cfg(self) -> ExperimentConfig:
        return self.plan.cfg

    @property
    def is_main(self) -> bool:
        return self.plan.is_main

    def results_dir(self, stage: str) -> ResultsDir:
        """Where the evaluation stage ``stage`` (start, sft, stepN, final) writes its per-question files, under
        ``<eval results>/<run name>/<stage>/`` (and a resumed run reads them back)."""
        return ResultsDir.of(self.cfg.storage, self.plan.runs, f"{self.plan.name}/{stage}")

    def recorded_pass1(self, stage: str) -> dict[str, dict[str, float]]:
        """Per dataset, the per-question Pass@1 the stage ``stage`` wrote (empty: it never ran)."""
        return recorded_pass1(self.results_dir(stage), self.cfg.storage, self.runtime.eval_datasets())

    def stage_report(self, stage: str, dataset: str, source: EvalSource, compute: Callable[[], EvalReport]
                     ) -> EvalReport:
        """The evaluation of ``dataset`` at ``stage``: ``compute()``, except that a start stage (start, sft) under
        ``eval.reuse_start`` reads back a stored evaluation of the same weights under the same settings when one is
        there, and stores its own otherwise (:class:`~infra.run.start_evaluation.SharedStart`); the run is then
        tagged ``start_eval/<stage>/<dataset key>/key`` and, when read back, ``.../reused_from`` (the run that
        sampled it). Not with ``rollout.engine=remote``: the server's weights are not this process's to digest."""
        if stage not in START_STAGES or not self.cfg.eval.reuse_start or self.cfg.rollout.engine == "remote":
            return compute()
        if stage not in self.shared_starts:
            self.shared_starts[stage] = SharedStart.of(self.runtime, self.plan.runs)
            log.info("start evaluation %s: weights digest %s in %.2f s", stage, self.shared_starts[stage].weights,
                     self.shared_starts[stage].digest_s)
        out = self.shared_starts[stage].evaluate(dataset, source, stage, compute)
        tag = f"start_eval/{stage}/{out.report.key}"
        reused = {f"{tag}/reused_from": out.reused_from.line()} if out.reused_from is not None else {}
        if self.mlflow is not None:
            self.mlflow.set_tags({f"{tag}/key": out.key, **reused})
        if reused:
            log.info("%s evaluation of %s read back from run %s (key %s): not sampled again", stage, out.report.key,
                     reused[f"{tag}/reused_from"], out.key)
        return out.report

    def log_evaluation(self, report: EvalReport, step: int, stage: str, prefix: str) -> None:
        """One evaluated dataset: metrics at ``step`` under ``prefix``, the kept samples as traces (flushed: the
        per-question file written next makes the stage done, and a resume will not log its traces again), the full
        report as JSON."""
        self.tracker.log_metrics(report.metrics(prefix), step)
        log_eval_traces(self.tracker, report, step, stage)
        self.tracker.flush_traces()
        self.tracker.log_dict(report.as_dict(), f"eval/{stage}/{report.key}.json")

    def log_step(self, step: int, batch: FilledBatch, metrics: Mapping[str, float]) -> None:
        """One RL step's record: on rank 0 what a reader opens for it (:meth:`_log_step_views`), the first
        ``tracking.traces_per_step`` sampled trees as traces, and its metrics (the batch's ``rollout/…`` beside
        ``metrics``: the update's, the spend, the phase times)."""
        sampled = batch.sampled
        if self.is_main:
            self._log_step_views(step, sampled.trees, batch.sampled_scores.leaves)
        n = self.cfg.tracking.traces_per_step
        self.tracker.log_rollout_traces(sampled.trees[:n], batch.sampled_scores.leaves[:n], step=step, kind="train",
                                        label=f"step{step}", questions=self.trainer.question_rows(sampled.trees[:n]))
        self.tracker.log_metrics({**batch.metrics(), **metrics}, step)

    def _log_step_views(self, step: int, trees: Sequence[RolloutTree], scores: Sequence[Sequence[LeafScore]]) -> None:
        """The rollout tree of the step's question that branched most (``plots/rollout_tree/step-000003.png``) and a
        sample of its trajectories (``trajectories/step_000003.json``). Before, only the last step had them."""
        i = max(range(len(trees)), key=lambda j: sum(n.branched for n in trees[j].nodes))
        self.tracker.log_figure(rollout_tree_figure(trees[i], title=f"{trees[i].question_id} (step {step})",
                                                    scores=scores[i]), f"plots/rollout_tree/step-{step:06d}.png")
        self.tracker.log_trajectory_sample(trees, scores, max_rows=16, step=step,
                                           questions=self.trainer.question_texts(trees))

    def idle_mechanisms(self) -> list[str]:
        """Rank 0: the mechanisms the config turned on that barely acted in this run
        (:func:`~aepo_core.activity.idle_mechanisms` of its activity metrics' means over its steps)."""
        if not self.is_main or self.mlflow is None:
            return []
        history = self.mlflow.metric_history(list(ACTIVITY_METRICS))
        return idle_mechanisms({k: sum(v for _, v in points) / len(points) for k, points in history.items() if points},
                               self.cfg)

    def record_outcome(self, final: Mapping[str, EvalSummary],
                       comparisons: Mapping[str, Mapping[str, PairedDiff]]) -> str | None:
        """Rank 0, at the end: the paired comparisons as metrics, the run's curves (``plots/curves.png``, against
        steps and against generated tokens), and with ``tracking.log_model`` the final policy logged and registered.
        Returns the registered version's URI (None: not registered; always on the other ranks)."""
        if not self.is_main or self.mlflow is None:
            return None
        step = self.trainer.step
        for cmp_name, by_ds in comparisons.items():
            self.mlflow.log_metrics({f"eval/{ds}/{cmp_name}_{key}": value
                                     for ds, c in by_ds.items() for key, value in c.as_dict().items()}, step)
        pass1 = [f"eval/{ds}/pass_at_1" for ds in final]
        history = self.mlflow.metric_history([*CURVE_METRICS, *pass1, TOKENS_SPENT])
        tokens = dict(history.pop(TOKENS_SPENT))
        self.mlflow.log_figure(curves_figure({k: v for k, v in history.items() if v}, title=self.plan.name,
                                             tokens=tokens), "plots/curves.png")
        return self._log_policy(self.mlflow, final, step) if self.cfg.tracking.log_model else None

    def _log_policy(self, mlflow: Tracker, final: Mapping[str, EvalSummary], step: int) -> str | None:
        """Log the final policy with its agent protocol; register it under ``tracking.registered_model`` (with the
        final evaluation metrics as version tags). Returns the registered version's URI, None when not registered."""
        cfg, runtime = self.cfg, self.runtime
        logged = log_model(mlflow, runtime.model, runtime.tokenizer, step, name="policy",
                           protocol=runtime.protocol)
        if not cfg.tracking.registered_model:
            return None
        metrics = {f"eval/{ds}/{key}": value for ds, summary in final.items()
                   for key, value in summary.as_dict().items()}
        provenance = PolicyProvenance(cfg.algorithm.loss, cfg.rollout.mode, cfg.model.name, cfg.seed,
                                      cfg.config_hash(), f"eval/{next(iter(final), 'none')}/pass_at_1")
        return register_model(mlflow, logged, cfg.tracking.registered_model, metrics, step,
                              run_description(cfg), provenance)

    def log_eval_file(self, stage: str, key: str) -> None:
        """The per-question file of dataset ``key`` the stage wrote, as a run artifact under ``eval/<stage>``."""
        self.tracker.log_artifact(self.results_dir(stage).local_file(key), f"eval/{stage}")


def run_description(cfg: ExperimentConfig) -> str:
    """The MLflow run's description: what was trained, how, on what."""
    return (f"AEPO training run: {cfg.model.name} trained with the {cfg.algorithm.loss} loss on {cfg.rollout.mode} "
            f"rollouts of {cfg.data.train}, {cfg.train.steps} RL steps of {cfg.train.batch_size} questions, "
            f"seed {cfg.seed}.")


@contextlib.contextmanager
def open_run(plan: RunPlan, rows: Sequence[QuestionRow], origin: RunOrigin, *, parent_run_id: str | None = None,
             tags: Mapping[str, str] | None = None) -> Iterator[RunSession]:
    """Open the planned run (the module's docstring says in what order) and close it however the body ends: the
    MLflow run finished or failed, a managed vLLM server stopped, the run's lock released."""
    cfg, runs = plan.cfg, plan.runs
    mlflow = plan.mlflow()
    tracker: RunLogger = mlflow if mlflow is not None else RankTracker(plan.ranks.rank)
    # Rank 0 finds the resume point before the model loads: a wrong config or a damaged checkpoint fails fast.
    point = (resume_point(plan.resume, cfg, runs, plan.name, force=plan.force_resume)
             if plan.resume is not None else None)
    claims = Claims(runs if plan.is_main else None, run_id=point.run_id if point else None)
    with claims, build_runtime(cfg, runs, plan.name, plan.numerics()) as runtime:
        datasets = [dataset_record(cfg.data.train, rows, "training"), *check_eval_datasets(runtime)]
        trajectories = TrajectoryStore.from_config(cfg.storage, runs_dir=runs)
        run_id = tracker.start(cfg, run_name=plan.name, resume_run_id=point.run_id if point else None,
                               parent_run_id=parent_run_id, origin=origin,
                               tags={"runs_dir": str(runs), "clip_active": str(cfg.clip_active()).lower(),
                                     **runtime.numerics.tags(), **(tags or {})},
                               params=runtime.numerics.params())
        claims.run(run_id)
        checkpoints = checkpoint_store(cfg, runs, plan.name, run_id)
        with tracker:
            tracker.log_config(cfg)
            tracker.log_datasets(datasets)
            trainer = Trainer(runtime, rows, checkpoint_dir=checkpoints, run_id=run_id)
            if plan.resuming:
                point = _restore(trainer, point, trajectories, plan)
            yield RunSession(plan, runtime, trainer, tracker, mlflow, trajectories, checkpoints, run_id,
                             tracker.run_url(),
                             resumed=point is not None and point.step > 0)


def _restore(trainer: Trainer, point: ResumePoint | None, trajectories: TrajectoryStore, plan: RunPlan
             ) -> ResumePoint:
    """Rank 0's resume point (its ``point``; None on the others) made every rank's: the run's trajectory parts past
    the point are deleted (those steps run again), and every rank reads the checkpoint itself (a remote one through
    its own verified copy from the point's store). Step 0: the run starts over, same run id."""
    shared: ResumePoint | None = trainer.ranks.broadcast(point)  # a collective: every rank calls it
    if shared is None:
        raise CheckpointError("resume: rank 0 found no run to resume")
    if trainer.ranks.is_main:
        trajectories.delete_steps_after(shared.run_id, shared.step)
    if shared.step == 0:
        return shared
    path = shared.path if trainer.ranks.is_main else None
    path = path or open_checkpoints(plan.cfg, plan.runs, shared.where).fetch(shared.step)
    trainer.resume(path, force=plan.force_resume)
    return shared


def paired_vs_earlier(per_question: Mapping[str, Mapping[str, Mapping[str, float]]], cfg: ExperimentConfig
                      ) -> dict[str, dict[str, PairedDiff]]:
    """final − sft and final − start: per-question Pass@1 differences on the same questions, bootstrap CI."""
    out: dict[str, dict[str, PairedDiff]] = {}
    final = per_question.get("final", {})
    for earlier in ("sft", "start"):
        for ds, before in per_question.get(earlier, {}).items():
            if ds in final:
                out.setdefault(f"final_minus_{earlier}", {})[ds] = PairedDiff.of(
                    final[ds], before, n_resamples=cfg.eval.bootstrap_samples, seed=cfg.seed)
    return out
