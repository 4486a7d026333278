"""Evaluation summaries: per-question outcomes → Pass@1 / Pass@k with bootstrap CIs, EM, F1, tool use.

Pass@k is the unbiased estimator over n samples per question (Chen et al. 2021), averaged over questions; its
confidence interval resamples questions.  A paired comparison of two runs resamples the same questions for
both, which is what decides whether one algorithm beats another on a benchmark.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from aepo_core.interfaces import RewardResult
from aepo_core.metrics import DEFAULT_CONFIDENCE, bootstrap_ci, paired_bootstrap_diff, pass_at_k, t_interval

CORRECT_REASONS = frozenset({"correct", "equivalent"})


def is_correct(result: RewardResult) -> bool:
    """Exact match when the reward reports it, else a 'correct'/'equivalent' verdict."""
    if "em" in result.details:
        return result.details["em"] >= 1.0
    return result.reason in CORRECT_REASONS


@dataclass(frozen=True)
class QuestionOutcome:
    question_id: str
    dataset: str
    family: str
    n: int
    correct: int
    em_mean: float
    f1_mean: float
    tool_calls_mean: float
    tool_error_rate: float
    answered_rate: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Interval:
    """A point estimate with its 95% interval."""

    value: float
    low: float
    high: float


@dataclass(frozen=True)
class EvalSummary:
    """One evaluation over questions: Pass@1 and Pass@k with their bootstrap CIs over questions, EM, F1 and tool use
    (each a mean over questions). :meth:`as_dict` is its one serialized form: the MLflow metric names
    (``eval/<dataset>/pass@1``, …), the JSON reports, the flows' results."""

    questions: int
    samples_per_question: int
    k: int
    pass1: Interval
    pass_k: Interval
    em: float
    f1: float
    tool_calls_per_question: float
    tool_error_rate: float
    answered_rate: float

    @classmethod
    def of(cls, outcomes: Sequence[QuestionOutcome], k: int, *, n_resamples: int = 1000, seed: int = 0
           ) -> EvalSummary:
        if not outcomes:
            raise ValueError("no outcomes to summarize")
        p1 = [pass_at_k(o.n, o.correct, 1) for o in outcomes]
        pk = [pass_at_k(o.n, o.correct, min(k, o.n)) for o in outcomes]
        n_q = len(outcomes)
        return cls(n_q, outcomes[0].n, k,
                   Interval(*bootstrap_ci(p1, n_resamples=n_resamples, seed=seed)),
                   Interval(*bootstrap_ci(pk, n_resamples=n_resamples, seed=seed)),
                   em=sum(o.em_mean for o in outcomes) / n_q, f1=sum(o.f1_mean for o in outcomes) / n_q,
                   tool_calls_per_question=sum(o.tool_calls_mean for o in outcomes) / n_q,
                   tool_error_rate=sum(o.tool_error_rate for o in outcomes) / n_q,
                   answered_rate=sum(o.answered_rate for o in outcomes) / n_q)

    def as_dict(self) -> dict[str, float]:
        """``questions``, ``samples_per_question``, ``pass@1`` / ``pass@1_ci_low`` / ``pass@1_ci_high``, the same for
        ``pass@<k>``, ``em``, ``f1``, ``tool_calls_per_question``, ``tool_error_rate``, ``answered_rate``."""
        out = {"questions": float(self.questions), "samples_per_question": float(self.samples_per_question)}
        for name, est in (("pass@1", self.pass1), (f"pass@{self.k}", self.pass_k)):
            out[name], out[f"{name}_ci_low"], out[f"{name}_ci_high"] = est.value, est.low, est.high
        return {**out, "em": self.em, "f1": self.f1, "tool_calls_per_question": self.tool_calls_per_question,
                "tool_error_rate": self.tool_error_rate, "answered_rate": self.answered_rate}


def summarize(
    outcomes: Sequence[QuestionOutcome], k: int, *, n_resamples: int = 1000, seed: int = 0
) -> dict[str, float]:
    """Pass@1, Pass@k (with 95% CIs), EM, F1 and tool statistics over questions (:class:`EvalSummary`, serialized)."""
    return EvalSummary.of(outcomes, k, n_resamples=n_resamples, seed=seed).as_dict()


def summaries_by(outcomes: Sequence[QuestionOutcome], key: str, k: int, **kw: int) -> dict[str, EvalSummary]:
    """The summary per dataset or per question family."""
    groups: dict[str, list[QuestionOutcome]] = defaultdict(list)
    for o in outcomes:
        groups[str(getattr(o, key))].append(o)
    return {name: EvalSummary.of(group, k, **kw) for name, group in sorted(groups.items())}


def summarize_by(outcomes: Sequence[QuestionOutcome], key: str, k: int, **kw: int) -> dict[str, dict[str, float]]:
    """The same summary per dataset or per question family (:func:`summaries_by`, serialized)."""
    return {name: summary.as_dict() for name, summary in summaries_by(outcomes, key, k, **kw).items()}


