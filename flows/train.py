"""The training flow: optional cold-start SFT → RL steps → final evaluation, tracked in MLflow.

Each RL step: rollout → score → update → store → track, with a checkpoint every ``checkpoint.every`` steps and
an evaluation every ``eval.every`` steps.  Killing the flow and re-running it with ``resume=True`` continues
from the last complete checkpoint (from step 0 when none committed), in the same MLflow run, with the same data
order and rollout seeds; a step's metrics are logged once, its trajectory parts replaced.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from aepo_core.config import ExperimentConfig
from aepo_core.cost import COST_PREFIX, TOTAL
from aepo_core.evaluation import paired_comparison
from aepo_core.rollout.scheduler import RolloutResult, merge_results
from aepo_core.rollout.tree import RolloutTree
from aepo_core.scoring import StepScores, fill_informative
from flows.common import (
    artifact_key,
    check_eval_datasets,
    dataset_record,
    flow_runs_dir,
    log_eval_traces,
    resolve_config,
    run_origin,
    train_flow_run_name,
)
from infra.numerics import DeviceFacts, numerics_for
from infra.plots import curves_figure, rollout_tree_figure
from infra.ranks import Ranks
from infra.run.checkpoints import CheckpointError, CheckpointStore, checkpoint_store, open_checkpoints
from infra.run.evaluation import EvalReport, EvalSource, ResultsDir, recorded_pass1
from infra.run.lock import Claims
from infra.run.resume import ResumePoint, find_resume_point
from infra.run.runtime import PolicyRuntime, build_runtime
from infra.run.trainer import Trainer
from infra.store import TrajectoryStore
from infra.tracking.registry import PolicyProvenance, log_model, register_model
from infra.tracking.run import RankTracker, RunLogger, Tracker
from tasks.data import prepare_data, source_fingerprint
from tasks.progress import Progress, report
from tasks.rl import checkpoint, evaluate, rollout, score, sft, store, update, write_eval_results

log = logging.getLogger(__name__)

CURVE_METRICS = ("rollout/reward_mean", "rollout/accuracy", "train/entropy_mean", "rollout/delta_h_mean",
                 "rollout/branch_samples", "rollout/max_branches_per_path", "train/loss", "train/clip_frac_high")

PHASE_TIME = "time/"
"""Wall seconds by phase: ``time/rollout_s`` (sampling and scoring, refill rounds included) and ``time/update_s``
(the scoring pass, ``train/scoring_pass_s``, included) per RL step; ``time/sft_s`` at step 0;
``time/eval_<label>_s`` at the evaluation's step (``start``, ``sft``, ``step<N>``, ``final``)."""

TOKENS_SPENT = f"{COST_PREFIX}{TOTAL}generated_tokens"
"""The x of the curves against the run's budget (:mod:`aepo_core.cost`)."""

Summaries = dict[str, dict[str, dict[str, float]]]
"""stage (start, sft, stepN, final) or comparison name → dataset key → summary."""


@dataclass(frozen=True)
class TrainResult:
    """What a training run produced and where it went."""

    run_id: str
    run_name: str
    steps: int
    runs_dir: str
    checkpoint_dir: str
    tracking_uri: str
    trajectories: str  # the trajectory store's root: its tables are <root>/trajectories and <root>/nodes
    run_url: str | None = None
    """The MLflow run's page: on the tracking server, or (SQLite store) where ``aepo ui`` shows it."""
    model_version: str | None = None
    """The registered policy, ``models:/<tracking.registered_model>/<version>`` (None: not registered)."""
    evals: Summaries = field(default_factory=dict)
    comparisons: Summaries = field(default_factory=dict)

    @property
    def final_eval(self) -> dict[str, dict[str, float]]:
        return self.evals.get("final", {})


BEFORE_SFT = "eval_start"
"""The metric prefix of the evaluation before cold-start SFT. ``eval/…`` is the RL curve, one point per step: at
step 0 the policy RL starts from (the SFT policy when SFT runs), so the start evaluation gets its own names
instead of a second point at step 0 (every eval chart began with a vertical segment)."""


def _log_eval(tracker: RunLogger, report_: EvalReport, step: int, label: str, prefix: str) -> None:
    """Log one evaluation: metrics at ``step`` under ``prefix``, the full report as JSON."""
    tracker.log_metrics(report_.metrics(prefix), step)
    log_eval_traces(tracker, report_, step, label)
    tracker.log_dict({"summary": report_.summary, "by_family": report_.by_family,
                      "questions": [o.as_dict() for o in report_.outcomes]}, f"eval/{label}/{report_.key}.json")


