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
  questions, seed, each arm's rollout section), written first;
- ``profiles.parquet``: one row per (k, mode, question) (:data:`~infra.run.study.PROFILE_SCHEMA`), and ``costs.json``
  (each arm's wall, engine and tool seconds and generated tokens), both rewritten after every chunk.  A study run
  again under the same run name resumes: the chunks already in ``profiles.parquet`` are kept, and only the rest is
  sampled (the settings must be the same, else it is an error naming the first that differs);
- ``summary.json``: estimates, histograms of consecutive-branch counts, budget correlations, paired differences,
  and each arm's cost (wall, engine and tool seconds, generated tokens);
- ``rollout_study.png`` and ``budget_split.png``.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from aepo_core.config import ExperimentConfig, RolloutConfig, default_initial_rollouts
from aepo_core.overrides import apply_overrides
from aepo_core.rollout.study import GroupProfile
from flows.common import artifact_key, flow_runs_dir, rename_flow_run, run_origin
from flows.evaluate import eval_storage, resolve_checkpoint, resolve_eval_config
from infra.atomic import atomic_file
from infra.data.rows import QuestionRow
from infra.models import weights_digest
from infra.run.runtime import PolicyRuntime, build_runtime
from infra.run.study import (
    Arm,
    ArmCost,
    StudySummary,
    read_costs,
    read_profiles,
    summarize_study,
    write_costs,
    write_profiles,
    write_study_figures,
)
from infra.tracking.run import Tracker
from tasks.study import study_chunk

log = logging.getLogger(__name__)

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


def resumed_profiles(out_dir: Path, meta: dict[str, Any]
                     ) -> tuple[dict[Arm, list[GroupProfile]], dict[Arm, ArmCost], dict[str, Any]]:
    """What an earlier run of this study (same folder) sampled, when its settings are these: its profiles, costs
    and arms' rollout settings; empty when the study is new."""
    settings = out_dir / "study.json"
    if not settings.is_file():
        return {}, {}, {}
    old = json.loads(settings.read_text())
    for key in ("policy_digest", "numerics", "seed", "datasets", "chunk_questions", "engine"):
        if old.get(key) != meta[key]:
            raise ValueError(f"study {out_dir.name} exists with {key}={old.get(key)!r}, not {meta[key]!r}: resume it "
                             "with the same settings or choose another run name")
    profiles = read_profiles(out_dir / "profiles.parquet") if (out_dir / "profiles.parquet").is_file() else {}
    for arm in profiles:  # this run's arms must be sampled as before; an earlier run's other arms are kept
        if arm.label in meta["rollout"] and old["rollout"].get(arm.label) != meta["rollout"][arm.label]:
            raise ValueError(f"study {out_dir.name}: arm {arm.label} was sampled with other rollout settings")
    return profiles, read_costs(out_dir / "costs.json"), dict(old["rollout"])


def study_questions(runtime: PolicyRuntime, datasets: list[str], max_questions: int) -> list[QuestionRow]:
    """The first ``max_questions`` distinct questions of the datasets, in order (ids repeated across datasets once)."""
    rows: list[QuestionRow] = []
    seen: set[str] = set()
    for spec in datasets:
        for row in runtime.load_rows(spec):
            if row.id not in seen:
                seen.add(row.id)
                rows.append(row)
    if len(rows) < max_questions:
        get_run_logger().warning("the datasets %s hold %d questions, fewer than the %d asked", datasets, len(rows),
                                 max_questions)
    return rows[:max_questions]


def total_cost(costs: list[ArmCost]) -> ArmCost:
    return ArmCost(sum(c.wall_s for c in costs), sum(c.generate_s for c in costs), sum(c.tools_s for c in costs),
                   sum(c.tokens_generated for c in costs))


def study_metrics(summary: StudySummary, costs: dict[Arm, ArmCost]) -> dict[str, float]:
    """``study/k<k>/<mode>/<quantity>`` (means), ``…/branch_rate_l<l>``, ``…/wall_s`` and ``…/tokens_generated``, and
    ``study/k<k>/<a>-<b>/<quantity>`` (paired differences)."""
    out: dict[str, float] = {}
    for arm, s in summary.arms.items():
        out.update({f"study/{arm.label}/{q}": e.mean for q, e in s.estimates.items()})
        out[f"study/{arm.label}/budget_correlation"] = s.budget_correlation.mean
        out.update({f"study/{arm.label}/branch_rate_l{l_count}": e.mean for l_count, e in s.branch_rate_by_l.items()})
        if arm in costs:
            out[f"study/{arm.label}/wall_s"] = costs[arm].wall_s
            out[f"study/{arm.label}/tokens_generated"] = costs[arm].tokens_generated
    for (k, a, b), diffs in summary.diffs.items():
        out.update({f"study/k{k}/{a}-{b}/{q}": e.mean for q, e in diffs.items()})
    return out


def write_summary(path: Path, summary: StudySummary, costs: dict[Arm, ArmCost], meta: dict[str, Any]
                  ) -> dict[str, Any]:
    """summary.json (atomically): the study's settings, then :meth:`StudySummary.to_json`."""
    data = {**meta, **summary.to_json(costs)}
    with atomic_file(path, "w") as fh:
        json.dump(data, fh, indent=1)
    return data


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
    modes = list(modes or DEFAULT_MODES)
    ks = list(ks or DEFAULT_KS)
    if chunk_questions < 1 or max_questions < 1:
        raise ValueError("max_questions and chunk_questions must be >= 1")
    given = eval_storage(config, overrides)
    ckpt = resolve_checkpoint(checkpoint, given, flow_runs_dir(runs_dir, given.runs_dir))
    cfg = resolve_eval_config(config, ckpt, overrides, None)
    arms = [Arm(k, mode) for k in ks for mode in modes]
    rollouts = {arm: arm_rollout(cfg.rollout, arm) for arm in arms}  # a bad mode or k fails here, before any work
    runs = flow_runs_dir(runs_dir, cfg.storage.runs_dir)
    runs.mkdir(parents=True, exist_ok=True)
    name = run_name or f"{cfg.name}-rollout-study-{uuid.uuid4().hex[:6]}"
    rename_flow_run(name)
    out_dir = runs / STUDIES_DIR / name
    runtime = build_runtime(cfg, runs, name)
    with runtime:  # stops a managed vLLM server however the flow ends
        if ckpt is not None:
            runtime.load_checkpoint_weights(ckpt)
        specs = list(datasets or DEFAULT_DATASETS)
        rows = study_questions(runtime, specs, max_questions)
        what = str(ckpt) if ckpt is not None else cfg.model.name
        meta = {"policy": what, "policy_digest": weights_digest(runtime.model), "numerics": runtime.numerics.params(),
                "cpu": runtime.numerics.tags(), "questions": len(rows), "datasets": specs, "seed": seed,
                "engine": cfg.rollout.engine,
                "arms": [a.label for a in arms], "chunk_questions": chunk_questions,
                "rollout": {a.label: r.model_dump(exclude={"vllm", "remote"}) for a, r in rollouts.items()}}
        done, done_costs, earlier = resumed_profiles(out_dir, meta)  # a mismatch fails before any run starts
        with atomic_file(out_dir / "study.json", "w") as fh:
            json.dump({**meta, "rollout": {**earlier, **meta["rollout"]}}, fh, indent=1)
        tracker = Tracker.from_config(cfg, runs, system_metrics=False)
        run_id = tracker.start(cfg, run_name=name, tags={"kind": "rollout-study", "checkpoint": str(ckpt or ""),
                                                         **runtime.numerics.tags()},
                               params=runtime.numerics.params(),
                               origin=run_origin("flows/study.py:rollout_study",
                                                 f"Rollout study of {what}: {', '.join(a.label for a in arms)} on "
                                                 f"{len(rows)} questions."))
        logger.info("rollout study %s: %s on %d questions → MLflow run %s, files in %s", name,
                    ", ".join(a.label for a in arms), len(rows), run_id, out_dir)
        profiles: dict[Arm, list[GroupProfile]] = {}
        costs: dict[Arm, ArmCost] = {}
        with tracker:
            tracker.log_params({"study.questions": len(rows), "study.arms": ",".join(a.label for a in arms),
                                "study.seed": seed, "study.datasets": ",".join(specs)})
            ids = [r.id for r in rows]
            profiles.update({arm: ps for arm, ps in done.items() if arm not in arms})  # arms of an earlier run
            costs.update({arm: c for arm, c in done_costs.items() if arm not in arms})
            for arm in arms:
                kept = done.get(arm, [])
                if [p.question_id for p in kept] != ids[: len(kept)] or (len(kept) % chunk_questions and \
                        len(kept) != len(ids)):
                    raise ValueError(f"study {name}: arm {arm.label} holds questions that are not this study's first "
                                     f"{len(kept)} in chunks of {chunk_questions}")
                profiles[arm], costs[arm] = list(kept), done_costs.get(arm, ArmCost(0.0, 0.0, 0.0, 0.0))
                if kept:
                    logger.info("study %s: arm %s resumes after %d questions", name, arm.label, len(kept))
            for arm, i in chunks_to_sample(arms, {a: len(p) for a, p in profiles.items()}, len(rows),
                                           chunk_questions):
                chunk = study_chunk(runtime, rows[i: i + chunk_questions], rollouts[arm], seed, i // chunk_questions,
                                    arm.label)
                profiles[arm].extend(chunk.profiles)
                costs[arm] = total_cost([costs[arm], chunk.cost])
                # A stopped study keeps every chunk it finished, and what it cost.
                write_profiles(out_dir / "profiles.parquet", profiles)
                write_costs(out_dir / "costs.json", costs)
            summary = summarize_study(profiles, cfg.eval.bootstrap_samples, cfg.seed)
            data = write_summary(out_dir / "summary.json", summary, costs, meta)
            figures = write_study_figures(summary, profiles, out_dir, f"rollout study, {len(rows)} questions")
            tracker.log_metrics(study_metrics(summary, costs), 0)
            tracker.log_artifact(out_dir, "study")
    create_table_artifact(table=_table(summary, costs), key=artifact_key("study", name),
                          description=f"rollout study {name}")
    return StudyResult(run_id, name, tracker.tracking_uri, str(out_dir), len(rows), data, [str(f) for f in figures])


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
