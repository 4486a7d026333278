"""The comparison of training runs across arms and seeds (``aepo compare``, the ``aepo-compare`` flow and
``bench/compare_algorithms.py`` all call it): what a sweep is for, computed the way the powered comparison was.

**Which runs.** The FINISHED children of a sweep's parent run (:func:`sweep_children`: the sweep found by its name,
its parent run id or its file), or any set of runs (:func:`given_runs`). A run's arm is its ``sweep_cell`` tag (a
sweep's runs carry it; a sweep file's run names name it for runs from before the tag); its seed its ``seed`` tag. Of
a cell run twice, the newest FINISHED run counts.

**Per arm** (:class:`ArmResult`), from each run's final per-question evaluation and its metric histories:

- Pass@1 and Pass@k per question averaged over the arm's seeds, with bootstrap 95 % intervals over questions (about
  these runs), and each run's Pass@1 with a Student-t interval over seeds (about a new run: the headline);
- what the runs spent (generated tokens) and how their entropy moved (each run's least-squares slope per RL step,
  over seeds), the rollout's diversity and branching, the final training reward;
- the **mechanism activity** (:data:`ACTIVITY`): each run's mean over its steps of the share of update tokens its
  loss clipped (all, and on the high side), and of ΔH after tool results, over seeds: how much AEPO's mechanisms had
  to act on (the powered sweep clipped 0.2 % of update tokens in every arm, so its clipping losses barely differed);
- training curves per RL step: the seed mean with the lowest and highest seed (:data:`CURVE_METRICS`), and the same
  against the cumulative generated tokens (:data:`BY_TOKENS`).

**Per pair of arms** (:class:`PairResult`), seed-matched (seed s of a against seed s of b: the same start, data order
and sampling seeds): ΔPass@1 over seeds with its t-test and Holm's correction over every pair reported, the same
given these seeds (bootstrap over questions within each seed), by question family (exploratory), and Δ entropy slope.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

from aepo_core.activity import ACTIVITY_METRICS
from aepo_core.evaluation import Interval, OverSeeds, PairedDiff, paired_over_seeds, pooled_paired_comparison
from aepo_core.metrics import bootstrap_ci, holm_adjust, pass_at_k, t_test_p
from aepo_core.overrides import did_you_mean
from infra.data.loaders import dataset_key
from infra.plots import Band
from infra.run.preflight import InputError
from infra.run.sequential import QuestionOutcomeRow, final_questions
from infra.run.sweep import TAG_CELL, TAG_SWEEP
from infra.run.sweep_spec import SweepSpec, load_sweep
from infra.tracking.run import Tracker

ENTROPY = "train/entropy_mean"
TOKENS = "cost/total_generated_tokens"
CLIP = "train/clip_frac"
CURVE_METRICS = {  # metric → panel title
    ENTROPY: "policy entropy of the update's tokens (nats)",
    "rollout/reward_mean": "training reward",
    "rollout/tool_calls_mean": "tool calls per trajectory",
    "rollout/branches_per_question": "branches per question",
    "rollout/max_branches_per_path": "most branches on one path",
    "rollout/branch_top1_share": "share of branches on the top-1 path",
    "rollout/branch_top3_share": "share of branches on the top-3 paths",
    "rollout/informative_groups": "informative groups in the update",
    TOKENS: "generated tokens, cumulative",
}
"""The curves drawn per arm. The paper claims AEPO keeps the policy entropy stable where ARPO/GRPO collapse or explode
it, and concentrates fewer branches on one path. A metric a run never logged is left out of its arm's curve."""
BY_TOKENS = (ENTROPY, "rollout/reward_mean", "rollout/tool_calls_mean")
"""Drawn once more against the cumulative generated tokens: an arm that branches spends more per step."""
ACTIVITY = ACTIVITY_METRICS
PERCENT = {CLIP, "train/clip_frac_high", "train/high_entropy_share", "train/high_entropy_clip_frac_high",
           "train/high_entropy_clip_frac_low"}
"""The :data:`ACTIVITY` shares a table shows in per cent."""
RUN_METRICS = ("rollout/distinct_tool_sequences", "rollout/max_branches_per_path", "rollout/branch_samples",
               "rollout/reward_mean", "step/wall_s")
CURVES_ARTIFACT_DIR = "training_curves"
TABLES_ARTIFACT_DIR = "compare"
TREND_WORDS = {"> 0": "rising", "< 0": "falling", "0 in CI": "none shown (0 in CI)", "one seed": "one seed"}
"""An arm's entropy trend in words, from the sign of its runs' slopes over seeds (:attr:`OverSeeds.sign`)."""
DEFAULT_BASELINE = "grpo"


class ComparisonError(InputError):
    """The runs asked for cannot be compared (no such sweep, run or dataset; no finished run): exit status 2."""


