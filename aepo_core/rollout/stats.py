"""Rollout metrics of a batch of trees: budget split, branching concentration, tool use, entropy."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from aepo_core.metrics import distinct_sequences
from aepo_core.rollout.study import (
    ConsecutiveHighEntropy,
    branch_points_by_leaf,
    concentration,
    consecutive_high_entropy,
)
from aepo_core.rollout.tree import RolloutTree


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _std(values: Sequence[float]) -> float:
    """Population standard deviation; NaN for none."""
    if not values:
        return math.nan
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _summed(parts: Sequence[ConsecutiveHighEntropy]) -> ConsecutiveHighEntropy:
    return ConsecutiveHighEntropy(sum(p.steps for p in parts), sum(p.after_high for p in parts),
                                  sum(p.high for p in parts), sum(p.high_after_high for p in parts))


def rollout_stats(
    trees: Sequence[RolloutTree], decisions: Sequence[tuple[int, bool]] = ()
) -> tuple[dict[str, float], dict[int, float]]:
    """Batch metrics, plus the branch rate by consecutive-branch count l (from the branch decisions made)."""
    leaves = [(t, leaf) for t in trees for leaf in t.leaves]
    n_q = max(1, len(trees))
    events = [e for t, leaf in leaves for e in t.tool_events(leaf)]
    real_calls = [e for e in events if not e.is_notice]
    branches_per_q = [sum(1 for n in t.nodes if n.branched) for t in trees]
    delta_h = [n.delta_entropy for t in trees for n in t.nodes if not math.isnan(n.delta_entropy)]
    shares = [concentration(branch_points_by_leaf(t)) for t in trees]
    runs = _summed([consecutive_high_entropy(t) for t in trees])
    statuses: dict[str, int] = defaultdict(int)
    for _, leaf in leaves:
        statuses[leaf.status] += 1
    stats: dict[str, float] = {
        "questions": float(len(trees)),
        "leaves": float(len(leaves)),
        "global_samples": float(sum(1 for _, leaf in leaves if leaf.sample_kind == "global")),
        "branch_samples": float(sum(1 for _, leaf in leaves if leaf.sample_kind == "branch")),
        "fill_samples": float(sum(1 for _, leaf in leaves if leaf.sample_kind == "fill")),
        "global_budget_mean": _mean([float(t.global_budget) for t in trees]),
        "branches_per_question": sum(branches_per_q) / n_q,
        "max_branches_per_path": float(max((leaf.branch_steps for _, leaf in leaves), default=0)),
        # Branch concentration (aepo_core.rollout.study): share of a question's branch points on its top-1 / top-3
        # paths, mean over the questions that branched (NaN when none did).
        "branch_top1_share": _mean([s[1] for s in shares]),
        "branch_top3_share": _mean([s[2] for s in shares]),
        "distinct_tool_sequences": _mean(
            [
                float(distinct_sequences([tuple(e.name for e in t.tool_events(leaf)) for leaf in t.leaves]))
                for t in trees
            ]
        ),
        "tool_calls_mean": len(real_calls) / max(1, len(leaves)),
        "tool_error_rate": (sum(1 for e in real_calls if not e.ok) / len(real_calls)) if real_calls else 0.0,
        "tool_cache_hit_rate": (sum(1 for e in real_calls if e.cache_hit) / len(real_calls)) if real_calls else 0.0,
        "h_root_mean": _mean([t.h_root for t in trees]),
        "h_tool_mean": _mean([t.h_tool for t in trees]),
        "delta_h_mean": _mean(delta_h),
        # What AEPO's rollout mechanisms acted on (issue 53 §2): the branch decisions the consecutive-branch penalty
        # turned off, the spread of m over the questions (pre-monitoring's allocation), and how often a high-entropy
        # tool step follows a high-entropy one against the chance level (all tool steps after a high-entropy one).
        "penalized_per_question": sum(1 for t in trees for n in t.nodes if n.branch_reason == "penalized") / n_q,
        "global_budget_std": _std([float(t.global_budget) for t in trees]),
        "global_budget_min": float(min((t.global_budget for t in trees), default=0)),
        "global_budget_max": float(max((t.global_budget for t in trees), default=0)),
        "consecutive_high_entropy_share": runs.high_after_high / runs.high if runs.high else math.nan,
        "consecutive_high_entropy_chance": runs.after_high / runs.steps if runs.steps else math.nan,
        "response_tokens_mean": _mean([float(len(t.response_ids(leaf))) for t, leaf in leaves]),
    }
    for status in ("answered", "truncated", "tool_limit", "tool_error", "engine_error"):
        stats[f"status_{status}"] = float(statuses.get(status, 0))
    by_l: dict[int, list[bool]] = defaultdict(list)
    for l_count, branched in decisions:
        by_l[l_count].append(branched)
    rates = {l_count: sum(v) / len(v) for l_count, v in sorted(by_l.items())}
    return stats, rates
