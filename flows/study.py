"""The rollout study flow: one policy, several sampling modes and group sizes, the same questions and seeds (issue 16).

The flow samples the study's questions in chunks (one retryable ``study-chunk`` task each), chunk by chunk with
every (k, mode) arm in turn, scores every leaf with the run's reward function and profiles every question's group
(:mod:`aepo_core.rollout.study`: branch concentration, exploration, informative groups, budget split, cost). Seeds
derive from (seed, chunk), never from the arm, so arms are paired question by question. Then, with bootstrap 95%
CIs over questions: every arm's means, and per k the paired differences aepo − arpo, aepo − independent and
arpo − independent.

Outputs, under ``<runs_dir>/studies/<run name>/`` and logged to an MLflow run of its own (tag
``kind=rollout-study``, metrics ``study/k<k>/<mode>/<quantity>``, the folder as artifacts ``study/``):

- ``study.json``: the study's settings (the policy and a digest of its weights, the numerics and the machine, the
  questions, seed, each arm's rollout section), written first (:class:`~infra.run.study.StudyFolder`);
- ``profiles.parquet``: one row per (k, mode, question) (:data:`~infra.run.study.PROFILE_SCHEMA`), and ``costs.json``
  (each arm's wall, engine and tool seconds and generated tokens), both rewritten after every chunk.  A study run
  again under the same run name resumes: the chunks already in ``profiles.parquet`` are kept, and only the rest is
  sampled (the settings must be the same, else it is an error naming the first that differs);
- ``summary.json``: estimates, histograms of consecutive-branch counts, budget correlations, paired differences,
  and each arm's cost (wall, engine and tool seconds, generated tokens);
- ``rollout_study.png`` and ``budget_split.png``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from aepo_core.config import ExperimentConfig, RolloutConfig, default_initial_rollouts
from aepo_core.overrides import apply_overrides
from flows.common import Logger, artifact_key, flow_runs_dir, rename_flow_run, run_origin
from infra.run.parameters import given_config
from infra.run.policy_source import eval_storage, locate_policy, start_side_run
from infra.run.runtime import build_runtime
from infra.run.study import Arm, ArmCost, StudyFolder, StudySummary, study_metrics, study_questions
from tasks.study import study_chunk

DEFAULT_DATASETS = ("synthetic:train", "synthetic:validation", "synthetic:test")
DEFAULT_MODES = ("aepo", "arpo", "independent")
DEFAULT_KS = (8, 12)
STUDIES_DIR = "studies"
"""Under the runs dir: one folder per study run."""


@dataclass(frozen=True)
class StudyResult:
    """What a rollout study produced and where it went."""

    run_id: str
    run_name: str
    tracking_uri: str
    out_dir: str
    questions: int
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json's content
    figures: list[str] = field(default_factory=list)


def arm_rollout(base: RolloutConfig, arm: Arm) -> RolloutConfig:
    """The rollout config of an arm: the base with its mode and k; fixed global samples (arpo, aepo without
    pre-monitoring) at the paper's k/2, since the base's initial_rollouts was chosen for its own k.

    An arm's mode may carry rollout settings after ``@``, comma-separated: ``aepo@branch_penalty=0.2,premonitor=false``
    (the whole string is the arm's label), for ablations that share every other setting and the seeds."""
    mode, _, settings = arm.mode.partition("@")
    tree = {**base.model_dump(), "mode": mode, "k": arm.k, "initial_rollouts": default_initial_rollouts(arm.k)}
    apply_overrides(tree, [item for item in settings.split(",") if item], f"study arm {arm.label}")
    # Validated (model_copy(update=…) is not): an unknown mode or setting fails here, before anything starts.
    return RolloutConfig.model_validate(tree)


def chunks_to_sample(arms: list[Arm], kept: dict[Arm, int], questions: int, chunk: int) -> list[tuple[Arm, int]]:
    """(arm, first question) of every chunk still to sample: chunk by chunk, every arm in turn, so a study stopped
    at any point holds the same questions in every arm but one (and its paired differences are usable); an arm
    resumes after the ``kept`` questions it has."""
    return [(arm, i) for i in range(0, questions, chunk) for arm in arms if kept.get(arm, 0) <= i]


@flow(name="aepo-rollout-study", log_prints=True)
def rollout_study(
    config: ExperimentConfig | dict[str, Any] | str | None = None,
    overrides: list[str] | None = None,
    checkpoint: str | None = None,
    runs_dir: str | None = None,
    datasets: list[str] | None = None,
    modes: list[str] | None = None,
    ks: list[int] | None = None,
    max_questions: int = 200,
    chunk_questions: int = 32,
    seed: int = 0,
    run_name: str | None = None,
) -> StudyResult:
    """Sample the same questions in every (k, mode) arm with paired seeds, profile every group, summarize with
    bootstrap CIs, plot, and track it all in MLflow (see the module docstring)."""
    logger = get_run_logger()
    if chunk_questions < 1 or max_questions < 1:
        raise ValueError("max_questions and chunk_questions must be >= 1")
    given = given_config(config)
    policy = locate_policy(given, checkpoint, overrides, None,
                           flow_runs_dir(runs_dir, eval_storage(given, overrides).runs_dir), registry=False)
    cfg, ckpt = policy.cfg, policy.checkpoint
    arms = [Arm(k, mode) for k in ks or DEFAULT_KS for mode in modes or DEFAULT_MODES]
    rollouts = {arm: arm_rollout(cfg.rollout, arm) for arm in arms}  # a bad mode or k fails here, before any work
    runs = flow_runs_dir(runs_dir, cfg.storage.runs_dir)
    runs.mkdir(parents=True, exist_ok=True)
    name = run_name or f"{cfg.name}-rollout-study-{uuid.uuid4().hex[:6]}"
    rename_flow_run(name)
    runtime = build_runtime(cfg, runs, name)
    with runtime:  # stops a managed vLLM server however the flow ends
        policy.load(runtime)
        specs = list(datasets or DEFAULT_DATASETS)
        rows = study_questions(runtime, specs, max_questions)
        if len(rows) < max_questions:
            logger.warning("the datasets %s hold %d questions, fewer than the %d asked", specs, len(rows),
                           max_questions)
        what = str(ckpt) if ckpt is not None else cfg.model.name
        folder = StudyFolder.open(runs / STUDIES_DIR / name, runtime, what, rows, specs, seed, rollouts,
                                  chunk_questions)  # a mismatch with an earlier run fails before any run starts
        labels, tags = ", ".join(a.label for a in arms), {"kind": "rollout-study", "checkpoint": str(ckpt or "")}
        tracker = start_side_run(cfg, runs, name, runtime.numerics, tags, run_origin(
            "flows/study.py:rollout_study", f"Rollout study of {what}: {labels} on {len(rows)} questions."))
        run_id = tracker.run_id
        logger.info("rollout study %s: %s on %d questions → MLflow run %s, files in %s", name, labels, len(rows),
                    run_id, folder.out_dir)
        with tracker:
            tracker.log_params({"study.questions": len(rows), "study.arms": ",".join(a.label for a in arms),
                                "study.seed": seed, "study.datasets": ",".join(specs)})
            for arm, i in _chunks_left(folder, arms, [r.id for r in rows], chunk_questions, logger):
                chunk = study_chunk(runtime, rows[i: i + chunk_questions], rollouts[arm], seed, i // chunk_questions,
                                    arm.label)
                folder.add(arm, chunk.profiles, chunk.cost)
            summary, data, figures = folder.summarize(cfg.eval.bootstrap_samples, cfg.seed,
                                                      f"rollout study, {len(rows)} questions")
            tracker.log_metrics(study_metrics(summary, folder.costs), 0)
            tracker.log_artifact(folder.out_dir, "study")
    create_table_artifact(table=_table(summary, folder.costs), key=artifact_key("study", name),
                          description=f"rollout study {name}")
    return StudyResult(run_id, name, tracker.tracking_uri, str(folder.out_dir), len(rows), data,
                       [str(f) for f in figures])


def _chunks_left(folder: StudyFolder, arms: list[Arm], question_ids: list[str], chunk_questions: int,
                 logger: Logger) -> list[tuple[Arm, int]]:
    """(arm, first question) of every chunk not sampled yet: an earlier run's chunks are kept (logged per arm)."""
    kept = folder.resume(arms, question_ids, chunk_questions)
    for arm in (a for a in arms if kept[a]):
        logger.info("study %s: arm %s resumes after %d questions", folder.out_dir.name, arm.label, kept[arm])
    return chunks_to_sample(arms, kept, len(question_ids), chunk_questions)


def _table(summary: StudySummary, costs: dict[Arm, ArmCost]) -> list[dict[str, Any]]:
    """One row per arm for the Prefect UI."""
    def fmt(e: Any) -> str:
        return f"{e.mean:.3f} [{e.low:.3f}, {e.high:.3f}]"

    rows = []
    for arm, s in summary.arms.items():
        e = s.estimates
        rows.append({"arm": arm.label, "top-1 share": fmt(e["top1_share"]), "top-3 share": fmt(e["top3_share"]),
                     "distinct tool seqs": fmt(e["distinct_tool_sequences"]),
                     "distinct answers": fmt(e["distinct_answers"]), "Pass@k": fmt(e["pass_at_k"]),
                     "informative": fmt(e["informative"]),
                     "wall s": round(costs[arm].wall_s, 1) if arm in costs else None})
    return rows
