"""A rollout at a fixed policy, measured per question group (issue 16): the paper's rollout-level claims.

One :class:`GroupProfile` per question (its rollout tree and the leaves' scores), then per sampling mode a
:class:`ModeSummary` (means with bootstrap CIs over questions) and, between two modes run on the same questions
with the same seeds, paired differences. The quantities:

- **branch concentration** (ARPO puts most branches on a few paths; AEPO's consecutive-branch penalty should
  spread them): a *branch point* is a tool-result node a fork started from (the node before a ``branched``
  decision). The share of a question's branch points on its top-1 path is ``max_leaf |B ∩ path| / |B|``; on its
  top-3 paths, ``|∪ B ∩ path over the 3 leaves with most branch points| / |B|``; undefined (NaN) without branch
  points. Also the most branch points on one path, and every branch's consecutive-branch count ``l`` (the
  branches created just before it on its path, what AEPO's penalty ``max(0, 1 − λ·l)`` acts on);
- **exploration**: distinct tool-call sequences per group (tool and normalized argument, in order), distinct
  final answers per group (normalized; leaves without an answer not counted), Pass@k of the group (any leaf
  correct, k = the group's leaves);
- **informative groups**: the group's rewards are not all equal, so GRPO-style group advantages are not all 0;
- **budget split** (AEPO's pre-monitoring): the number of global samples m against H_root − H̄_tool;
- **cost**: model tokens the tree sampled (shared prefixes counted once);
- **the paper's own quantities**: (a) of the high-entropy tool steps that have a tool step before them on their
  path, the share whose previous tool step was high-entropy too (the paper reports 56.5% for ARPO), beside its
  chance level, the share of all such steps whose previous tool step was high-entropy. A tool step is
  high-entropy when its ΔH (segment entropy − its path's first segment's) is above the median ΔH of its tree's
  tool steps: the top half, so the chance level is near 0.5 on every policy (with ΔH > 0 as the test, nearly
  every step of the demo's SFT policy was high and the share was 0.99 in every arm); (b) the share of a group's
  branch samples descending from its top-1, top-2 and top-3 global roots (the first segment a branch's path
  starts with; the paper: 93.4% on 1–3 trajectories); (c) the decisions the penalty turned off (``penalized``:
  the score before the penalty reached τ) and P(branch | l, budget open), pooled over questions: the direct
  effect of λ.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from aepo_core.metrics import bootstrap_ci, paired_bootstrap_diff
from aepo_core.rewards import normalize_answer, predicted_answer
from aepo_core.rollout.tree import RolloutTree, is_tool_step
from aepo_core.scoring import model_text

TOP_PATHS = 3


@dataclass(frozen=True)
class GroupProfile:
    """The measures of one question's rollout group (one tree)."""

    question_id: str
    leaves: int
    branch_points: int  # tool-result nodes forks started from
    top1_share: float  # share of the branch points on the path holding most of them; NaN without branch points
    top3_share: float  # share on the union of the TOP_PATHS paths holding most; NaN without branch points
    max_branches_on_path: int
    consecutive: tuple[int, ...]  # l of every branch created (consecutive branches just before it on its path)
    distinct_tool_sequences: int  # distinct (tool, normalized argument) sequences among the leaves
    distinct_answers: int  # distinct normalized final answers among the leaves that gave one
    correct: int  # leaves whose answer is correct
    mixed_rewards: bool  # the leaves' rewards are not all equal: the group carries a group-advantage signal
    global_budget: int  # m
    entropy_gap: float  # H_root − H̄_tool (NaN when the tree has no measured root entropy)
    model_tokens: int  # tokens the model sampled for this tree, shared prefixes once
    high_entropy_steps: int = 0  # high-entropy tool steps (ΔH above the tree's median) with a tool step before them
    high_entropy_after_high: int = 0  # of those, the ones whose previous tool step was high-entropy too
    steps_after_tool: int = 0  # tool steps with a tool step before them on their path, high-entropy or not
    steps_after_high: int = 0  # of those, the ones whose previous tool step was high-entropy (the chance level)
    branch_samples_by_root: tuple[int, ...] = ()  # branch leaves per global root that has any, most first
    penalized: int = 0  # decisions the consecutive-branch penalty turned off
    open_decisions_by_l: tuple[int, ...] = ()  # index l: branch decisions taken with the budget open
    branches_by_l: tuple[int, ...] = ()  # index l: of those, the ones that branched

    @property
    def pass_at_k(self) -> float:
        """1 when any leaf of the group is correct (Pass@k with k = the group's leaves)."""
        return 1.0 if self.correct > 0 else 0.0