@dataclass(frozen=True)
class PairedDiff:
    """Two evaluations of the same questions compared: the mean per-question difference a − b with its paired
    bootstrap CI, over the questions both answered. :meth:`as_dict` is its serialized form (``diff``, ``ci_low``,
    ``ci_high``, ``questions``: the MLflow metric suffixes and JSON keys)."""

    diff: float
    ci_low: float
    ci_high: float
    questions: int

    @classmethod
    def of(cls, a: Mapping[str, float], b: Mapping[str, float], *, n_resamples: int = 1000, seed: int = 0
           ) -> PairedDiff:
        common = sorted(set(a) & set(b))
        if not common:
            raise ValueError("the two runs share no questions")
        point, low, high = paired_bootstrap_diff([a[q] for q in common], [b[q] for q in common],
                                                 n_resamples=n_resamples, seed=seed)
        return cls(point, low, high, len(common))

    def as_dict(self) -> dict[str, float]:
        return {"diff": self.diff, "ci_low": self.ci_low, "ci_high": self.ci_high, "questions": float(self.questions)}

    def line(self, digits: int = 3) -> str:
        """``pass@1 +0.125 [-0.010, +0.260] (paired over 40 questions)``: how every command and summary says it."""
        return (f"pass@1 {self.diff:+.{digits}f} [{self.ci_low:+.{digits}f}, {self.ci_high:+.{digits}f}] "
                f"(paired over {self.questions} questions)")


def paired_comparison(
    a: Mapping[str, float], b: Mapping[str, float], *, n_resamples: int = 1000, seed: int = 0
) -> dict[str, float]:
    """Mean per-question difference a − b on the questions both runs answered, with a bootstrap CI
    (:class:`PairedDiff`, serialized)."""
    return PairedDiff.of(a, b, n_resamples=n_resamples, seed=seed).as_dict()


def _run_differences(a: Mapping[str, float], b: Mapping[str, float], label: object) -> np.ndarray:
    """a_q − b_q on the questions both runs answered (sorted by id); ``label`` names the pair in the error."""
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError(f"pair {label}: the two runs share no questions")
    return np.array([a[q] - b[q] for q in common], dtype=float)


# A run's mean paired difference at or below this is no change: differences in thirds that cancel sum to ~1e-17.
NO_CHANGE = 1e-12


def pooled_paired_comparison(
    pairs: Sequence[tuple[Mapping[str, float], Mapping[str, float]]], *, n_resamples: int = 1000, seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
) -> dict[str, float]:
    """The mean over S runs of each run's paired difference, D = (1/S)·Σ_s mean_q (a_sq − b_sq), on the questions
    both sides of that run answered (e.g. final vs SFT evaluation of one training seed), with a stratified
    bootstrap CI: every resample redraws each run's questions with replacement within that run, so each run keeps
    its weight 1/S and its pairing.

    The runs are strata, not resampled: the interval is about these S runs' mean, not a new seed's (with S = 3 a
    bootstrap over seeds would have 10 distinct resamples).  ``positive`` counts the runs whose own mean
    difference is > 0 (beyond float rounding: ``NO_CHANGE``)."""
    if not pairs:
        raise ValueError("pooled_paired_comparison needs at least one pair of runs")
    diffs = [_run_differences(a, b, i) for i, (a, b) in enumerate(pairs)]
    rng = np.random.default_rng(seed)
    stats = np.zeros(n_resamples)
    for d in diffs:
        stats += d[rng.integers(0, d.size, size=(n_resamples, d.size))].mean(axis=1)
    stats /= len(diffs)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return {"diff": float(np.mean([d.mean() for d in diffs])), "ci_low": float(low), "ci_high": float(high),
            "runs": float(len(diffs)), "positive": float(sum(d.mean() > NO_CHANGE for d in diffs)),
            "questions": float(sum(d.size for d in diffs))}


@dataclass(frozen=True)
class OverSeeds:
    """A quantity measured once per training run (seed), e.g. its Pass@1 or its entropy slope: the mean over the
    seeds and its Student-t 95% interval (S − 1 degrees of freedom), which is about a new training run, so it holds
    the run-to-run variance that an interval over one run's questions leaves out. No bounds (None) with one seed."""

    mean: float
    low: float | None
    high: float | None
    seeds: int
    per_seed: dict[int, float]

    @classmethod
    def of(cls, per_seed: Mapping[int, float]) -> OverSeeds:
        if not per_seed:
            raise ValueError("OverSeeds needs at least one seed's value")
        ordered = dict(sorted((int(s), float(v)) for s, v in per_seed.items()))
        mean, low, high = t_interval(list(ordered.values()))
        if len(ordered) == 1:
            return cls(mean, None, None, 1, ordered)
        return cls(mean, low, high, len(ordered), ordered)

    @property
    def sign(self) -> str:
        """"> 0" or "< 0" where the interval excludes 0, "0 in CI" where it holds it, "one seed" without one."""
        if self.low is None or self.high is None:
            return "one seed"
        return "> 0" if self.low > 0 else "< 0" if self.high < 0 else "0 in CI"


def paired_over_seeds(pairs: Mapping[int, tuple[Mapping[str, float], Mapping[str, float]]]) -> OverSeeds:
    """Seed → (a's per-question values, b's) of that seed's two runs: each seed's mean difference a − b on the
    questions both answered (as in :func:`pooled_paired_comparison`), with its Student-t interval over the seeds."""
    return OverSeeds.of({s: float(_run_differences(a, b, s).mean()) for s, (a, b) in pairs.items()})
