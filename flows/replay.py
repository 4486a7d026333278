"""The replay flow (``aepo replay <run> --step N``): re-run one stored step's policy update and check it against the
run's own checkpoint.

Step N's update starts from the checkpoint of step N − 1 (weights, AdamW moments, LR schedule, RNG streams; a
checkpoint of step k holds the state after k updates) and reads step N's samples from the trajectory store in the
update's order (:mod:`infra.run.replay`); the weights it ends with are compared, tensor by tensor, with the
checkpoint of step N. The run's config comes from its MLflow run (the ``config.yaml`` artifact) and its numerics
from the run's ``numerics.*`` params, so the replay computes in the dtypes the run did, whatever ``auto`` would pick
on this machine. Replaying step N therefore needs the checkpoints of steps N − 1 and N (``checkpoint.every: 1``,
``keep`` ≥ 2) and step N's trajectories written at schema version 4 or later.

The rules flow (``aepo replay <run> --step N … --losses a,b,…``, :func:`replay_rules`) starts every update rule from
the same checkpoint N − 1 on step N's same samples and compares per token class what the updates did
(:mod:`aepo_core.update_comparison`); it needs only the checkpoint before each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger

from aepo_core.update_comparison import ComparisonRow, SampleTokens, compare_rules
from flows.common import flow_runs_dir
from infra.run.reading import reading_tracker
from infra.run.replay import (
    COMPARED_METRICS,
    ReplayError,
    StoredRun,
    WeightComparison,
    compare_update_rules,
    compare_weights,
    logged_run,
    replay_update,
    rule_configs,
    update_samples,
)
from infra.run.replay import stored_run as open_stored_run
from infra.run.trainer import training_rows
from tasks.data import prepare_data, source_fingerprint


@dataclass
class ReplayResult:
    """What one replayed step gave: where it came from and how it compares."""

    run_id: str
    run_name: str
    step: int
    samples: int
    numerics: str
    """The dtypes replayed in (the run's): compute, generation."""
    weights: WeightComparison
    """The replayed weights against the checkpoint of the step."""
    metrics: dict[str, tuple[float | None, float | None]]
    """Of :data:`~infra.run.replay.COMPARED_METRICS`, (as the run logged it at the step, as replayed)."""


def stored_run(run: str, runs: Path, tracking_uri: str | None, experiment: str) -> StoredRun:
    """The run ``run`` (id or name, in ``tracking_uri``, default the runs dir's store) as
    :class:`~infra.run.replay.StoredRun`, its training rows prepared as its training did."""
    tracker = reading_tracker(runs, tracking_uri, experiment)
    logged = logged_run(tracker, run)
    cfg = logged.cfg
    rows = training_rows(cfg, prepare_data(cfg.data.train, cfg.data, source_fingerprint(cfg.data.train,
                                                                                         cfg.data.data_root)))
    return open_stored_run(tracker, logged, runs, len(rows))


def _check_steps(steps: list[int]) -> None:
    if not steps or min(steps) < 1:
        raise ReplayError(f"--step must be >= 1 (the first RL step is 1); got {steps or 'none'}")


@flow(name="aepo-replay", log_prints=True)
def replay(run: str, step: int, runs_dir: str | None = None, experiment: str = "aepo",
           tracking_uri: str | None = None) -> ReplayResult:
    """Replay step ``step``'s update of ``run`` (an MLflow run id or name, in ``tracking_uri``, default the runs dir's
    store) from the checkpoint before it and compare the weights with the run's checkpoint of that step (see the
    module docstring)."""
    logger = get_run_logger()
    _check_steps([step])
    runs = flow_runs_dir(runs_dir, None)
    stored = stored_run(run, runs, tracking_uri, experiment)
    samples = update_samples(stored.store, stored.run_id, step)
    stored.check_replayable(step)
    logger.info("replaying step %d of %s (%s): %d samples, compute %s", step, stored.name, stored.run_id,
                len(samples), stored.numerics.compute_dtype)
    replayed = replay_update(stored.cfg, stored.numerics, stored.checkpoints.fetch(step - 1), samples,
                             stored.total_steps)
    cmp = compare_weights(replayed.weights, stored.checkpoints.fetch(step))
    logged = stored.logged_update_metrics(step)
    result = ReplayResult(stored.run_id, stored.name, step, len(samples), stored.numerics_text, cmp,
                          {k: (logged[k], replayed.metrics.get(k)) for k in COMPARED_METRICS})
    logger.info("step %d replayed: %d of %d tensors bit-identical to checkpoint %d (max |Δ| %.3g)", step,
                cmp.identical, cmp.tensors, step, cmp.max_abs_diff)
    return result


@dataclass
class RuleComparison:
    """Update rules side by side on the same stored samples (:mod:`aepo_core.update_comparison`)."""

    run_id: str
    run_name: str
    steps: list[int]
    rules: list[str]
    reference: str
    samples: dict[int, int]
    """Per replayed step (the bootstrap's strata), its samples."""
    questions: dict[int, int]
    """Per replayed step, its questions (the clusters the bootstrap redraws, every sample of a drawn one)."""
    numerics: str
    overrides: list[str]
    rows: list[ComparisonRow]
    update_metrics: dict[int, dict[str, dict[str, float]]]
    """Per step, per rule, the update's ``train/…`` metrics (loss, grad norm, clip fractions, …)."""


@flow(name="aepo-replay-rules", log_prints=True)
def replay_rules(run: str, steps: list[int], rules: list[str], overrides: list[str] | None = None,
                 runs_dir: str | None = None, experiment: str = "aepo", tracking_uri: str | None = None,
                 n_resamples: int = 2000, seed: int = 0) -> RuleComparison:
    """Apply each update rule (``<loss>[@key=value,…]``; the first is the reference of the paired differences) to
    each step's stored samples from the checkpoint before that step, and compare per token class what the updates
    did (:func:`aepo_core.update_comparison.compare_rules`; questions resampled within their step, each with all
    its samples)."""
    logger = get_run_logger()
    _check_steps(steps)
    if not rules:
        raise ReplayError("--losses names no update rule")
    stored = stored_run(run, flow_runs_dir(runs_dir, None), tracking_uri, experiment)
    configs = rule_configs(stored.cfg, rules, overrides or [])
    per_rule: dict[str, list[SampleTokens]] = {rule: [] for rule in rules}
    strata: list[int] = []
    clusters: list[str] = []
    sizes: dict[int, int] = {}
    questions: dict[int, int] = {}
    metrics: dict[int, dict[str, dict[str, float]]] = {}
    for step in steps:
        samples = update_samples(stored.store, stored.run_id, step)
        stored.check_replayable(step, after=False)
        logger.info("step %d of %s: %d samples under %s", step, stored.name, len(samples), ", ".join(rules))
        tokens, metrics[step] = compare_update_rules(stored.cfg, configs, stored.numerics,
                                                     stored.checkpoints.fetch(step - 1), samples, stored.total_steps)
        for sample in tokens:
            for rule in rules:
                per_rule[rule].append(sample[rule])
        strata += [step] * len(tokens)
        clusters += [s.question_id for s in samples]
        sizes[step] = len(tokens)
        questions[step] = len({s.question_id for s in samples})
    rows = compare_rules(per_rule, strata, clusters, reference=rules[0], n_resamples=n_resamples, seed=seed)
    return RuleComparison(stored.run_id, stored.name, list(steps), list(rules), rules[0], sizes, questions,
                          stored.numerics_text, list(overrides or []),
                          rows, metrics)