def _norm_argument(text: str) -> str:
    return " ".join(text.lower().split())


def branch_points_by_leaf(tree: RolloutTree) -> list[frozenset[int]]:
    """For each leaf (in order), the branch points on its path: the parents of its path's ``branched`` decisions
    and the fork points its own path started from (a fork begins right after its branch point)."""
    points = {n.parent_id for n in tree.nodes if n.branched and n.parent_id is not None}
    return [frozenset(i for i in leaf.node_ids if i in points) for leaf in tree.leaves]


def concentration(per_leaf: Sequence[frozenset[int]], top: int = TOP_PATHS) -> tuple[int, float, float, int]:
    """(branch points, top-1 share, top-``top`` share, most on one path) of a group's per-leaf branch points.

    The top paths are the leaves with the most branch points (ties: the earlier leaf); a share counts each
    branch point once however many of the chosen paths pass through it.
    """
    every = frozenset().union(*per_leaf) if per_leaf else frozenset()
    if not every:
        return 0, math.nan, math.nan, 0
    ranked = sorted(per_leaf, key=len, reverse=True)
    best = len(ranked[0])
    covered = frozenset().union(*ranked[:top])
    return len(every), best / len(every), len(covered) / len(every), best


OPEN_DECISIONS = ("branch", "below_tau", "penalized")  # branch reasons of decisions taken with the budget open


@dataclass(frozen=True)
class ConsecutiveHighEntropy:
    """Quantity (a)'s counts for one tree, over its tool steps that have a tool step before them on their path."""

    steps: int  # such tool steps
    after_high: int  # of those, the ones whose previous tool step was high-entropy
    high: int  # of those, the high-entropy ones
    high_after_high: int  # of the high-entropy ones, those whose previous tool step was high-entropy too


def consecutive_high_entropy(tree: RolloutTree) -> ConsecutiveHighEntropy:
    """Quantity (a)'s counts, every node counted once (a node's path from the prompt is unique).

    A tool step is high-entropy when ΔH (its segment entropy − its path's first segment's) is above the median
    ΔH of the tree's tool steps."""
    delta: dict[int, float] = {}
    previous: dict[int, int] = {}  # tool step → the tool step before it on its path
    for node in tree.nodes:
        if not is_tool_step(tree.nodes, node):
            continue
        path = tree.ancestors(node)
        first = next(n for n in path if n.kind == "model")
        delta[node.node_id] = node.segment_entropy - first.segment_entropy
        earlier = [n for n in path[:-1] if is_tool_step(tree.nodes, n)]
        if earlier:
            previous[node.node_id] = earlier[-1].node_id
    if not delta:
        return ConsecutiveHighEntropy(0, 0, 0, 0)
    threshold = float(np.median(list(delta.values())))
    high = {i for i, d in delta.items() if d > threshold}
    high_now = [i for i in previous if i in high]
    return ConsecutiveHighEntropy(
        steps=len(previous),
        after_high=sum(previous[i] in high for i in previous),
        high=len(high_now),
        high_after_high=sum(previous[i] in high for i in high_now),
    )


def branch_samples_by_root(tree: RolloutTree) -> tuple[int, ...]:
    """Branch leaves per global root (the first model segment of their path), most first; roots without any left
    out."""
    roots = Counter(leaf.node_ids[1] for leaf in tree.leaves if leaf.sample_kind == "branch" and len(leaf.node_ids) > 1)
    return tuple(sorted(roots.values(), reverse=True))


