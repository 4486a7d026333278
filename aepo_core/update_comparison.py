"""Update rules side by side on the same samples (issue 29 §2): per token class, what each rule's update did.

Every rule starts from the same weights and optimizer state and updates on the same stored samples in the same
order; only the loss differs.  Per response token of every sample we then know, for each rule:

- w_t = ∂L/∂logπ_θ(y_t) at each optimizer step that saw the token (:func:`aepo_core.losses.token_gradient_weights`):
  ∇_θ L = Σ_t w_t·∇_θ logπ_θ(y_t), so w_t = 0 means the rule dropped the token's gradient;
- after the update: the sampled token's log-prob change, the full-vocabulary KL(π_start ‖ π_after) at its
  position, and the policy entropy there.

Tokens fall in three disjoint classes: ``tool_call`` (inside a ``<search>``/``<python>`` call, tags included),
``high_entropy`` (outside a call, start entropy at or above the top-``q`` quantile of the step's model tokens,
q = ``algorithm.high_entropy_quantile``), ``rest``.  Tool results are not model tokens and belong to none.

Each quantity is a ratio of sums over tokens (Σ numerator / Σ denominator), with a bootstrap that redraws
questions (clusters) within each stratum (a replayed step) and keeps every sample (leaf) of a drawn question: the
leaves of one question share prefixes and one advantage normalisation, so redrawing leaves as if independent gave
nominal 95 % intervals that held the truth ~40–55 % of the time in simulation (issue 49 §5;
``tests/core/test_update_comparison.py``).  The rules are paired (every resample draws the same questions for
every rule), so a difference between two rules has its own interval.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import ValidationError

from aepo_core.config import LOSS_DEFAULTED_FIELDS, AlgorithmConfig
from aepo_core.config_keys import ConfigError
from aepo_core.overrides import apply_overrides

TOKEN_CLASSES: tuple[str, ...] = ("tool_call", "high_entropy", "rest")
"""Disjoint classes of model tokens, in this order (index = the class id of :func:`token_classes`)."""

QUANTITIES: dict[str, str] = {
    "zeroed_share": "share of the class's token updates with Â ≠ 0 whose gradient the rule zeroed (w_t = 0)",
    "gradient_weight_share": "the class's share of Σ_t |w_t| over all model tokens (the weight of ∇logπ_t)",
    "logprob_change": "mean logπ_after − logπ_start of the sampled tokens (nats)",
    "kl_to_start": "mean KL(π_start ‖ π_after) over the vocabulary at the class's positions (nats)",
    "entropy_after": "mean policy entropy at the class's positions after the update (nats)",
    "entropy_change": "mean entropy after − entropy before the update (nats)",
}
"""What :func:`compare_rules` estimates per rule and token class; every one a ratio of sums over tokens."""


def rule_algorithm(base: AlgorithmConfig, rule: str) -> AlgorithmConfig:
    """The algorithm section of update rule ``rule`` = ``<loss>[@key=value,…]``: ``base`` with that loss at its
    paper's defaults (the fields of :data:`LOSS_DEFAULTED_FIELDS` re-derived for it), then the settings after ``@``
    (algorithm keys, e.g. ``aepo@clip_gate=high_entropy`` or ``ppo_clip@entropy_advantage=false``).  The run's own
    loss without settings is ``base`` itself: the run's update, with its own ``dual_clip`` and ``loss_agg``."""
    loss, _, settings = rule.partition("@")
    if loss.strip() == base.loss and not settings.strip():
        return base.model_copy()
    tree = {k: v for k, v in base.model_dump(mode="json").items() if k not in LOSS_DEFAULTED_FIELDS}
    tree["loss"] = loss.strip()
    apply_overrides(tree, [item for item in settings.split(",") if item.strip()], f"update rule {rule!r}")
    try:
        return AlgorithmConfig.model_validate(tree)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'loss'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"update rule {rule!r}: {problems}") from None


def token_classes(mask: np.ndarray, entropy: np.ndarray, tool_call: np.ndarray, threshold: float) -> np.ndarray:
    """Per response token its class id in :data:`TOKEN_CLASSES`, −1 where ``mask`` is 0 (tool results)."""
    classes = np.where(tool_call, 0, np.where(entropy >= threshold, 1, 2)).astype(np.int8)
    return np.where(np.asarray(mask) > 0, classes, -1).astype(np.int8)