# ---------------------------------------------------------------------------------------------- which runs
@dataclass(frozen=True)
class ComparedRun:
    """One finished training run in a comparison: its arm, seed and MLflow identity."""

    arm: str
    seed: int
    run_id: str
    run_name: str


@dataclass(frozen=True)
class Selection:
    """The runs of a comparison and where they came from (the sweep's parent run gets the comparison logged)."""

    runs: list[ComparedRun]
    tracking_uri: str
    parent_run_id: str | None = None
    sweep_name: str | None = None

    def only(self, arms: Sequence[str] | None, seeds: Sequence[int] | None) -> Selection:
        """These arms (in the order given) and seeds only; an arm or seed none of the runs has is an error."""
        runs = self.runs
        if arms:
            unknown = [a for a in arms if a not in {r.arm for r in runs}]
            if unknown:
                hint, known = did_you_mean(unknown[0], self.arms), ", ".join(self.arms)
                raise ComparisonError(f"no arm {', '.join(unknown)} among the runs{hint} (arms: {known})")
            runs = sorted((r for r in runs if r.arm in arms), key=lambda r: (list(arms).index(r.arm), r.seed))
        if seeds:
            missing = sorted(set(seeds) - {r.seed for r in runs})
            if missing:
                raise ComparisonError(f"no run of seed {', '.join(map(str, missing))} (seeds: "
                                      f"{', '.join(map(str, sorted({r.seed for r in runs})))})")
            runs = [r for r in runs if r.seed in seeds]
        return Selection(runs, self.tracking_uri, self.parent_run_id, self.sweep_name)

    @property
    def arms(self) -> list[str]:
        return list(dict.fromkeys(r.arm for r in self.runs))


def newest_sweep_parent(tracker: Tracker, sweep_name: str) -> str:
    """The newest parent run of the sweep named ``sweep_name`` (a re-run or resumed sweep re-parents every finished
    child to its newest parent, so that one holds the whole sweep)."""
    parents = tracker.search_runs(filter_string=f"tags.{TAG_SWEEP} = '{sweep_name}' AND tags.kind = 'sweep'")
    if parents.empty:
        known = sorted(set(tracker.search_runs(filter_string="tags.kind = 'sweep'").get(f"tags.{TAG_SWEEP}", [])))
        raise ComparisonError(f"no sweep named {sweep_name!r} at {tracker.tracking_uri} (sweeps: "
                              f"{', '.join(map(str, known)) or 'none'})")
    return str(parents.iloc[0]["run_id"])


def sweep_children(tracker: Tracker, parent_run_id: str, spec: SweepSpec | None = None) -> Selection:
    """The FINISHED children of the sweep's parent run, newest per (arm, seed), in the order their arms first
    started (a sweep file's order where ``spec`` is given)."""
    parent = _run(tracker, parent_run_id)
    finished = f"tags.mlflow.parentRunId = '{parent_run_id}' AND attributes.status = 'FINISHED'"
    children = tracker.search_runs(filter_string=finished, order_by=["attributes.start_time ASC"])
    named = {r.run_name: (r.cell, r.seed) for r in spec.runs} if spec is not None else {}
    runs = {}
    for _, child in children.iterrows():
        cell, seed = child.get(f"tags.{TAG_CELL}"), child.get("tags.seed")
        arm_seed = (cell, int(seed)) if isinstance(cell, str) and isinstance(seed, str) else named.get(
            child["run_name"])
        if arm_seed is not None:  # later starts replace earlier ones: the newest run of a cell counts
            runs[arm_seed] = ComparedRun(arm_seed[0], arm_seed[1], str(child["run_id"]), str(child["run_name"]))
    if not runs:
        raise ComparisonError(f"run {parent_run_id} ({parent.info.run_name}) has no finished sweep cell yet")
    order = {c: i for i, c in enumerate(spec.cells)} if spec is not None else {}
    first = list(dict.fromkeys(arm for arm, _ in runs))
    ranked = sorted(runs.values(), key=lambda r: (order.get(r.arm, len(order) + first.index(r.arm)), r.seed))
    return Selection(ranked, tracker.tracking_uri, parent_run_id, parent.data.tags.get(TAG_SWEEP))


RUN_ID = re.compile(r"^[0-9a-f]{32}$")
"""What an MLflow run id looks like: a sweep target of this shape is a parent run id, not a sweep name."""


def sweep_selection(tracker: Tracker, target: str) -> Selection:
    """The runs of the sweep ``target`` names: a sweep file (``.yaml``/``.yml``: its name, and its run names for
    runs from before the cell tags), a parent run id, or a sweep name (its newest parent run)."""
    path = Path(target).expanduser()
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ComparisonError(f"no sweep file {target}")
        spec = load_sweep(path)
        return sweep_children(tracker, newest_sweep_parent(tracker, spec.name), spec)
    if RUN_ID.match(target):
        return sweep_children(tracker, target)
    return sweep_children(tracker, newest_sweep_parent(tracker, target))