def decisions_by_l(tree: RolloutTree) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(decisions taken with the budget open, those that branched), each indexed by l."""
    open_l = Counter(n.consecutive_branches for n in tree.nodes if n.branch_reason in OPEN_DECISIONS)
    branched = Counter(n.consecutive_branches for n in tree.nodes if n.branch_reason == "branch")
    top = max(open_l, default=-1) + 1
    return tuple(open_l[i] for i in range(top)), tuple(branched[i] for i in range(top))


def profile_group(tree: RolloutTree, rewards: Sequence[float], correct: Sequence[bool]) -> GroupProfile:
    """The measures of one tree, given its leaves' rewards and correctness (aligned with ``tree.leaves``)."""
    if not len(rewards) == len(correct) == len(tree.leaves):
        raise ValueError(f"question {tree.question_id}: {len(tree.leaves)} leaves but {len(rewards)} rewards and "
                         f"{len(correct)} correctness flags")
    n_points, top1, top3, most = concentration(branch_points_by_leaf(tree))
    sequences = {tuple((e.name, _norm_argument(e.argument)) for e in tree.tool_events(leaf) if not e.is_notice)
                 for leaf in tree.leaves}
    answers = set()
    for leaf in tree.leaves:
        answer = predicted_answer(model_text(tree, leaf))
        if answer is not None and normalize_answer(answer):
            answers.add(normalize_answer(answer))
    finite = [r for r in rewards if not math.isnan(r)]
    runs = consecutive_high_entropy(tree)
    open_l, branched_l = decisions_by_l(tree)
    return GroupProfile(
        question_id=tree.question_id,
        leaves=len(tree.leaves),
        branch_points=n_points,
        top1_share=top1,
        top3_share=top3,
        max_branches_on_path=most,
        consecutive=tuple(n.consecutive_branches for n in tree.nodes if n.branched),
        distinct_tool_sequences=len(sequences),
        distinct_answers=len(answers),
        correct=sum(bool(c) for c in correct),
        mixed_rewards=len(set(finite)) > 1,
        global_budget=tree.global_budget,
        entropy_gap=tree.h_root - tree.h_tool,
        model_tokens=sum(len(n.token_ids) for n in tree.nodes if n.kind == "model"),
        high_entropy_steps=runs.high,
        high_entropy_after_high=runs.high_after_high,
        steps_after_tool=runs.steps,
        steps_after_high=runs.after_high,
        branch_samples_by_root=branch_samples_by_root(tree),
        penalized=sum(1 for n in tree.nodes if n.branch_reason == "penalized"),
        open_decisions_by_l=open_l,
        branches_by_l=branched_l,
    )


# ------------------------------------------------------------------------------------------------ summaries
@dataclass(frozen=True)
class Estimate:
    """A mean over questions with its percentile-bootstrap 95% interval; ``n`` questions entered it (questions
    where the quantity is undefined, e.g. a share without branch points, are left out)."""

    mean: float
    low: float
    high: float
    n: int

    def excludes_zero(self) -> bool:
        return self.n > 0 and (self.low > 0 or self.high < 0)


NAN_ESTIMATE = Estimate(math.nan, math.nan, math.nan, 0)

# The per-question quantities summarized, by name (the keys of ModeSummary.estimates and of the paired diffs).
QUANTITIES: dict[str, Callable[[GroupProfile], float]] = {
    "branch_points": lambda p: float(p.branch_points),
    "top1_share": lambda p: p.top1_share,
    "top3_share": lambda p: p.top3_share,
    "max_branches_on_path": lambda p: float(p.max_branches_on_path),
    "consecutive_branch_share": lambda p: (sum(1 for c in p.consecutive if c > 0) / len(p.consecutive)
                                           if p.consecutive else math.nan),
    "distinct_tool_sequences": lambda p: float(p.distinct_tool_sequences),
    "distinct_answers": lambda p: float(p.distinct_answers),
    "pass_at_k": lambda p: p.pass_at_k,
    "accuracy": lambda p: p.correct / p.leaves if p.leaves else math.nan,
    "informative": lambda p: float(p.mixed_rewards),
    "global_budget": lambda p: float(p.global_budget),
    "model_tokens": lambda p: float(p.model_tokens),
    "consecutive_high_entropy_share": lambda p: (p.high_entropy_after_high / p.high_entropy_steps
                                                 if p.high_entropy_steps else math.nan),
    "consecutive_high_entropy_chance": lambda p: (p.steps_after_high / p.steps_after_tool
                                                  if p.steps_after_tool else math.nan),
    "branch_samples_top1_root": lambda p: _top_roots_share(p, 1),
    "branch_samples_top2_root": lambda p: _top_roots_share(p, 2),
    "branch_samples_top3_root": lambda p: _top_roots_share(p, 3),
    "penalized": lambda p: float(p.penalized),
}


def _top_roots_share(p: GroupProfile, top: int) -> float:
    """Share of the group's branch samples descending from its ``top`` global roots with most; NaN without any."""
    total = sum(p.branch_samples_by_root)
    return sum(p.branch_samples_by_root[:top]) / total if total else math.nan


