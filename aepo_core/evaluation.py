"""Evaluation summaries: per-question outcomes → Pass@1 / Pass@k with bootstrap CIs, EM, F1, tool use.

Pass@k is the unbiased estimator over n samples per question (Chen et al. 2021), averaged over questions; its
confidence interval resamples questions.  A paired comparison of two runs resamples the same questions for
both, which is what decides whether one algorithm beats another on a benchmark.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from aepo_core.interfaces import RewardResult
from aepo_core.metrics import bootstrap_ci, paired_bootstrap_diff, pass_at_k

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


def summarize(
    outcomes: Sequence[QuestionOutcome], k: int, *, n_resamples: int = 1000, seed: int = 0
) -> dict[str, float]:
    """Pass@1, Pass@k (with 95% CIs), EM, F1 and tool statistics over questions."""
    if not outcomes:
        raise ValueError("no outcomes to summarize")
    p1 = [pass_at_k(o.n, o.correct, 1) for o in outcomes]
    pk = [pass_at_k(o.n, o.correct, min(k, o.n)) for o in outcomes]
    out: dict[str, float] = {"questions": float(len(outcomes)), "samples_per_question": float(outcomes[0].n)}
    for name, values in (("pass@1", p1), (f"pass@{k}", pk)):
        point, low, high = bootstrap_ci(values, n_resamples=n_resamples, seed=seed)
        out[name], out[f"{name}_ci_low"], out[f"{name}_ci_high"] = point, low, high
    n_q = len(outcomes)
    out["em"] = sum(o.em_mean for o in outcomes) / n_q
    out["f1"] = sum(o.f1_mean for o in outcomes) / n_q
    out["tool_calls_per_question"] = sum(o.tool_calls_mean for o in outcomes) / n_q
    out["tool_error_rate"] = sum(o.tool_error_rate for o in outcomes) / n_q
    out["answered_rate"] = sum(o.answered_rate for o in outcomes) / n_q
    return out


def summarize_by(outcomes: Sequence[QuestionOutcome], key: str, k: int, **kw: int) -> dict[str, dict[str, float]]:
    """The same summary per dataset or per question family."""
    groups: dict[str, list[QuestionOutcome]] = defaultdict(list)
    for o in outcomes:
        groups[str(getattr(o, key))].append(o)
    return {name: summarize(group, k, **kw) for name, group in sorted(groups.items())}


def paired_comparison(
    a: Mapping[str, float], b: Mapping[str, float], *, n_resamples: int = 1000, seed: int = 0
) -> dict[str, float]:
    """Mean per-question difference a − b on the questions both runs answered, with a bootstrap CI."""
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the two runs share no questions")
    point, low, high = paired_bootstrap_diff([a[q] for q in common], [b[q] for q in common],
                                             n_resamples=n_resamples, seed=seed)
    return {"diff": point, "ci_low": low, "ci_high": high, "questions": float(len(common))}
