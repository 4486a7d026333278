"""The training flow: optional cold-start SFT → RL steps → final evaluation, tracked in MLflow.

Each RL step (:func:`rl_step`): sample → score → (dynamic sampling: sample again) → update → store → log, with a
checkpoint every ``checkpoint.every`` steps and an evaluation every ``eval.every`` steps. The run itself — runs dir,
resume point, numerics, runtime, tracker, stores, trainer — is composed in :mod:`infra.run.session`; this module only
orders the tasks. Killing the flow and re-running it with ``resume=True`` continues from the last complete checkpoint
(from step 0 when none committed), in the same MLflow run, with the same data order and rollout seeds; a step's
metrics are logged once, its trajectory parts replaced.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from aepo_core.config import ExperimentConfig
from aepo_core.evaluation import EvalSummary, PairedDiff
from aepo_core.staleness import staleness_metrics
from flows.collect import Collected, RolloutsAhead, collect
from flows.common import artifact_key, run_origin, train_flow_run_name
from infra.run.evaluation import EvalSource
from infra.run.parameters import resolve_config
from infra.run.plan import plan_run
from infra.run.session import BEFORE_SFT, RunSession, open_run, paired_vs_earlier, run_description
from tasks.data import prepare_data, source_fingerprint
from tasks.progress import Progress, report
from tasks.rl import checkpoint, evaluate, sft, store, update, write_eval_results

PHASE_TIME = "time/"
"""Wall seconds by phase: ``time/rollout_s`` (sampling and scoring, refill rounds included) and ``time/update_s``
(the scoring pass, ``train/scoring_pass_s``, included) per RL step; under ``train.max_staleness`` > 0 also
``time/rollout_wait_s``, the part of the step spent waiting for its rollouts (the rest of them overlapped an earlier
update); ``time/sft_s`` at step 0; ``time/eval_<label>_s`` at the evaluation's step (``start``, ``sft``,
``step<N>``, ``final``)."""

Summaries = dict[str, dict[str, EvalSummary]]
"""stage (start, sft, stepN, final) → dataset key → summary."""
Comparisons = dict[str, dict[str, PairedDiff]]
"""comparison (final_minus_sft, final_minus_start) → dataset key → paired difference."""
PerQuestion = dict[str, dict[str, dict[str, float]]]
"""stage → dataset key → question id → Pass@1."""


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
    comparisons: Comparisons = field(default_factory=dict)
    idle_mechanisms: list[str] = field(default_factory=list)
    """The mechanisms the config turned on that had next to nothing to act on (:mod:`aepo_core.activity`)."""

    @property
    def final_eval(self) -> dict[str, EvalSummary]:
        return self.evals.get("final", {})


class _Evaluations:
    """The run's evaluations by stage: summaries for the result, per-question Pass@1 for paired comparisons, and
    per stage the per-question Parquet files ``aepo eval`` writes (:meth:`RunSession.results_dir`)."""

    def __init__(self, session: RunSession) -> None:
        self.session = session
        self.summaries: Summaries = {}
        self.per_question: PerQuestion = {}

    def run(self, label: str, step: int, prefix: str = "eval") -> None:
        session, runtime = self.session, self.session.runtime
        source = EvalSource(session.run_id, session.plan.name, None, step, label)
        t0 = time.perf_counter()
        for ds in runtime.eval_datasets():
            compute = functools.partial(evaluate.with_options(timeout_seconds=session.cfg.train.eval_timeout_s),
                                        runtime, ds, label)
            result = session.stage_report(label, ds, source, compute)  # a start stage: maybe stored by another run
            session.log_evaluation(result, step, label, prefix)
            write_eval_results(runtime, result, source, session.results_dir(label), label)
            session.log_eval_file(label, result.key)
            self.summaries.setdefault(label, {})[result.key] = result.summary
            self.per_question.setdefault(label, {})[result.key] = result.per_question_pass1
        session.tracker.log_metrics({f"{PHASE_TIME}eval_{label}_s": time.perf_counter() - t0}, step)

    def recall(self, label: str) -> None:
        """A stage a resumed run does not repeat (the start and post-SFT evaluations): its per-question Pass@1 read
        back from the files it wrote, for the final − start and final − sft comparisons. Without them a run resumed
        after its first checkpoint logged neither comparison (found when the kill chain's final-evaluation kill first
        landed there). A stage that never ran has no files and is left out."""
        if recorded := self.session.recorded_pass1(label):
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
    plan = plan_run(resolve_config(config, overrides), runs_dir, run_name, resume=resume, force_resume=force_resume,
                    machine=machine)
    cfg = plan.cfg
    rows = prepare_data(cfg.data.train, cfg.data, source_fingerprint(cfg.data.train, cfg.data.data_root))
    origin = run_origin("flows/train.py:train", run_description(cfg))
    with open_run(plan, rows, origin, parent_run_id=parent_run_id, tags=tags) as session:
        get_run_logger().info("%s", session.runtime.numerics.describe())
        evals = _Evaluations(session)
        _train_loop(session, evals)
        comparisons = paired_vs_earlier(evals.per_question, cfg)
        model_version = session.record_outcome(evals.summaries.get("final", {}), comparisons)
        idle = session.idle_mechanisms()
    result = TrainResult(session.run_id, plan.name, session.trainer.step, str(plan.runs), session.checkpoints.uri,
                         session.tracker.tracking_uri, str(session.trajectories.uri), session.run_url, model_version,
                         evals.summaries, comparisons, idle)
    create_markdown_artifact(key=artifact_key("train", plan.name), markdown=summary_markdown(result, cfg),
                             description=f"summary of {plan.name}")
    return result


def _train_loop(session: RunSession, evals: _Evaluations) -> None:
    """Optional start evaluation and cold-start SFT, the RL steps (checkpoints, periodic evaluations), the final
    evaluation. Evaluations run on rank 0 alone (its weights are whole under ZeRO 0–2; the Trainer refuses SFT and
    ZeRO-3 with the in-process engine under several ranks)."""
    cfg, trainer, name = session.cfg, session.trainer, session.plan.name
    total = trainer.total_steps
    report(get_run_logger(), Progress("start", done=trainer.step, total=total, name=name),
           "run %s (MLflow %s): %d RL steps%s", name, trainer.run_id, total,
           f", resumed at step {trainer.step}" if session.resumed else "")
    progress_id = create_progress_artifact(progress=100.0 * trainer.step / total, key=artifact_key("progress", name),
                                           description=f"RL steps of {name}")
    if session.is_main and session.resumed:
        for label in ("start", "sft"):
            evals.recall(label)
    elif session.is_main:
        _start_and_sft(session, evals)
    ahead = RolloutsAhead(session) if cfg.train.max_staleness else None
    while trainer.step < total:
        step = trainer.step + 1
        reward = rl_step(session, step, ahead)
        if step % cfg.checkpoint.every == 0 or step == total:
            session.tracker.flush_traces()  # (the steps up to a checkpoint are never repeated: their traces must be in)
            checkpoint(trainer)  # (no rollout is in flight here: aepo_core.staleness)
        if cfg.eval.every and step % cfg.eval.every == 0 and step < total and session.is_main:
            _current_weights(ahead)
            evals.run(f"step{step}", step)
        update_progress_artifact(progress_id, progress=100.0 * step / total,
                                 description=f"step {step}/{total}: reward {reward:.3f}")
    if session.is_main:
        _current_weights(ahead)
        evals.run("final", trainer.step)


def _current_weights(ahead: RolloutsAhead | None) -> None:
    """Before an evaluation: under overlap the engine holds the weights of its last rollout, and may still be
    sampling; on-policy it already holds the trainer's."""
    if ahead is not None:
        ahead.hand_over()