def find_runs(tracking_uri: str, sweep: str | None, run_ids: Sequence[str], arms: Sequence[str] | None = None,
              seeds: Sequence[int] | None = None) -> Selection:
    """The runs to compare at ``tracking_uri``: the sweep ``sweep`` names (:func:`sweep_selection`) or the runs
    ``run_ids`` (:func:`given_runs`), these arms and seeds only where given (:meth:`Selection.only`)."""
    tracker = Tracker(tracking_uri)
    return (sweep_selection(tracker, sweep) if sweep else given_runs(tracker, run_ids)).only(arms, seeds)


def _run(tracker: Tracker, run_id: str) -> Any:
    """The MLflow run ``run_id``; :class:`ComparisonError` only where the store says there is no such run (an
    unknown or malformed id): a store that fails to answer stays the fault it is."""
    try:
        return tracker.client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        raise ComparisonError(f"no run {run_id} at {tracker.tracking_uri}") from None


def given_runs(tracker: Tracker, run_ids: Sequence[str]) -> Selection:
    """Runs named by id: arm from the ``sweep_cell`` tag, else the ``algorithm`` tag, else the run name; seed from
    the ``seed`` tag. Each must be FINISHED."""
    runs = []
    for run_id in run_ids:
        run = _run(tracker, run_id)
        if run.info.status != "FINISHED":
            raise ComparisonError(f"run {run_id} ({run.info.run_name}) is {run.info.status}, not FINISHED")
        tags = run.data.tags
        arm = tags.get(TAG_CELL) or tags.get("algorithm") or run.info.run_name
        seed = tags.get("seed", "0")
        runs.append(ComparedRun(arm, int(seed) if seed.lstrip("-").isdigit() else 0, run_id, run.info.run_name))
    clash = [f"{r.arm} seed {r.seed}" for i, r in enumerate(runs) if (r.arm, r.seed) in
             {(o.arm, o.seed) for o in runs[:i]}]
    if clash:
        raise ComparisonError(f"two runs are {clash[0]}: a comparison pairs one run per arm and seed")
    return Selection(runs, tracker.tracking_uri)


# ---------------------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class RunReadings:
    """What one run contributes: its final per-question outcomes on the dataset, its metric histories and its
    evaluation's tool calls per question."""

    run: ComparedRun
    questions: list[QuestionOutcomeRow]
    histories: dict[str, list[tuple[int, float]]]
    tool_calls_per_question: float


def evaluated_datasets(tracker: Tracker, runs: Sequence[ComparedRun]) -> list[str]:
    """The datasets (metric keys, ``synthetic_test``) every run's final evaluation covered, sorted."""
    common: set[str] | None = None
    for run in runs:
        metrics = tracker.client.get_run(run.run_id).data.metrics
        have = {k.split("/")[1] for k in metrics if k.startswith("eval/") and k.endswith("/pass_at_1")}
        common = have if common is None else common & have
    return sorted(common or ())


def read_run(tracker: Tracker, run: ComparedRun, dataset: str, workdir: Path) -> RunReadings:
    """The run's final evaluation on ``dataset`` (downloaded into ``workdir``) and its histories."""
    questions = final_questions(tracker.tracking_uri, run.run_id, dataset_key(dataset), workdir)
    keys = list(dict.fromkeys([*RUN_METRICS, *CURVE_METRICS, *ACTIVITY]))
    histories = tracker.metric_history(keys, run_id=run.run_id)
    calls = tracker.metric_history([f"eval/{dataset}/tool_calls_per_question"], run_id=run.run_id)
    last = next(iter(calls.values()))
    return RunReadings(run, questions, histories, last[-1][1] if last else math.nan)


# ---------------------------------------------------------------------------------------------- per arm
@dataclass(frozen=True)
class EntropyTrend:
    """How an arm's seed-mean policy entropy moved over training: a description. Whether it rose or fell is judged
    by the runs' slopes over seeds (:attr:`ArmResult.entropy_slope`, an interval), not here: a last/first ratio rests
    on two noisy steps and called any rise from a near-zero start (0.04 → 0.10 nats after SFT) "exploded"."""

    first: float  # at the first RL step
    last: float  # at the last
    slope: float  # least-squares slope per RL step


