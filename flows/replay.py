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

from aepo_core.config import ExperimentConfig
from aepo_core.update_comparison import ComparisonRow, SampleTokens, compare_rules
from flows.common import flow_runs_dir
from infra.numerics import Numerics, device_facts, numerics_for
from infra.run.checkpoints import CheckpointStore, checkpoint_store
from infra.run.replay import (
    ReplayError,
    WeightComparison,
    compare_update_rules,
    compare_weights,
    replay_update,
    rule_configs,
    update_samples,
)
from infra.run.trainer import data_order, total_steps, training_rows
from infra.store import TrajectoryStore
from infra.tracking.client import tracking_uri_for
from infra.tracking.run import Tracker
from tasks.data import prepare_data, source_fingerprint

COMPARED_METRICS = ("train/loss", "train/grad_norm", "train/clip_frac", "train/entropy_mean")
"""The step's logged update metrics set beside the replay's."""


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
    """Of :data:`COMPARED_METRICS`, (as the run logged it at the step, as replayed)."""


def find_run(tracker: Tracker, run: str) -> tuple[str, str]:
    """(run id, run name) of a run id or, else, the newest run of that name."""
    from mlflow.exceptions import MlflowException

    try:
        info = tracker.client.get_run(run).info
        return info.run_id, info.run_name
    except MlflowException:
        named = tracker.runs_named(run)
        if not named:
            raise ReplayError(f"no MLflow run with id or name {run!r} in experiment {tracker.experiment!r} at "
                              f"{tracker.tracking_uri}") from None
        return named[0].run_id, run


def run_numerics(params: dict[str, str], fallback: Numerics) -> Numerics:
    """The dtypes the run computed in (its ``numerics.*`` params); this machine's resolution where it logged none."""
    if "numerics.compute_dtype" not in params:
        return fallback
    return Numerics(params["numerics.compute_dtype"], params["numerics.generation_dtype"],
                    params.get("numerics.vllm_dtype", fallback.vllm_dtype), device_facts())


@dataclass(frozen=True)
class StoredRun:
    """What replaying a run's steps reads: its config, numerics, store, checkpoints and LR-schedule length."""

    run_id: str
    name: str
    cfg: ExperimentConfig
    numerics: Numerics
    store: TrajectoryStore
    checkpoints: CheckpointStore
    total_steps: int

    def check_replayable(self, step: int, after: bool = True) -> None:
        """Refuse a step without the checkpoint of step N − 1 (and of step N, when ``after``)."""
        stored = self.checkpoints.steps()
        needed = [step - 1, step] if after else [step - 1]
        if any(s not in stored for s in needed):
            raise ReplayError(f"run {self.name} ({self.run_id}): replaying step {step} needs the checkpoint"
                              f"{'s of steps' if after else ' of step'} {' and '.join(map(str, needed))}; "
                              f"{self.checkpoints} holds {stored or 'none'} (checkpoint.every: 1 keeps every step)")


def stored_run(tracker: Tracker, run: str, runs: Path) -> StoredRun:
    """The run ``run`` (id or name) as :class:`StoredRun`."""
    run_id, name = find_run(tracker, run)
    cfg = tracker.logged_config(run_id)
    store = TrajectoryStore.from_config(cfg.storage, runs_dir=runs)
    rows = training_rows(cfg, prepare_data(cfg.data.train, cfg.data,
                                           source_fingerprint(cfg.data.train, cfg.data.data_root)))
    params = tracker.client.get_run(run_id).data.params
    return StoredRun(run_id, name, cfg, run_numerics(params, numerics_for(cfg)), store,
                     checkpoint_store(cfg, runs, name, run_id), total_steps(cfg, data_order(cfg, len(rows))))


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
    tracker = Tracker(tracking_uri or tracking_uri_for(runs), experiment=experiment)
    stored = stored_run(tracker, run, runs)
    samples = update_samples(stored.store, stored.run_id, step)
    stored.check_replayable(step)
    numerics = stored.numerics
    logger.info("replaying step %d of %s (%s): %d samples, compute %s", step, stored.name, stored.run_id,
                len(samples), numerics.compute_dtype)
    replayed = replay_update(stored.cfg, numerics, stored.checkpoints.fetch(step - 1), samples, stored.total_steps)
    cmp = compare_weights(replayed.weights, stored.checkpoints.fetch(step))
    history = tracker.metric_history(list(COMPARED_METRICS), run_id=stored.run_id)
    logged = {k: next((v for s, v in history[k] if s == step), None) for k in COMPARED_METRICS}
    result = ReplayResult(stored.run_id, stored.name, step, len(samples),
                          f"{numerics.compute_dtype}, {numerics.generation_dtype}", cmp,
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
    runs = flow_runs_dir(runs_dir, None)
    tracker = Tracker(tracking_uri or tracking_uri_for(runs), experiment=experiment)
    stored = stored_run(tracker, run, runs)
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
                          f"{stored.numerics.compute_dtype}, {stored.numerics.generation_dtype}", list(overrides or []),
                          rows, metrics)