def entropy_threshold(entropies: Sequence[np.ndarray], masks: Sequence[np.ndarray], quantile: float) -> float:
    """The entropy at or above which a model token is in the top ``quantile`` of all of them: the order statistic
    of 0-based rank ⌈(1 − q)·(n − 1)⌉, as :func:`aepo_core.losses.high_entropy_threshold` takes it per mini-batch."""
    values = np.concatenate([np.asarray(e, dtype=np.float64)[np.asarray(m) > 0]
                             for e, m in zip(entropies, masks, strict=True)])
    if values.size == 0:
        return float("inf")
    rank = int(np.ceil(np.float32(1.0 - quantile) * (values.size - 1)))
    return float(np.partition(values, rank)[rank])


@dataclass(frozen=True)
class SampleTokens:
    """One sample after one rule's update, per response token (arrays of the response's length)."""

    token_class: np.ndarray
    """Class id (:func:`token_classes`); −1 off the loss mask."""
    active: np.ndarray
    """Optimizer steps that saw the token with a nonzero advantage (the loss's Â, entropy-scaled)."""
    zeroed: np.ndarray
    """Of those, the steps whose w_t was exactly 0."""
    abs_weight: np.ndarray
    """Σ |w_t| over the optimizer steps that saw the token."""
    logprob_change: np.ndarray
    kl: np.ndarray
    entropy_before: np.ndarray
    entropy_after: np.ndarray


def _by_class(token_class: np.ndarray, values: np.ndarray) -> np.ndarray:
    keep = token_class >= 0
    return np.bincount(token_class[keep], weights=np.asarray(values, dtype=np.float64)[keep],
                       minlength=len(TOKEN_CLASSES))


def sample_sums(t: SampleTokens) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per quantity of :data:`QUANTITIES`, this sample's (numerator, denominator) per class."""
    c = t.token_class
    tokens = _by_class(c, np.ones(c.shape))
    weight = _by_class(c, t.abs_weight)
    return {
        "zeroed_share": (_by_class(c, t.zeroed), _by_class(c, t.active)),
        "gradient_weight_share": (weight, np.full(len(TOKEN_CLASSES), weight.sum())),
        "logprob_change": (_by_class(c, t.logprob_change), tokens),
        "kl_to_start": (_by_class(c, t.kl), tokens),
        "entropy_after": (_by_class(c, t.entropy_after), tokens),
        "entropy_change": (_by_class(c, t.entropy_after - t.entropy_before), tokens),
    }


