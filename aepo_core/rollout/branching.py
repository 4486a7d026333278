"""Entropy-balanced adaptive branching (AEPO.md §4).

At a tool step the path branches iff (u + γ·ΔH) · max(0, 1 − λ·l) ≥ τ, where u ~ U(0,1), ΔH is the entropy
the tool feedback caused relative to the path's initial entropy, and l counts the consecutive tool steps just
before this one, on this path, at which a branch was created.  λ = 0 is ARPO's rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

BranchReason = Literal["branch", "below_tau", "penalized", "budget_full", "no_tool_step"]


@dataclass(frozen=True)
class BranchDecision:
    branch: bool
    score: float
    penalty: float
    reason: BranchReason


def consecutive_branch_penalty(consecutive: int, lam: float) -> float:
    """max(0, 1 − λ·l): reaches 0 once l ≥ 1/λ."""
    if consecutive < 0:
        raise ValueError(f"consecutive branch count must be >= 0, got {consecutive}")
    return max(0.0, 1.0 - lam * consecutive)


def branch_decision(
    u: float, delta_h: float, consecutive: int, *, gamma: float, tau: float, lam: float
) -> BranchDecision:
    """The branch rule as a pure function of (u, ΔH, l) and the config constants."""
    raw = u + gamma * delta_h
    penalty = consecutive_branch_penalty(consecutive, lam)
    score = raw * penalty
    if score >= tau:
        return BranchDecision(True, score, penalty, "branch")
    reason: BranchReason = "penalized" if raw >= tau else "below_tau"
    return BranchDecision(False, score, penalty, reason)


def arpo_branch_decision(u: float, delta_h: float, *, gamma: float, tau: float) -> BranchDecision:
    """ARPO's rule: the AEPO rule without the consecutive-branch penalty (λ = 0)."""
    return branch_decision(u, delta_h, 0, gamma=gamma, tau=tau, lam=0.0)


def consecutive_branch_count(step_branched: Sequence[bool]) -> int:
    """l for the next tool step of a path: the trailing run of branching steps along the path's own history.

    ``step_branched`` lists, in order, whether each earlier tool step on the path (its ancestors included)
    created a branch; a step that did not branch resets the count.
    """
    count = 0
    for branched in reversed(step_branched):
        if not branched:
            break
        count += 1
    return count
