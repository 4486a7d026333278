"""Entropy pre-monitoring: how much of a question's budget goes to global samples (AEPO.md §3)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def mean_tool_entropy(h_root: float, tool_segment_entropies: Sequence[float]) -> float:
    """H̄_tool of a probe: mean entropy of its segments after tool results; H_root if it made no tool call."""
    finite = [h for h in tool_segment_entropies if not math.isnan(h)]
    return sum(finite) / len(finite) if finite else h_root


def global_budget(k: int, h_root: float, h_tool: float, beta: float) -> int:
    """m = clamp(round(k · σ(β · (H_root − H̄_tool))), 1, k).

    More uncertainty in the question than in tool feedback gives more global samples; the reverse gives
    more branch budget.  Rounding is half-up (Python's round() would round 2.5 to 2).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    m = math.floor(k * _sigmoid(beta * (h_root - h_tool)) + 0.5)
    return max(1, min(k, m))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def official_global_budget(k: int, h_root: float, h_tool: float, beta: float) -> int:
    """m = min(k, int(k · σ(β · (H_root − H̄_tool))) + 1), the published code's rule: truncation plus one, so m is
    on average ~0.5 higher than :func:`global_budget`'s rounding and never below 1."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return min(k, int(k * _sigmoid(beta * (h_root - h_tool))) + 1)


def official_tool_entropy(first_segment: float, tool_segment_entropies: Sequence[float]) -> float:
    """H̄_tool of the published code: the mean over the probe's first segment and its segments after tool results."""
    finite = [h for h in (first_segment, *tool_segment_entropies) if not math.isnan(h)]
    return sum(finite) / len(finite) if finite else math.nan


def budget_band(k: int, beta: float, m: int, rule: str = "paper") -> tuple[float, float]:
    """The entropy gaps H_root − H̄_tool for which ``rule`` gives m, as [low, high) in nats (±inf at the ends).

    The paper's rule gives m where k·σ(β·gap) ∈ [m − ½, m + ½) (m = 1 and m = k open below and above); the
    published rule where k·σ(β·gap) ∈ [m − 1, m).  So gap ∈ [logit(p_low)/β, logit(p_high)/β): at k = 4, β = 0.5
    the paper's rule gives m = 2 for any gap within ±1.02 nats, at k = 12 m = 6 within ±0.33.  Pre-monitoring with
    small k can only act on large gaps.
    """
    if not 1 <= m <= k:
        raise ValueError(f"m must be in [1, k = {k}], got {m}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0 for m to depend on the gap, got {beta}")
    if rule not in ("paper", "official"):
        raise ValueError(f"unknown budget rule {rule!r}")
    p_low, p_high = ((m - 0.5) / k, (m + 0.5) / k) if rule == "paper" else ((m - 1) / k, m / k)
    low = -math.inf if m == 1 or p_low <= 0 else math.log(p_low / (1 - p_low)) / beta
    high = math.inf if m == k or p_high >= 1 else math.log(p_high / (1 - p_high)) / beta
    return low, high


def fixed_budget(k: int, initial_rollouts: int) -> int:
    """m without pre-monitoring: the configured number of initial rollouts, within [1, k]."""
    return max(1, min(k, initial_rollouts))