@dataclass(frozen=True)
class ArmResult:
    """One arm over its seeds (see the module docstring)."""

    name: str
    runs: list[str]  # run names, in seed order
    run_ids: list[str]  # their MLflow run ids
    questions: int  # questions every seed's run answered
    pass1: Interval  # per-question Pass@1 averaged over seeds; bootstrap 95 % CI over questions
    pass_k: Interval
    pass1_over_seeds: OverSeeds  # each run's Pass@1; Student-t interval over seeds
    per_question_pass1: dict[str, float]
    per_question_pass1_by_seed: dict[int, dict[str, float]]
    question_family: dict[str, str]  # question → family, where the evaluation files record it
    entropy_slope: OverSeeds | None  # each run's least-squares slope per RL step of train/entropy_mean
    generated_tokens: OverSeeds | None  # each run's total generated tokens
    activity: dict[str, OverSeeds]  # ACTIVITY metric → each run's mean over its steps, over seeds (logged ones)
    tool_calls_per_question: float  # at the final evaluation, mean over seeds
    distinct_tool_sequences_per_group: float  # during training, mean over steps and seeds
    max_branches_on_one_path: float
    max_branches_per_path_mean: float
    branch_samples_per_step: float
    train_reward_last_step: float
    rl_wall_s_per_run: float  # Σ step/wall_s, mean over seeds
    entropy_trend: EntropyTrend | None
    curves: dict[str, list[Band]] = field(default_factory=dict)  # CURVE_METRICS metric → (step, mean, min, max)
    vs_baseline: PairedDiff | None = None  # per-question Pass@1 − the baseline arm's, over these seeds

    @property
    def seeds(self) -> list[int]:
        return list(self.pass1_over_seeds.per_seed)

    def curves_by_tokens(self) -> dict[str, list[Band]]:
        """The :data:`BY_TOKENS` curves with the step replaced by the cumulative generated tokens through it (the
        seed mean of :data:`TOKENS` there); steps without a token count, and runs from before it, are left out."""
        spent = {step: mean for step, mean, _, _ in self.curves.get(TOKENS, [])}
        out = {m: [(spent[b[0]], *b[1:]) for b in self.curves[m] if b[0] in spent]
               for m in BY_TOKENS if m in self.curves}
        return {m: band for m, band in out.items() if band}


def _mean(values: Sequence[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def ols_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope Σ(x − x̄)(y − ȳ) / Σ(x − x̄)² of (step, value) points: the straight line through every
    step, so one noisy step moves it by its share only (a last/first ratio rests on two steps); None with fewer than
    two distinct steps."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    if len(set(xs)) < 2:
        return None
    x_bar, y_bar = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - x_bar) * (y - y_bar) for x, y in zip(xs, ys, strict=True)) / sum((x - x_bar) ** 2 for x in xs)


def entropy_trend(band: Sequence[Band]) -> EntropyTrend | None:
    """The mean curve's first and last values and its slope (:func:`ols_slope`); None with fewer than 2 steps."""
    slope = ols_slope([(b[0], b[1]) for b in band])
    return None if slope is None else EntropyTrend(band[0][1], band[-1][1], slope)


def seed_bands(histories: Sequence[Mapping[str, Sequence[tuple[int, float]]]], metrics: Sequence[str]
               ) -> dict[str, list[Band]]:
    """Per metric and RL step, over the seeds' runs that logged it there: (step, mean, min, max). A metric no run
    logged is absent; a step some runs lack (stopped early) averages the others."""
    out: dict[str, list[Band]] = {}
    for metric in metrics:
        by_step: dict[int, list[float]] = {}
        for hist in histories:
            for step, value in hist.get(metric, []):
                by_step.setdefault(int(step), []).append(float(value))
        if by_step:
            out[metric] = [(step, sum(v) / len(v), min(v), max(v)) for step, v in sorted(by_step.items())]
    return out


def _over_seeds(values: Mapping[int, float | None]) -> OverSeeds | None:
    kept = {s: v for s, v in values.items() if v is not None and not math.isnan(v)}
    return OverSeeds.of(kept) if kept else None