class _Evaluations:
    """The run's evaluations by stage: summaries for the result, per-question Pass@1 for paired comparisons, and
    per stage the per-question Parquet files ``aepo eval`` writes, under ``<eval results>/<run name>/<stage>/``."""

    def __init__(self, runtime: PolicyRuntime, tracker: RunLogger, timeout_s: float | None, runs: Path,
                 run_name: str) -> None:
        self.runtime, self.tracker, self.timeout_s = runtime, tracker, timeout_s
        self.runs, self.run_name = runs, run_name
        self.summaries: Summaries = {}
        self.per_question: Summaries = {}

    def _where(self, label: str) -> ResultsDir:
        """Where the stage ``label`` writes its per-question files (and a resumed run reads them back)."""
        return ResultsDir.of(self.runtime.cfg.storage, self.runs, f"{self.run_name}/{label}")

    def run(self, label: str, step: int, prefix: str = "eval") -> None:
        where = self._where(label)
        source = EvalSource(self.tracker.run_id, self.run_name, None, step)
        t0 = time.perf_counter()
        for ds in self.runtime.eval_datasets():
            result = evaluate.with_options(timeout_seconds=self.timeout_s)(self.runtime, ds, label)
            _log_eval(self.tracker, result, step, label, prefix)
            self.tracker.flush_traces()  # the file makes the stage done: a resume will not log its traces again
            write_eval_results(self.runtime, result, source, where, label)
            self.tracker.log_artifact(where.local_file(result.key), f"eval/{label}")
            self.summaries.setdefault(label, {})[result.key] = result.summary
            self.per_question.setdefault(label, {})[result.key] = result.per_question_pass1
        self.tracker.log_metrics({f"{PHASE_TIME}eval_{label}_s": time.perf_counter() - t0}, step)

    def recall(self, label: str) -> None:
        """A stage a resumed run does not repeat (the start and post-SFT evaluations): its per-question Pass@1 read
        back from the files it wrote, for the final − start and final − sft comparisons. Without them a run resumed
        after its first checkpoint logged neither comparison (found when the kill chain's final-evaluation kill first
        landed there). A stage that never ran has no files and is left out."""
        if recorded := recorded_pass1(self._where(label), self.runtime.cfg.storage, self.runtime.eval_datasets()):
            self.per_question[label] = recorded