def _start_and_sft(session: RunSession, evals: _Evaluations) -> None:
    """The evaluation before training (under the names of :data:`BEFORE_SFT` when SFT follows) and cold-start SFT
    with its evaluation."""
    cfg = session.cfg
    if cfg.eval.at_start and (cfg.eval.before_sft or not cfg.train.sft.enabled):
        evals.run("start", 0, BEFORE_SFT if cfg.train.sft.enabled else "eval")
    if cfg.train.sft.enabled:
        t0 = time.perf_counter()
        metrics = sft(session.runtime, session.trainer.rows).metrics()
        session.tracker.log_metrics({**metrics, f"{PHASE_TIME}sft_s": time.perf_counter() - t0}, 0)
        if cfg.eval.at_start:
            evals.run("sft", 0)


def rl_step(session: RunSession, step: int, ahead: RolloutsAhead | None = None) -> float:
    """One RL step, top to bottom: the step's rollouts (:func:`~flows.collect.collect`, or under overlap taken
    from ``ahead``, which meanwhile starts the next steps'), update on the kept groups, store every sampled tree
    (rank 0), log. Returns the step's mean reward."""
    runtime, trainer, cfg = session.runtime, session.trainer, session.cfg
    t0, cpu0 = time.perf_counter(), runtime.cpu_seconds()
    got = collect(session, step) if ahead is None else ahead.take(step)
    filled = got.batch
    t1, cpu1 = time.perf_counter(), runtime.cpu_seconds()
    train_metrics = update.with_options(timeout_seconds=cfg.train.update_timeout_s)(trainer, filled, step)
    t2, cpu2 = time.perf_counter(), runtime.cpu_seconds()
    spent = trainer.account(filled.rollouts, *_cpu_split(got, ahead is not None, cpu1 - cpu0, cpu2 - cpu1, t2 - t1),
                            t1 - t0, t2 - t1)
    if session.is_main:
        store(session.trajectories, trainer.run_id, step, filled, trainer.rows_by_id)
    overlap = {} if ahead is None else {f"{PHASE_TIME}rollout_wait_s": t1 - t0, **{
        f"rollout/{k}": v for k, v in staleness_metrics(filled.trees, step - 1).items()}}
    session.log_step(step, filled, {**train_metrics, **spent, **overlap, f"{PHASE_TIME}rollout_s": got.wall_s,
                                    f"{PHASE_TIME}update_s": t2 - t1, "step/wall_s": time.perf_counter() - t0})
    return filled.scores.metrics["rollout/reward_mean"]