def arm_result(name: str, readings: Sequence[RunReadings], k: int, n_resamples: int, seed: int = 0) -> ArmResult:
    """An arm's statistics from its runs' readings (one per seed)."""
    by_seed = {r.run.seed: r for r in sorted(readings, key=lambda r: r.run.seed)}
    per_seed = {s: r.questions for s, r in by_seed.items()}
    common = sorted(set.intersection(*({o.question_id for o in rows} for rows in per_seed.values())))
    p1: dict[str, float] = {}
    pk: dict[str, float] = {}
    for q in common:
        outs = [next(o for o in rows if o.question_id == q) for rows in per_seed.values()]
        p1[q] = sum(pass_at_k(o.n, o.correct, 1) for o in outs) / len(outs)
        pk[q] = sum(pass_at_k(o.n, o.correct, min(k, o.n)) for o in outs) / len(outs)
    hists = {s: r.histories for s, r in by_seed.items()}
    curves = seed_bands(list(hists.values()), list(CURVE_METRICS))
    activity = {m: o for m in ACTIVITY
                if (o := _over_seeds({s: _mean([v for _, v in h[m]]) if h.get(m) else None
                                      for s, h in hists.items()})) is not None}
    steps = [v for h in hists.values() for _, v in h.get("rollout/max_branches_per_path", [])]
    return ArmResult(
        name=name, runs=[r.run.run_name for r in by_seed.values()], run_ids=[r.run.run_id for r in by_seed.values()],
        questions=len(common),
        pass1=Interval(*bootstrap_ci([p1[q] for q in common], n_resamples=n_resamples, seed=seed)),
        pass_k=Interval(*bootstrap_ci([pk[q] for q in common], n_resamples=n_resamples, seed=seed)),
        pass1_over_seeds=OverSeeds.of({s: sum(pass_at_k(o.n, o.correct, 1) for o in rows) / len(rows)
                                       for s, rows in per_seed.items()}),
        per_question_pass1=p1,
        # each run's own per-question Pass@1: bench/power.py separates seed, question and arm × question variance
        per_question_pass1_by_seed={s: {o.question_id: pass_at_k(o.n, o.correct, 1) for o in rows
                                        if o.question_id in p1} for s, rows in per_seed.items()},
        question_family={o.question_id: o.family for rows in per_seed.values() for o in rows
                         if o.question_id in p1 and o.family is not None},
        entropy_slope=_over_seeds({s: ols_slope(h.get(ENTROPY, [])) for s, h in hists.items()}),
        generated_tokens=_over_seeds({s: h[TOKENS][-1][1] if h.get(TOKENS) else None for s, h in hists.items()}),
        activity=activity,
        tool_calls_per_question=_mean([r.tool_calls_per_question for r in by_seed.values()]),
        distinct_tool_sequences_per_group=_mean([v for h in hists.values()
                                                 for _, v in h.get("rollout/distinct_tool_sequences", [])]),
        max_branches_on_one_path=max(steps, default=math.nan), max_branches_per_path_mean=_mean(steps),
        branch_samples_per_step=_mean([v for h in hists.values() for _, v in h.get("rollout/branch_samples", [])]),
        train_reward_last_step=_mean([h["rollout/reward_mean"][-1][1] for h in hists.values()
                                      if h.get("rollout/reward_mean")]),
        rl_wall_s_per_run=_mean([sum(v for _, v in h.get("step/wall_s", [])) for h in hists.values()]),
        entropy_trend=entropy_trend(curves.get(ENTROPY, [])),
        curves=curves,
    )


# ---------------------------------------------------------------------------------------------- pairs
@dataclass(frozen=True)
class PairResult:
    """Arm a against arm b, seed-matched:

    - ``pass1``: per seed the mean per-question Pass@1 difference a − b on the questions both answered, then its
      mean over seeds with a Student-t interval: what a new pair of runs would show; the headline;
    - ``pass1_given_seeds``: the same mean with a bootstrap over questions within each seed
      (:func:`~aepo_core.evaluation.pooled_paired_comparison`): about these runs only, narrower;
    - ``p_over_seeds``: the two-sided one-sample t-test of the per-seed differences (None with one seed), and
      ``p_holm`` the same adjusted by Holm's step-down over every pair compared together (at 0.05 each, three pairs
      would show a false difference up to 14 % of the time);
    - ``entropy_slope``: the seed-matched difference of the entropy slopes (nats per RL step);
    - ``by_family``: ``pass1`` on each question family alone: exploratory, no correction."""

    a: str
    b: str
    pass1: OverSeeds
    p_over_seeds: float | None
    p_holm: float | None
    pass1_given_seeds: dict[str, float]  # diff, ci_low, ci_high, runs, positive (seeds a > b), questions
    entropy_slope: OverSeeds | None
    by_family: dict[str, OverSeeds]

    @property
    def name(self) -> str:
        return f"{self.a} - {self.b}"


def _families(a: Mapping[str, str], b: Mapping[str, str]) -> dict[str, set[str]]:
    """Family → its questions, where two arms' evaluations agree on a question's family; none with one family."""
    out: dict[str, set[str]] = {}
    for q, f in a.items():
        if b.get(q) == f:
            out.setdefault(f, set()).add(q)
    return dict(sorted(out.items())) if len(out) > 1 else {}


def _only(per_question: Mapping[str, float], keep: set[str]) -> dict[str, float]:
    return {q: v for q, v in per_question.items() if q in keep}


