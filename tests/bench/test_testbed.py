"""bench.testbed: a candidate testbed's figures against issue 53's targets. The verdicts and the figures over seeds
on hand-made histories (the formulas), and the histories read back from a real MLflow store, where the two clipped
sides of the high-entropy tokens are summed per step."""

from __future__ import annotations

from pathlib import Path

import pytest

from aepo_core.evaluation import OverSeeds
from bench.testbed import HOT_CLIPPED, TARGETS, Target, candidate, run_histories


def test_a_target_is_met_only_where_its_interval_clears_the_floor() -> None:
    t = Target("x ≥ 0.5", "m", "start", 0.5)
    assert t.verdict(OverSeeds.of({0: 0.6, 1: 0.62, 2: 0.61})) == "met"
    assert t.verdict(OverSeeds.of({0: 0.3, 1: 0.32, 2: 0.31})) == "not met"
    assert t.verdict(OverSeeds.of({0: 0.3, 1: 0.7, 2: 0.5})) == "undecided"  # the interval holds 0.5
    assert t.verdict(OverSeeds.of({0: 0.55})) == "met (one seed)"
    assert t.verdict(None) == "not logged"
    assert [t.metric for t in TARGETS] == ["rollout/entropy_model", "rollout/entropy_post_tool_window", HOT_CLIPPED]


def test_the_start_is_the_first_rl_step_and_training_the_mean_over_steps() -> None:
    hists = {0: {"rollout/entropy_model": [(1, 0.3), (2, 0.5)], HOT_CLIPPED: [(1, 0.01), (2, 0.03)],
                 "train/clip_frac": [(1, float("nan")), (2, 0.004)]},
             1: {"rollout/entropy_model": [(1, 0.1), (2, 0.9)], HOT_CLIPPED: [(1, 0.0), (2, 0.0)]}}
    figures = candidate(hists)
    start = figures["start"]["rollout/entropy_model"]
    assert start.per_seed == {0: 0.3, 1: 0.1} and start.mean == pytest.approx(0.2)
    assert figures["training"][HOT_CLIPPED].per_seed == {0: pytest.approx(0.02), 1: 0.0}
    assert figures["training"]["train/clip_frac"].per_seed == {0: 0.004}  # NaN steps skipped, an unlogged run left out
    assert "rollout/entropy_post_tool_window" not in figures["start"]


def test_histories_from_a_real_store_sum_the_clipped_sides(tmp_path: Path) -> None:
    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run import Tracker

    tracker = Tracker(tracking_uri_for(tmp_path))
    client = tracker.client
    run_id = client.create_run(client.create_experiment("t")).info.run_id
    for step, (high, low, model) in enumerate([(0.01, 0.02, 0.4), (0.0, 0.05, 0.6)], start=1):
        client.log_metric(run_id, f"{HOT_CLIPPED}_high", high, step=step)
        client.log_metric(run_id, f"{HOT_CLIPPED}_low", low, step=step)
        client.log_metric(run_id, "rollout/entropy_model", model, step=step)
    hist = run_histories(tracker, run_id)
    assert hist[HOT_CLIPPED] == [(1, pytest.approx(0.03)), (2, pytest.approx(0.05))]
    assert hist["rollout/entropy_model"] == [(1, 0.4), (2, 0.6)]
    assert hist[f"{HOT_CLIPPED}_high"] == [(1, 0.01), (2, 0.0)]  # the sides stay for the activity table
    assert hist["rollout/entropy_post_tool_window"] == []