def _cpu_split(got: Collected, overlapped: bool, wait_cpu: float, update_cpu: float, update_wall: float
               ) -> tuple[float, float]:
    """(rollout, update) CPU seconds of a step. In turn, each phase's own. Under overlap the rollouts of later
    steps ran during this update, so the process's CPU seconds of the step (waiting and updating) are apportioned
    by the busy seconds of this step's rollouts and this update: the run's total stays exact, the split is an
    estimate."""
    if not overlapped:
        return wait_cpu, update_cpu
    total, busy = wait_cpu + update_cpu, got.wall_s + update_wall
    rollout = total * got.wall_s / busy if busy > 0 else 0.0
    return rollout, total - rollout


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
    for stage, by_ds in info.evals.items():
        for ds, s in by_ds.items():
            lines.append(f"| {stage} | {ds} | {s.pass1.value:.3f} | [{s.pass1.low:.3f}, {s.pass1.high:.3f}]"
                         f" | {s.pass_k.value:.3f} | {s.tool_calls_per_question:.2f} | {s.answered_rate:.2f} |")
    lines += [f"\n- {line}" for line in comparison_lines(info.comparisons)]
    if info.idle_mechanisms:
        lines += ["", "**Mechanisms with next to nothing to act on** (mean over the RL steps):",
                  *(f"- {note}" for note in info.idle_mechanisms)]
    return "\n".join(lines)


def comparison_lines(comparisons: Comparisons) -> list[str]:
    """``final minus sft on synthetic_test: pass@1 +0.125 [-0.010, +0.260] (paired over 40 questions)``, one per
    comparison and dataset."""
    return [f"{name.replace('_', ' ')} on {ds}: {c.line()}" for name, by_ds in comparisons.items()
            for ds, c in by_ds.items()]
