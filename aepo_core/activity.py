"""Whether a run's mechanisms had anything to act on (issue 53 §2): from the mean over its RL steps of the activity
metrics every step logs, one sentence per mechanism the config turned on that barely acted, for the run's summary.

The floors are where a mechanism's effect is too small to show in a comparison of this system's size, not laws: in
the powered comparison (5 seeds × 112 questions) the loss clipped 0.2 % of update tokens in every arm, and the
clip-balance ablation, which differs from AEPO only on clipped tokens, was not told apart from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from aepo_core.config import ExperimentConfig
from aepo_core.rollout.budget import budget_band
from aepo_core.token_classes import HIGH_ENTROPY_NATS

ACTIVITY_METRICS = {  # metric → a table's column heading
    "train/clip_frac": "clipped update tokens",
    "train/clip_frac_high": "clipped high",
    "train/high_entropy_share": "update tokens ≥ 0.672 nats",
    "train/high_entropy_clip_frac_high": "of them clipped high",
    "train/high_entropy_clip_frac_low": "of them clipped low",
    "train/entropy_advantage_factor_max": "entropy-advantage factor max",
    "rollout/delta_h_mean": "ΔH after tools",
    "rollout/entropy_post_tool_window": "post-tool window entropy",
    "rollout/penalized_per_question": "penalized decisions/q",
    "rollout/global_budget_std": "m spread (sd)",
    "rollout/consecutive_high_entropy_share": "high after high",
    "rollout/consecutive_high_entropy_chance": "high after high, chance",
}
"""What each mechanism had to act on, logged at every RL step: the clipping losses (AEPO's stop-gradient balance,
PPO's, GPPO's) differ only on clipped tokens, and AEPO's gate only on high-entropy ones; the branch rule reads ΔH over
the post-tool windows; the consecutive-branch penalty turns decisions off; pre-monitoring spreads m over questions;
the entropy-aware advantage reweights tokens by up to its factor; the paper's "high-entropy tool steps follow each
other" against its chance level."""
CLIPPED_FLOOR = 0.01
"""A clipping rule acting on under 1 % of the update's tokens: the PPO-family losses differ only there."""
HIGH_ENTROPY_FLOOR = 0.05
"""Under 5 % of update tokens at or above 0.672 nats: little for a high-entropy gate or bonus to find."""
WINDOW_FLOOR = 0.5
"""Post-tool windows under 0.5 nats: the ΔH the branch rule reads is small (issue 53's target for a testbed)."""
PENALIZED_FLOOR = 0.5
"""The consecutive-branch penalty turning off under half a decision per question."""
FACTOR_FLOOR = 1.25
"""The entropy-aware advantage's largest factor under 1.25: no token's advantage grew by a quarter."""
CLIPPING_LOSSES = frozenset({"ppo_clip", "dapo", "aepo", "gppo", "ce_gppo"})


def idle_mechanisms(means: Mapping[str, float], cfg: ExperimentConfig) -> list[str]:
    """One sentence per mechanism ``cfg`` turned on whose activity (``means``: metric → its mean over the run's
    steps, MLflow names) stayed under its floor; none for a metric the run did not log."""
    notes = []

    def below(metric: str, floor: float) -> float | None:
        value = means.get(metric)
        return value if value is not None and not math.isnan(value) and value < floor else None

    if cfg.algorithm.loss in CLIPPING_LOSSES and (x := below("train/clip_frac", CLIPPED_FLOOR)) is not None:
        notes.append(f"the {cfg.algorithm.loss} loss clipped {x:.2%} of update tokens (under {CLIPPED_FLOOR:.0%}): "
                     "clipping rules differ only on those")
    if (x := below("train/high_entropy_share", HIGH_ENTROPY_FLOOR)) is not None:
        notes.append(f"{x:.2%} of update tokens had at least {HIGH_ENTROPY_NATS} nats of entropy (under "
                     f"{HIGH_ENTROPY_FLOOR:.0%}): little for the high-entropy gate or bonus to act on")
    if cfg.rollout.mode in ("aepo", "arpo"):
        if (x := below("rollout/entropy_post_tool_window", WINDOW_FLOOR)) is not None:
            notes.append(f"the post-tool windows ΔH reads averaged {x:.3f} nats (under {WINDOW_FLOOR})")
    if cfg.rollout.mode == "aepo" and cfg.rollout.branch_penalty > 0:
        if (x := below("rollout/penalized_per_question", PENALIZED_FLOOR)) is not None:
            notes.append(f"the consecutive-branch penalty turned off {x:.2f} decisions per question")
    if cfg.rollout.mode == "aepo" and cfg.rollout.premonitor and (x := below("rollout/global_budget_std", 1e-9)) \
            is not None:
        notes.append(_same_m(means.get("rollout/global_budget_mean"), cfg))
    if cfg.algorithm.entropy_advantage and (x := below("train/entropy_advantage_factor_max", FACTOR_FLOOR)) \
            is not None:
        notes.append(f"the entropy-aware advantage's factor stayed at or under {x:.2f}")
    return notes


def _same_m(m_mean: float | None, cfg: ExperimentConfig) -> str:
    """Pre-monitoring gave one m to every question; with m known, the entropy gaps for which the rule gives it."""
    note = "pre-monitoring gave every question the same global budget m"
    if m_mean is None or math.isnan(m_mean):
        return note
    r = cfg.rollout
    m = max(1, min(r.k, round(m_mean)))
    low, high = budget_band(r.k, r.beta, m, r.budget_rule)
    band = (f"between {_nats(low)} and {_nats(high)} nats" if math.isfinite(low) and math.isfinite(high)
            else f"at or above {_nats(low)} nats" if math.isfinite(low) else f"below {_nats(high)} nats")
    return (f"{note} = {m}: at k = {r.k}, β = {r.beta:g} the {r.budget_rule} rule gives m = {m} for any "
            f"H_root − H̄_tool {band}")


def _nats(x: float) -> str:
    return f"{x:+.2f}".replace("-", "−")