def paired_differences(arms: Sequence[ArmResult], n_resamples: int) -> list[PairResult]:
    """Every pair of arms (in the arms' order: a before b) with a common seed (see :class:`PairResult`)."""
    pairs = []
    for i, a in enumerate(arms):
        for b in arms[i + 1:]:
            qa, qb = a.per_question_pass1_by_seed, b.per_question_pass1_by_seed
            seeds = sorted(set(qa) & set(qb))
            if not seeds:
                continue
            sa, sb = ((x.entropy_slope.per_seed if x.entropy_slope else {}) for x in (a, b))
            diff = paired_over_seeds({s: (qa[s], qb[s]) for s in seeds})
            p = t_test_p(list(diff.per_seed.values()))
            pairs.append(PairResult(
                a.name, b.name, diff, None if math.isnan(p) else p, None,
                pooled_paired_comparison([(qa[s], qb[s]) for s in seeds], n_resamples=n_resamples),
                _over_seeds({s: sa[s] - sb[s] for s in seeds if s in sa and s in sb}),
                {f: paired_over_seeds({s: (_only(qa[s], keep), _only(qb[s], keep)) for s in seeds})
                 for f, keep in _families(a.question_family, b.question_family).items()}))
    holm = holm_adjust({p.name: math.nan if p.p_over_seeds is None else p.p_over_seeds for p in pairs})
    return [PairResult(p.a, p.b, p.pass1, p.p_over_seeds, None if math.isnan(holm[p.name]) else holm[p.name],
                       p.pass1_given_seeds, p.entropy_slope, p.by_family) for p in pairs]