@flow(name="aepo-train", flow_run_name=train_flow_run_name, log_prints=True)
def train(
    config: ExperimentConfig | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    runs_dir: str | None = None,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    force_resume: bool = False,
    tags: dict[str, str] | None = None,
    machine: dict[str, Any] | None = None,
) -> TrainResult:
    """Train a policy with the configured algorithm; returns the evaluations and where everything went.

    ``parent_run_id`` nests the MLflow run under another (a sweep's parent run); ``tags`` are extra MLflow tags
    set when the run is created (a sweep's ``sweep_name`` / ``sweep_cell``, by which a re-run finds it).
    ``machine``: the device facts a sweep decided its ``auto`` numerics from (``DeviceFacts.as_dict``), the same for
    every cell (:func:`infra.numerics.numerics_for`). A resumed run computes in the numerics it recorded at its
    start, neither this machine's nor the sweep's."""
    logger = get_run_logger()
    cfg = resolve_config(config, overrides)
    runs = flow_runs_dir(runs_dir, cfg.storage.runs_dir)
    runs.mkdir(parents=True, exist_ok=True)
    ranks = Ranks.current()  # the launcher's (the process group itself starts with the DeepSpeed backend)
    cfg.check_trainable(world_size=ranks.world_size)
    name = cfg.run_name_for(run_name)
    rows = prepare_data(cfg.data.train, cfg.data, source_fingerprint(cfg.data.train, cfg.data.data_root))
    tracker: RunLogger = Tracker.from_config(cfg, runs) if ranks.is_main else RankTracker(ranks.rank)
    # Rank 0 picks the run to continue from MLflow before the model loads: a wrong name or config fails fast.
    point = (find_resume_point(tracker, cfg, runs, name, force=force_resume)
             if resume and isinstance(tracker, Tracker) else None)
    numerics = (point.numerics if point is not None and point.numerics is not None
                else numerics_for(cfg, DeviceFacts.from_dict(machine) if machine else None))
    # One live process per run (infra.run.lock): a run another process still trains is not resumed; claimed first.
    claims = Claims(runs if ranks.is_main else None, run_id=point.run_id if point else None)
    # The runtime stops a managed vLLM server however it ends.
    with claims, build_runtime(cfg, runs, name, numerics) as runtime:
        logger.info("%s", runtime.numerics.describe())
        datasets = [dataset_record(cfg.data.train, rows, "training"), *check_eval_datasets(runtime)]
        trajectories = TrajectoryStore.from_config(cfg.storage, runs_dir=runs)
        run_id = tracker.start(cfg, run_name=name, resume_run_id=point.run_id if point else None,
                               parent_run_id=parent_run_id,
                               origin=run_origin("flows/train.py:train", run_description(cfg)),
                               tags={"runs_dir": str(runs), "clip_active": str(cfg.clip_active()).lower(),
                                     **runtime.numerics.tags(), **(tags or {})},
                               params=runtime.numerics.params())
        claims.run(run_id)
        checkpoints = checkpoint_store(cfg, runs, name, run_id)
        run_url = tracker.run_url()
        with tracker:
            tracker.log_config(cfg)
            tracker.log_datasets(datasets)
            trainer = Trainer(runtime, rows, checkpoint_dir=checkpoints, run_id=run_id)
            if resume:
                point = _restore(trainer, point, trajectories, functools.partial(open_checkpoints, cfg, runs),
                                 force_resume)
            evals = _Evaluations(runtime, tracker, cfg.train.eval_timeout_s, runs, name)
            model_version: str | None = None
            _train_loop(trainer, name, tracker, trajectories, evals, resumed=point is not None and point.step > 0,
                        logger=logger)
            comparisons = _paired_vs_earlier(evals.per_question, cfg)
            if isinstance(tracker, Tracker):  # rank 0: the one that records
                for cmp_name, by_ds in comparisons.items():
                    tracker.log_metrics({f"eval/{ds}/{cmp_name}_{key}": value
                                         for ds, c in by_ds.items() for key, value in c.items()}, trainer.step)
                pass1 = [f"eval/{ds}/pass_at_1" for ds in evals.summaries.get("final", {})]
                history = tracker.metric_history([*CURVE_METRICS, *pass1, TOKENS_SPENT])
                tokens = dict(history.pop(TOKENS_SPENT))
                tracker.log_figure(curves_figure({k: v for k, v in history.items() if v}, title=name, tokens=tokens),
                                   "plots/curves.png")
                if cfg.tracking.log_model:
                    model_version = _log_policy(tracker, runtime, cfg, evals.summaries.get("final", {}),
                                                trainer.step)
    result = TrainResult(run_id, name, trainer.step, str(runs), checkpoints.uri, tracker.tracking_uri,
                         str(trajectories.uri), run_url, model_version, evals.summaries, comparisons)
    create_markdown_artifact(key=artifact_key("train", name), markdown=summary_markdown(result, cfg),
                             description=f"summary of {name}")
    return result


def _restore(trainer: Trainer, point: ResumePoint | None, trajectories: TrajectoryStore,
             checkpoints_at: Callable[[str], CheckpointStore], force: bool) -> ResumePoint:
    """Rank 0's resume point (its ``point``; None on the others) made every rank's: the run's trajectory parts past
    the point are deleted (those steps run again), and every rank reads the checkpoint itself (a remote one through
    its own verified copy from ``checkpoints_at`` the point's store). Step 0: the run starts over, same run id."""
    shared: ResumePoint | None = trainer.ranks.broadcast(point)  # a collective: every rank calls it
    if shared is None:
        raise CheckpointError("resume: rank 0 found no run to resume")
    if trainer.ranks.is_main:
        trajectories.delete_steps_after(shared.run_id, shared.step)
    if shared.step == 0:
        return shared
    path = shared.path if trainer.ranks.is_main else None
    path = path or checkpoints_at(shared.where).fetch(shared.step)
    trainer.resume(path, force=force)
    return shared


def _log_policy(tracker: Tracker, runtime: PolicyRuntime, cfg: ExperimentConfig,
                final: dict[str, dict[str, float]], step: int) -> str | None:
    """Log the final policy with its agent protocol; register it under ``tracking.registered_model`` (with the
    final evaluation metrics as version tags). Returns the registered version's URI, None when not registered."""
    logged = log_model(tracker, runtime.model, runtime.tokenizer, step, name="policy", protocol=runtime.protocol)
    if not cfg.tracking.registered_model:
        return None
    metrics = {f"eval/{ds}/{key}": value for ds, summary in final.items() for key, value in summary.items()}
    provenance = PolicyProvenance(cfg.algorithm.loss, cfg.rollout.mode, cfg.model.name, cfg.seed, cfg.config_hash(),
                                  f"eval/{next(iter(final), 'none')}/pass_at_1")
    return register_model(tracker, logged, cfg.tracking.registered_model, metrics, step, run_description(cfg),
                          provenance)


