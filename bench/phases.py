"""Where a run's wall time went, by phase, read back from the ``time/*`` metrics every run logs
(:data:`flows.train.PHASE_TIME`): cold-start SFT, evaluations, and per RL step the rollout and the update, of which
the scoring pass (the no-grad π_old forward, ``train/scoring_pass_s``) is one part. What a cheaper sweep has to cut
is read here (issue 27 §2), before and after, in the same units for every bench."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

SCORING_PASS = "train/scoring_pass_s"


@dataclass(frozen=True)
class PhaseSeconds:
    """Wall seconds of one run (or a mean of runs) by phase."""

    sft: float
    eval: float
    """All evaluations (start, after SFT, periodic, final)."""
    rollout: float
    """Sampling, tool calls and scoring of the RL rollouts, refill rounds included."""
    update: float
    """The RL updates, the scoring pass included."""
    scoring_pass: float
    steps: int
    """RL steps with a logged update."""

    @property
    def gradient(self) -> float:
        """The updates without their scoring pass: forward(s), backward, optimizer steps."""
        return self.update - self.scoring_pass

    @property
    def total(self) -> float:
        return self.sft + self.eval + self.rollout + self.update

    def per_step(self, phase: str) -> float:
        """``rollout``, ``scoring_pass``, ``gradient`` or ``update`` seconds per RL step."""
        value = {"rollout": self.rollout, "scoring_pass": self.scoring_pass, "gradient": self.gradient,
                 "update": self.update}[phase]
        return value / self.steps if self.steps else math.nan

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def phase_seconds(tracker: Any, run_id: str) -> PhaseSeconds:
    """One run's phases from its MLflow metric histories (``tracker``: :class:`infra.tracking.run.Tracker`); NaN
    for a run that logged no phase timings (older runs)."""
    from flows.train import PHASE_TIME
    from infra.tracking.client import metric_key

    logged = tracker.client.get_run(run_id).data.metrics
    evals = [k for k in logged if k.startswith(f"{PHASE_TIME}eval_")]
    keys = {"sft": f"{PHASE_TIME}sft_s", "rollout": f"{PHASE_TIME}rollout_s", "update": f"{PHASE_TIME}update_s",
            "scoring_pass": SCORING_PASS}
    if not evals and not any(metric_key(k) in logged for k in keys.values()):  # a run from before the phase timings
        return PhaseSeconds(*(math.nan,) * 5, steps=0)
    history = tracker.metric_history([*keys.values(), *evals], run_id=run_id)
    sums = {name: sum(v for _, v in history[key]) for name, key in keys.items()}
    return PhaseSeconds(eval=sum(v for key in evals for _, v in history[key]), steps=len(history[keys["update"]]),
                        **sums)


def mean_phases(runs: Sequence[PhaseSeconds]) -> PhaseSeconds:
    """The phases of the mean run (steps: the mean, rounded)."""
    if not runs:
        raise ValueError("mean_phases needs at least one run")
    return PhaseSeconds(sft=statistics.fmean(r.sft for r in runs), eval=statistics.fmean(r.eval for r in runs),
                        rollout=statistics.fmean(r.rollout for r in runs),
                        update=statistics.fmean(r.update for r in runs),
                        scoring_pass=statistics.fmean(r.scoring_pass for r in runs),
                        steps=round(statistics.fmean(r.steps for r in runs)))


PHASE_COLUMNS = ["RL steps", "SFT min", "eval min", "rollout s/step", "scoring pass s/step", "update rest s/step",
                 "total min"]
"""Column names of :func:`phase_row`."""


def phase_row(p: PhaseSeconds) -> list[Any]:
    """One table row: SFT and evaluations in minutes, the RL step's parts in seconds per step, the total."""
    return [p.steps, p.sft / 60, p.eval / 60, p.per_step("rollout"), p.per_step("scoring_pass"),
            p.per_step("gradient"), p.total / 60]