# ---------------------------------------------------------------------------------------------- the comparison
@dataclass(frozen=True)
class AlgorithmComparison:
    """Arms over seeds and their seed-matched pairs on one evaluation dataset (see the module docstring)."""

    dataset: str
    k: int
    arms: list[ArmResult]
    pairs: list[PairResult]
    baseline: str | None  # the arm every other arm's ``vs_baseline`` is against (None: no such arm)
    tracking_uri: str
    parent_run_id: str | None = None
    sweep_name: str | None = None

    def arm(self, name: str) -> ArmResult:
        return next(a for a in self.arms if a.name == name)

    def arm_records(self) -> list[dict[str, Any]]:
        """One row per arm, numbers as numbers (the table, CSV and JSON rows; the MLflow table)."""
        rows = []
        for a in self.arms:
            p, s, t, vs = a.pass1_over_seeds, a.entropy_slope, a.generated_tokens, a.vs_baseline
            rows.append({
                "arm": a.name, "dataset": self.dataset, "seeds": p.seeds, "questions": a.questions,
                "pass@1": p.mean, "pass@1 low": p.low, "pass@1 high": p.high,
                "pass@1 over questions": a.pass1.value, "pass@1 over questions low": a.pass1.low,
                "pass@1 over questions high": a.pass1.high,
                f"pass@{self.k}": a.pass_k.value, f"pass@{self.k} low": a.pass_k.low,
                f"pass@{self.k} high": a.pass_k.high,
                f"vs {self.baseline}": vs.diff if vs else None, f"vs {self.baseline} low": vs.ci_low if vs else None,
                f"vs {self.baseline} high": vs.ci_high if vs else None,
                "generated tokens": t.mean if t else None, "tool calls/q": a.tool_calls_per_question,
                **{f"{heading}": (o.mean if (o := a.activity.get(m)) else None) for m, heading in ACTIVITY.items()},
                "entropy first": a.entropy_trend.first if a.entropy_trend else None,
                "entropy last": a.entropy_trend.last if a.entropy_trend else None,
                "entropy slope": s.mean if s else None, "entropy slope low": s.low if s else None,
                "entropy slope high": s.high if s else None,
                "entropy trend": TREND_WORDS[s.sign] if s else None,
                "reward last": a.train_reward_last_step})
        return rows

    def run_records(self) -> list[dict[str, Any]]:
        """One row per run: its arm, seed, ids, Pass@1, spend, entropy slope and mechanism activity."""
        rows = []
        for a in self.arms:
            for seed, name, run_id in zip(a.seeds, a.runs, a.run_ids, strict=True):
                rows.append({
                    "arm": a.name, "seed": seed, "run name": name, "run id": run_id, "dataset": self.dataset,
                    "pass@1": a.pass1_over_seeds.per_seed[seed],
                    "generated tokens": a.generated_tokens.per_seed.get(seed) if a.generated_tokens else None,
                    "entropy slope": a.entropy_slope.per_seed.get(seed) if a.entropy_slope else None,
                    **{heading: (o.per_seed.get(seed) if (o := a.activity.get(m)) else None)
                       for m, heading in ACTIVITY.items()}})
        return rows

    def pair_records(self) -> list[dict[str, Any]]:
        """One row per pair of arms (and, after them, per pair and question family: exploratory)."""
        rows = []
        for p in self.pairs:
            g, e = p.pass1_given_seeds, p.entropy_slope
            rows.append({"pair": p.name, "a": p.a, "b": p.b, "family": "all", "seeds": p.pass1.seeds,
                         "delta pass@1": p.pass1.mean, "low": p.pass1.low, "high": p.pass1.high,
                         "p": p.p_over_seeds, "p holm": p.p_holm, "given seeds": g["diff"],
                         "given seeds low": g["ci_low"], "given seeds high": g["ci_high"],
                         "seeds a above b": int(g["positive"]), "delta entropy slope": e.mean if e else None,
                         "delta entropy slope low": e.low if e else None,
                         "delta entropy slope high": e.high if e else None})
        for p in self.pairs:
            for family, d in p.by_family.items():
                rows.append({"pair": p.name, "a": p.a, "b": p.b, "family": family, "seeds": d.seeds,
                             "delta pass@1": d.mean, "low": d.low, "high": d.high, "p": None, "p holm": None,
                             "given seeds": None, "given seeds low": None, "given seeds high": None,
                             "seeds a above b": sum(v > 0 for v in d.per_seed.values()), "delta entropy slope": None,
                             "delta entropy slope low": None, "delta entropy slope high": None})
        return rows

    def curve_records(self) -> list[dict[str, Any]]:
        """The curves in long form: one row per (arm, metric, step) with the seed mean, lowest and highest seed and
        the seed-mean cumulative generated tokens through that step (None where the runs did not count them)."""
        rows = []
        for a in self.arms:
            spent = {step: mean for step, mean, _, _ in a.curves.get(TOKENS, [])}
            for metric, band in a.curves.items():
                rows.extend({"arm": a.name, "metric": metric, "step": int(step), "generated tokens": spent.get(step),
                             "mean": mean, "min": low, "max": high} for step, mean, low, high in band)
        return rows

    def as_json(self) -> dict[str, Any]:
        """The comparison as one JSON document (``bench/compare_algorithms.py``'s layout, which ``bench/power.py``
        reads): ``arms`` (each arm's summary), ``paired``, and per-arm tables at the top level."""
        def arm_json(a: ArmResult) -> dict[str, Any]:
            return {"questions": a.questions, "pass@1": a.pass1.value, "pass@1_ci": [a.pass1.low, a.pass1.high],
                    "pass@k": a.pass_k.value, "pass@k_ci": [a.pass_k.low, a.pass_k.high],
                    "pass@1_by_seed": a.pass1_over_seeds.per_seed, "pass@1_over_seeds": asdict(a.pass1_over_seeds),
                    "entropy_slope": asdict(a.entropy_slope) if a.entropy_slope else None,
                    "generated_tokens_per_run": asdict(a.generated_tokens) if a.generated_tokens else None,
                    "clip_frac_per_run": asdict(a.activity[CLIP]) if CLIP in a.activity else None,
                    "activity": {m: asdict(o) for m, o in a.activity.items()},
                    "runs": a.runs, "tool_calls_per_question": a.tool_calls_per_question,
                    "distinct_tool_sequences_per_group": a.distinct_tool_sequences_per_group,
                    "max_branches_on_one_path": a.max_branches_on_one_path,
                    "max_branches_per_path_mean": a.max_branches_per_path_mean,
                    "branch_samples_per_step": a.branch_samples_per_step,
                    "train_reward_last_step": a.train_reward_last_step, "rl_wall_s_per_run": a.rl_wall_s_per_run,
                    "entropy_trend": asdict(a.entropy_trend) if a.entropy_trend else None,
                    f"vs_{self.baseline}": a.vs_baseline.as_dict() if a.vs_baseline else None}

        return {
            "dataset": self.dataset, "k": self.k, "baseline": self.baseline, "tracking_uri": self.tracking_uri,
            "parent_run_id": self.parent_run_id, "sweep_name": self.sweep_name,
            "arms": {a.name: arm_json(a) for a in self.arms},
            "paired": {p.name: {"a": p.a, "b": p.b, "pass@1": asdict(p.pass1), "p_over_seeds": p.p_over_seeds,
                                "p_holm": p.p_holm, "pass@1_given_seeds": p.pass1_given_seeds,
                                "entropy_slope": asdict(p.entropy_slope) if p.entropy_slope else None,
                                "by_family": {f: asdict(d) for f, d in p.by_family.items()}} for p in self.pairs},
            "per_question_pass@1": {a.name: a.per_question_pass1 for a in self.arms},
            "per_question_pass@1_by_seed": {a.name: a.per_question_pass1_by_seed for a in self.arms},
            "question_family": {a.name: a.question_family for a in self.arms},
            "curves": {a.name: a.curves for a in self.arms},
        }