def _sample_round(trainer: Trainer, step: int, rounds: list[RolloutResult], attempt: int
                  ) -> tuple[list[RolloutTree], StepScores]:
    """One sampling round of ``step`` (:func:`~aepo_core.scoring.fill_informative`): the next questions of the data
    order, rolled out (seed from (seed, step, attempt)) and scored; the rollout is appended to ``rounds``."""
    runtime, cfg, ranks = trainer.runtime, trainer.runtime.cfg, trainer.ranks
    rows = trainer.next_batch()
    local = rollout.with_options(timeout_seconds=cfg.train.rollout_timeout_s,
                                 retries=cfg.train.task_retries)(runtime, ranks.shard(rows), step, attempt, ranks.rank)
    result = merge_results(ranks.all_gather(local))  # every rank: the whole step, in question order
    rounds.append(result)
    return result.trees, score(runtime, result, rows, step)


def _train_loop(trainer: Trainer, name: str, tracker: RunLogger, trajectories: TrajectoryStore, evals: _Evaluations,
                resumed: bool, logger: Any) -> None:
    """Optional start evaluation and cold-start SFT, the RL steps (checkpoints, periodic evaluations), the final
    evaluation; each step's rollout-tree figure and trajectory sample."""
    runtime, cfg = trainer.runtime, trainer.runtime.cfg
    total = trainer.total_steps
    report(logger, Progress("start", done=trainer.step, total=total, name=name),
           "run %s (MLflow %s): %d RL steps%s", name, trainer.run_id, total,
           f", resumed at step {trainer.step}" if resumed else "")
    progress_id = create_progress_artifact(progress=100.0 * trainer.step / total, key=artifact_key("progress", name),
                                           description=f"RL steps of {name}")
    # Evaluations run on rank 0 alone (its weights are whole under ZeRO 0–2; the Trainer refuses SFT and ZeRO-3
    # with the in-process engine under several ranks).
    if resumed and trainer.ranks.is_main:
        for label in ("start", "sft"):
            evals.recall(label)
    if not resumed and trainer.ranks.is_main:
        if cfg.eval.at_start and (cfg.eval.before_sft or not cfg.train.sft.enabled):
            evals.run("start", 0, BEFORE_SFT if cfg.train.sft.enabled else "eval")
        if cfg.train.sft.enabled:
            t0 = time.perf_counter()
            metrics = sft(runtime, trainer.rows).metrics()
            tracker.log_metrics({**metrics, f"{PHASE_TIME}sft_s": time.perf_counter() - t0}, 0)
            if cfg.eval.at_start:
                evals.run("sft", 0)
    while trainer.step < total:
        step = trainer.step + 1
        t0, cpu0 = time.perf_counter(), runtime.cpu_seconds()
        rounds: list[RolloutResult] = []
        filled = fill_informative(functools.partial(_sample_round, trainer, step, rounds), cfg.train.batch_size,
                                  cfg.algorithm)
        scores = filled.scores
        t1, cpu1 = time.perf_counter(), runtime.cpu_seconds()
        train_metrics = update.with_options(timeout_seconds=cfg.train.update_timeout_s)(
            trainer, dataclasses.replace(rounds[0], trees=filled.trees), scores, step)
        t2 = time.perf_counter()
        spent = trainer.account(rounds, cpu1 - cpu0, runtime.cpu_seconds() - cpu1, t1 - t0, t2 - t1)
        result = dataclasses.replace(rounds[0], trees=filled.sampled_trees)
        if trainer.ranks.is_main:
            store(trajectories, trainer.run_id, step, result, filled.sampled_scores, trainer.rows_by_id,
                  filled.update_advantages())
            _log_step_views(tracker, trainer, step, result, filled.sampled_scores)
        n = cfg.tracking.traces_per_step
        tracker.log_rollout_traces(result.trees[:n], filled.sampled_scores.leaves[:n], step=step,
                                   kind="train", label=f"step{step}",
                                   questions=trainer.question_rows(result.trees[:n]))
        tracker.log_metrics({**rounds[0].metrics(), **scores.metrics, **train_metrics, **spent,
                             f"{PHASE_TIME}rollout_s": t1 - t0, f"{PHASE_TIME}update_s": t2 - t1,
                             "step/wall_s": time.perf_counter() - t0}, step)
        if step % cfg.checkpoint.every == 0 or step == total:
            tracker.flush_traces()  # (the steps up to a checkpoint are never repeated: their traces must be in)
            checkpoint(trainer)
        if cfg.eval.every and step % cfg.eval.every == 0 and step < total and trainer.ranks.is_main:
            evals.run(f"step{step}", step)
        update_progress_artifact(progress_id, progress=100.0 * step / total,
                                 description=f"step {step}/{total}: reward {scores.metrics['rollout/reward_mean']:.3f}")
    if not trainer.ranks.is_main:
        return
    evals.run("final", trainer.step)


