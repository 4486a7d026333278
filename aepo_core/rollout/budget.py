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
    x = beta * (h_root - h_tool)
    sig = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    m = math.floor(k * sig + 0.5)
    return max(1, min(k, m))


def fixed_budget(k: int, initial_rollouts: int) -> int:
    """m without pre-monitoring: the configured number of initial rollouts, within [1, k]."""
    return max(1, min(k, initial_rollouts))