@dataclass(frozen=True)
class ComparisonRow:
    """One rule's estimate of one quantity on one token class, and its paired difference from the reference rule."""

    quantity: str
    token_class: str
    rule: str
    value: float
    ci_low: float
    ci_high: float
    diff: float | None
    """value − the reference rule's value (None for the reference itself, or where either is undefined)."""
    diff_low: float | None
    diff_high: float | None
    tokens: int
    """Tokens of the class with a nonzero denominator, over all samples."""


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def cluster_totals(values: np.ndarray, strata: Sequence[Hashable], clusters: Sequence[Hashable]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(totals [R, C], stratum index [C]) of ``values`` ([R, S]: R rows over S samples) summed over each of the C
    clusters, a cluster being a (stratum, cluster label) pair, in order of first appearance."""
    keys = list(zip(strata, clusters, strict=True))
    index = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    ids = np.array([index[key] for key in keys], dtype=np.int64)
    totals = np.stack([np.bincount(ids, weights=row, minlength=len(index)) for row in values])
    stratum_of = {stratum: i for i, stratum in enumerate(dict.fromkeys(strata))}
    return totals, np.array([stratum_of[stratum] for stratum, _ in index], dtype=np.int64)


def cluster_ratio_bootstrap(num: np.ndarray, den: np.ndarray, strata: Sequence[Hashable],
                            clusters: Sequence[Hashable], n_resamples: int, seed: int
                            ) -> tuple[np.ndarray, np.ndarray]:
    """(point [R], resampled [n_resamples, R]) of Σ num / Σ den for each of R rows (rules) over S samples
    (``num``, ``den``: [R, S]; ``strata``, ``clusters``: one label per sample, a cluster lies within its stratum).

    Each resample redraws clusters, never single samples: in a stratum h of n_h clusters with totals t_c it draws
    n_h − 1 of them with replacement and weighs each n_h / (n_h − 1), so the stratum's total T*_h = n_h/(n_h − 1)·
    Σ_drawn t_c has mean T_h and variance n_h·s_h² (s_h² the clusters' sample variance), the unbiased variance of a
    total (the rescaling bootstrap of Rao & Wu 1988 with m_h = n_h − 1); a stratum of one cluster enters whole.
    The same draw applies to every row (paired).  NaN where a denominator is 0."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    totals_num, stratum_of = cluster_totals(num, strata, clusters)
    totals_den, _ = cluster_totals(den, strata, clusters)
    rng = np.random.default_rng(seed)
    boot_num = np.zeros((n_resamples, num.shape[0]))
    boot_den = np.zeros((n_resamples, num.shape[0]))
    for stratum in np.unique(stratum_of):
        members = np.flatnonzero(stratum_of == stratum)
        if members.size == 1:
            boot_num += totals_num[:, members[0]]
            boot_den += totals_den[:, members[0]]
            continue
        draw = members[rng.integers(0, members.size, size=(n_resamples, members.size - 1))]
        scale = members.size / (members.size - 1)
        boot_num += scale * totals_num[:, draw].sum(axis=2).T
        boot_den += scale * totals_den[:, draw].sum(axis=2).T
    return _ratio(num.sum(axis=1), den.sum(axis=1)), _ratio(boot_num, boot_den)


def compare_rules(per_rule: Mapping[str, Sequence[SampleTokens]], strata: Sequence[Hashable],
                  clusters: Sequence[Hashable], reference: str, n_resamples: int = 2000, confidence: float = 0.95,
                  seed: int = 0) -> list[ComparisonRow]:
    """Every quantity of :data:`QUANTITIES` × class × rule, with percentile-bootstrap CIs over the clusters
    (questions) of every stratum (step) and each rule's paired difference from ``reference``
    (:func:`cluster_ratio_bootstrap`; ``strata`` and ``clusters``: one label per sample).

    ``per_rule[rule][i]`` is sample ``i`` after that rule's update: every rule must hold the same samples."""
    rules = list(per_rule)
    if reference not in per_rule:
        raise ValueError(f"reference rule {reference!r} is not among the rules {rules}")
    sizes = {len(v) for v in per_rule.values()}
    if sizes != {len(strata)}:
        raise ValueError(f"every rule needs one entry per sample ({len(strata)}), got {sorted(sizes)}")
    if len(clusters) != len(strata):
        raise ValueError(f"one cluster label per sample ({len(strata)}), got {len(clusters)}")
    sums = {rule: [sample_sums(t) for t in samples] for rule, samples in per_rule.items()}
    tail = (1.0 - confidence) / 2.0
    ref = rules.index(reference)
    rows: list[ComparisonRow] = []
    for quantity in QUANTITIES:
        for ci, cls in enumerate(TOKEN_CLASSES):
            num = np.array([[s[quantity][0][ci] for s in sums[r]] for r in rules])
            den = np.array([[s[quantity][1][ci] for s in sums[r]] for r in rules])
            point, boot = cluster_ratio_bootstrap(num, den, strata, clusters, n_resamples, seed)
            diffs = boot - boot[:, [ref]]
            tokens = int(sum(np.count_nonzero(t.token_class == ci) for t in per_rule[rules[0]]))
            for ri, rule in enumerate(rules):
                low, high = _quantiles(boot[:, ri], tail)
                paired = ri != ref and np.isfinite(point[ri]) and np.isfinite(point[ref])
                d_low, d_high = _quantiles(diffs[:, ri], tail) if paired else (None, None)
                rows.append(ComparisonRow(quantity, cls, rule, float(point[ri]), low, high,
                                          float(point[ri] - point[ref]) if paired else None, d_low, d_high,
                                          tokens))
    return rows


def _quantiles(values: np.ndarray, tail: float) -> tuple[float, float]:
    """The percentile interval of the finite resamples (NaN when none is: the class is empty)."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return float("nan"), float("nan")
    low, high = np.quantile(finite, [tail, 1.0 - tail])
    return float(low), float(high)