def compare_runs(selection: Selection, workdir: Path, dataset: str | None = None,
                 baseline: str | None = DEFAULT_BASELINE) -> AlgorithmComparison:
    """The comparison of ``selection``'s runs on ``dataset`` (default: the first every run evaluated), k and the
    bootstrap's resamples from the runs' ``eval`` params. ``baseline``: the arm each other arm is compared with per
    question (ignored where no arm has that name)."""
    tracker = Tracker(selection.tracking_uri)
    datasets = evaluated_datasets(tracker, selection.runs)
    if not datasets:
        raise ComparisonError("the runs have no final evaluation on a common dataset")
    chosen = dataset_key(dataset) if dataset else datasets[0]
    if chosen not in datasets:
        raise ComparisonError(f"no final evaluation on {dataset!r} in every run (datasets: {', '.join(datasets)})")
    params = tracker.client.get_run(selection.runs[0].run_id).data.params
    k = int(params.get("eval.pass_k", 2))
    n_resamples = int(params.get("eval.bootstrap_samples", 1000))
    readings: dict[str, list[RunReadings]] = {}
    for run in selection.runs:
        readings.setdefault(run.arm, []).append(read_run(tracker, run, chosen, workdir))
    arms = [arm_result(name, rows, k, n_resamples) for name, rows in readings.items()]
    base = next((a for a in arms if a.name == baseline), None)
    if base is not None:
        arms = [a if a is base else _with_baseline(a, base, n_resamples) for a in arms]
    return AlgorithmComparison(chosen, k, arms, paired_differences(arms, n_resamples),
                               baseline if base is not None else None, selection.tracking_uri,
                               selection.parent_run_id, selection.sweep_name)


def _with_baseline(arm: ArmResult, base: ArmResult, n_resamples: int) -> ArmResult:
    return replace(arm, vs_baseline=PairedDiff.of(arm.per_question_pass1, base.per_question_pass1,
                                                  n_resamples=n_resamples))


# ---------------------------------------------------------------------------------------------- figures and logging
def comparison_figures(comparison: AlgorithmComparison, out_dir: Path, title: str) -> list[Path]:
    """``entropy_over_training.png`` (the policy entropy per arm), ``training_curves.png`` (a panel per curve
    metric any arm logged) and ``curves_by_tokens.png`` (the :data:`BY_TOKENS` curves against the cumulative
    generated tokens) under ``out_dir``; the paths written (none when no arm has a curve)."""
    from infra.plots import arm_curves_figure, save_png

    panels = {f"{CURVE_METRICS[m]} ({m})": curves for m in CURVE_METRICS
              if (curves := {a.name: a.curves[m] for a in comparison.arms if m in a.curves})}
    written = []
    entropy = f"{CURVE_METRICS[ENTROPY]} ({ENTROPY})"
    if entropy in panels:
        written.append(save_png(arm_curves_figure({entropy: panels[entropy]},
                                                  f"{title}: entropy over training (mean and seed range)"),
                                out_dir / "entropy_over_training.png"))
    if panels:
        written.append(save_png(arm_curves_figure(panels, f"{title}: training curves per arm (mean and seed range)"),
                                out_dir / "training_curves.png"))
    spent = {a.name: a.curves_by_tokens() for a in comparison.arms}
    token_panels = {f"{CURVE_METRICS[m]} ({m})": curves for m in BY_TOKENS
                    if (curves := {name: c[m] for name, c in spent.items() if m in c})}
    if token_panels:
        written.append(save_png(arm_curves_figure(token_panels, f"{title}: against the tokens spent (mean and seed "
                                                  "range)", xlabel=f"{CURVE_METRICS[TOKENS]} (seed mean)"),
                                out_dir / "curves_by_tokens.png"))
    return written


def log_comparison(comparison: AlgorithmComparison, run_id: str, figures: Sequence[Path]) -> list[str]:
    """The comparison on MLflow run ``run_id`` (the sweep's parent): the arm, pair and curve tables as MLflow tables
    (``compare/arms.json``, ``runs.json``, ``pairs.json``, ``curves.json``: the Artifacts tab shows them as tables;
    a later comparison replaces them), the whole comparison as ``compare/comparison.json``, and the figures under
    ``training_curves/``. Returns the artifact paths logged."""
    client = Tracker(comparison.tracking_uri).client
    logged = []
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, rows in (("arms", comparison.arm_records()), ("runs", comparison.run_records()),
                           ("pairs", comparison.pair_records()), ("curves", comparison.curve_records())):
            if rows:  # MLflow's table format; written here, not by log_table, which appends to an earlier table
                path = Path(tmp) / f"{name}.json"
                path.write_text(pd.DataFrame(rows).to_json(orient="split", index=False), encoding="utf-8")
                client.log_artifact(run_id, str(path), TABLES_ARTIFACT_DIR)
                tables.append({"path": f"{TABLES_ARTIFACT_DIR}/{name}.json", "type": "table"})
    known = json.loads(client.get_run(run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
    client.set_tag(run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps([*known, *(t for t in tables if t not in known)]))
    logged += [t["path"] for t in tables]
    client.log_dict(run_id, comparison.as_json(), f"{TABLES_ARTIFACT_DIR}/comparison.json")
    logged.append(f"{TABLES_ARTIFACT_DIR}/comparison.json")
    for path in figures:
        client.log_artifact(run_id, str(path), CURVES_ARTIFACT_DIR)
        logged.append(f"{CURVES_ARTIFACT_DIR}/{path.name}")
    return logged