def _log_step_views(tracker: RunLogger, trainer: Trainer, step: int, result: RolloutResult,
                    scores: StepScores) -> None:
    """What a reader opens for one step: the rollout tree of its question that branched most
    (``plots/rollout_tree/step-000003.png``) and a sample of its trajectories (``trajectories/step_000003.json``).
    Before, only the last step had them."""
    i = max(range(len(result.trees)), key=lambda j: sum(n.branched for n in result.trees[j].nodes))
    tree = result.trees[i]
    tracker.log_figure(rollout_tree_figure(tree, title=f"{tree.question_id} (step {step})", scores=scores.leaves[i]),
                       f"plots/rollout_tree/step-{step:06d}.png")
    tracker.log_trajectory_sample(result.trees, scores.leaves, max_rows=16, step=step,
                                  questions=trainer.question_texts(result.trees))


def _paired_vs_earlier(per_question: dict[str, dict[str, dict[str, float]]],
                       cfg: ExperimentConfig) -> dict[str, dict[str, dict[str, float]]]:
    """final − sft and final − start: per-question Pass@1 differences on the same questions, bootstrap CI."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    final = per_question.get("final", {})
    for earlier in ("sft", "start"):
        for ds, before in per_question.get(earlier, {}).items():
            if ds in final:
                out.setdefault(f"final_minus_{earlier}", {})[ds] = paired_comparison(
                    final[ds], before, n_resamples=cfg.eval.bootstrap_samples, seed=cfg.seed)
    return out


def run_description(cfg: ExperimentConfig) -> str:
    """The MLflow run's description: what was trained, how, on what."""
    return (f"AEPO training run: {cfg.model.name} trained with the {cfg.algorithm.loss} loss on {cfg.rollout.mode} "
            f"rollouts of {cfg.data.train}, {cfg.train.steps} RL steps of {cfg.train.batch_size} questions, "
            f"seed {cfg.seed}.")


def mlflow_link(info: TrainResult) -> str:
    """The summary's line on the MLflow run: a link to its page on the tracking server, or for a SQLite store its
    id and where ``aepo ui`` will show it."""
    if info.run_url is None:
        return f"- MLflow run: `{info.run_id}` at `{info.tracking_uri}`"
    if info.tracking_uri.startswith(("http://", "https://")):
        return f"- MLflow run: [{info.run_name}]({info.run_url}) (`{info.run_id}`)"
    return (f"- MLflow run: `{info.run_id}` in `{info.tracking_uri}`; with `aepo ui --runs-dir {info.runs_dir}` "
            f"running: [{info.run_name}]({info.run_url})")


def summary_markdown(info: TrainResult, cfg: ExperimentConfig) -> str:
    lines = [
        f"# {info.run_name}",
        "",
        f"- algorithm: `{cfg.algorithm.loss}`, rollout mode `{cfg.rollout.mode}`, seed {cfg.seed}",
        f"- RL steps: {info.steps}",
        mlflow_link(info),
        *([f"- registered policy: `{info.model_version}` (`aepo eval --checkpoint {info.model_version}`)"]
          if info.model_version else []),
        f"- checkpoints: `{info.checkpoint_dir}`",
        f"- trajectories: `{info.trajectories}/trajectories` (nodes: `{info.trajectories}/nodes`)",
        "",
        "| stage | dataset | pass@1 | 95% CI | pass@k | tool calls/q | answered |",
        "|---|---|---|---|---|---|---|",
    ]
    k = cfg.eval.pass_k
    for stage, by_ds in info.evals.items():
        for ds, s in by_ds.items():
            lines.append(f"| {stage} | {ds} | {s['pass@1']:.3f} | [{s['pass@1_ci_low']:.3f}, {s['pass@1_ci_high']:.3f}]"
                         f" | {s[f'pass@{k}']:.3f} | {s['tool_calls_per_question']:.2f} | {s['answered_rate']:.2f} |")
    for name, by_ds in info.comparisons.items():
        for ds, c in by_ds.items():
            lines.append(f"\n- {name.replace('_', ' ')} on {ds}: pass@1 {c['diff']:+.3f} "
                         f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}] over {c['questions']:.0f} questions (paired)")
    return "\n".join(lines)