def estimate(values: Sequence[float], n_resamples: int, seed: int) -> Estimate:
    """Mean and bootstrap CI over the finite values (NaN: undefined for that question)."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return NAN_ESTIMATE
    mean, low, high = bootstrap_ci(finite, n_resamples=n_resamples, seed=seed)
    return Estimate(mean, low, high, len(finite))


@dataclass(frozen=True)
class ModeSummary:
    """One sampling mode at one k over the study's questions."""

    estimates: dict[str, Estimate]  # by QUANTITIES name
    consecutive_histogram: dict[int, int]  # l → branches created with l consecutive branches before them
    budget_correlation: Estimate  # Pearson r of m and H_root − H̄_tool over questions (bootstrap CI)
    branch_rate_by_l: dict[int, Estimate]  # l → P(branch | l, budget open), pooled over questions (ratio_estimate)


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation; NaN when either side is constant."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xa.size < 2 or np.std(xa) == 0 or np.std(ya) == 0:
        return math.nan
    return float(np.corrcoef(xa, ya)[0, 1])


def correlation_estimate(x: Sequence[float], y: Sequence[float], n_resamples: int, seed: int) -> Estimate:
    """Pearson r of paired finite values with a bootstrap CI over the pairs (resamples where r is undefined,
    one side constant, are dropped)."""
    pairs = [(a, b) for a, b in zip(x, y, strict=True) if not (math.isnan(a) or math.isnan(b))]
    r = pearson([a for a, _ in pairs], [b for _, b in pairs])
    if math.isnan(r):
        return Estimate(math.nan, math.nan, math.nan, len(pairs))
    arr = np.asarray(pairs, dtype=float)
    rng = np.random.default_rng(seed)
    stats = [pearson(s[:, 0], s[:, 1]) for s in (arr[rng.integers(0, len(arr), len(arr))] for _ in range(n_resamples))]
    finite = [s for s in stats if not math.isnan(s)]
    low, high = np.quantile(finite, [0.025, 0.975]) if finite else (math.nan, math.nan)
    return Estimate(r, float(low), float(high), len(pairs))


def summarize_mode(profiles: Sequence[GroupProfile], n_resamples: int = 1000, seed: int = 0) -> ModeSummary:
    """Every quantity's mean over questions with its bootstrap CI, the histogram of consecutive-branch counts,
    and the correlation of m with the entropy gap."""
    estimates = {name: estimate([f(p) for p in profiles], n_resamples, seed) for name, f in QUANTITIES.items()}
    histogram = Counter(c for p in profiles for c in p.consecutive)
    corr = correlation_estimate([p.entropy_gap for p in profiles], [float(p.global_budget) for p in profiles],
                                n_resamples, seed)
    top = max((len(p.open_decisions_by_l) for p in profiles), default=0)
    rates = {l_count: ratio_estimate([_at(p.branches_by_l, l_count) for p in profiles],
                                     [_at(p.open_decisions_by_l, l_count) for p in profiles], n_resamples, seed)
             for l_count in range(top)}
    return ModeSummary(estimates, dict(sorted(histogram.items())), corr, rates)


def _at(values: Sequence[int], i: int) -> int:
    return values[i] if i < len(values) else 0


def ratio_estimate(numerators: Sequence[float], denominators: Sequence[float], n_resamples: int,
                   seed: int) -> Estimate:
    """Σ numerators / Σ denominators over the questions with a denominator, with a percentile-bootstrap CI that
    resamples those questions (``n``: how many)."""
    pairs = np.asarray([(a, b) for a, b in zip(numerators, denominators, strict=True) if b > 0], dtype=float)
    if not len(pairs):
        return NAN_ESTIMATE
    rng = np.random.default_rng(seed)
    draws = pairs[rng.integers(0, len(pairs), (n_resamples, len(pairs)))]
    ratios = draws[..., 0].sum(1) / draws[..., 1].sum(1)
    low, high = np.quantile(ratios, [0.025, 0.975])
    return Estimate(float(pairs[:, 0].sum() / pairs[:, 1].sum()), float(low), float(high), len(pairs))


def paired_difference(a: Sequence[GroupProfile], b: Sequence[GroupProfile], quantity: str,
                      n_resamples: int = 1000, seed: int = 0) -> Estimate:
    """Mean over questions of ``quantity``(a) − ``quantity``(b), same questions paired by id, with a paired
    bootstrap CI; questions where either side is undefined are left out."""
    f = QUANTITIES[quantity]
    by_id = {p.question_id: p for p in b}
    pairs = [(f(p), f(by_id[p.question_id])) for p in a if p.question_id in by_id]
    pairs = [(x, y) for x, y in pairs if not (math.isnan(x) or math.isnan(y))]
    if not pairs:
        return NAN_ESTIMATE
    mean, low, high = paired_bootstrap_diff([x for x, _ in pairs], [y for _, y in pairs],
                                            n_resamples=n_resamples, seed=seed)
    return Estimate(mean, low, high, len(pairs))
