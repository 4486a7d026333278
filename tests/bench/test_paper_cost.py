"""The paper-scale cost model (bench/paper_cost.py): its arithmetic, and that its conclusions follow from the tools."""

from __future__ import annotations

import dataclasses

import pytest

from bench.paper_cost import Assumptions, update_seconds, variants


def test_update_is_eight_flops_a_parameter_a_token_at_the_stated_mfu() -> None:
    a = Assumptions()
    tokens = 768 * (1500 + 5 * 600)
    assert update_seconds(a, 8) == pytest.approx(8 * 14.8e9 * tokens / (8 * 989e12 * 0.35))
    assert update_seconds(a, 4) == pytest.approx(2 * update_seconds(a, 8))


def test_overlap_pays_the_longer_part_not_the_sum_and_per_path_hides_tool_waits() -> None:
    rows = {(r["scheduling"], r["max_staleness"]): r for r in variants(Assumptions(), reps=4)}
    for (scheduling, s), r in rows.items():
        parts = max(r["rollout_s"], r["update_s"]) if s else r["rollout_s"] + r["update_s"]
        assert r["step_s"] == pytest.approx(parts + Assumptions().weight_sync_s), (scheduling, s)
    assert rows[("per_path", 0)]["tool_wait_s"] < rows[("rounds", 0)]["tool_wait_s"]


def test_with_instant_tools_the_round_loop_waits_on_nothing() -> None:
    """Not a constant: the tool wait the model charges the round loop (what per_path hides) comes from the tools;
    with (nearly) instant tools it is gone."""
    instant = dataclasses.replace(Assumptions(), tool_mix=(("search", 1.0, 1e-3, 2e-3),))
    rows = {(r["scheduling"], r["max_staleness"]): r for r in variants(instant, reps=2)}
    assert rows[("rounds", 0)]["tool_wait_s"] < 0.05
