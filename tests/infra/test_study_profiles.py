"""The rollout study's per-question Parquet: every GroupProfile field round-trips, and a study written before the
paper's quantities existed still reads (their columns empty)."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from aepo_core.rollout.study import GroupProfile
from infra.run.study import ADDED_IN_ISSUE_26, PROFILE_SCHEMA, Arm, read_profiles, write_profiles

PROFILE = GroupProfile("q1", 8, 3, 0.5, 1.0, 2, (0, 1, 0), 5, 2, 1, True, 4, -0.25, 321,
                       high_entropy_steps=4, high_entropy_after_high=3, steps_after_tool=9, steps_after_high=5,
                       branch_samples_by_root=(3, 1),
                       penalized=2, open_decisions_by_l=(5, 2), branches_by_l=(3, 0))


def test_every_field_round_trips(tmp_path: Path) -> None:
    nan_shares = GroupProfile("q2", 8, 0, math.nan, math.nan, 0, (), 1, 0, 0, False, 4, math.nan, 100)
    write_profiles(tmp_path / "p.parquet", {Arm(8, "aepo"): [PROFILE, nan_shares]})
    (back, back_nan), = read_profiles(tmp_path / "p.parquet").values()
    assert back == PROFILE
    assert math.isnan(back_nan.top1_share) and back_nan.branch_samples_by_root == () and back_nan.penalized == 0
    assert set(PROFILE_SCHEMA.names) == {"k", "mode", *asdict(PROFILE)}


def test_a_study_from_before_the_papers_quantities_reads_with_them_empty(tmp_path: Path) -> None:
    write_profiles(tmp_path / "p.parquet", {Arm(8, "arpo"): [PROFILE]})
    table = pq.read_table(tmp_path / "p.parquet")
    old = table.drop_columns(list(ADDED_IN_ISSUE_26))
    pq.write_table(old, tmp_path / "old.parquet")
    (back,), = read_profiles(tmp_path / "old.parquet").values()
    assert back.consecutive == (0, 1, 0) and back.model_tokens == 321
    assert (back.high_entropy_steps, back.branch_samples_by_root, back.branches_by_l) == (0, (), ())
    assert pa.types.is_list(PROFILE_SCHEMA.field("branches_by_l").type)


def test_quantity_a_of_a_file_from_before_the_median_threshold_is_not_misread(tmp_path: Path) -> None:
    """Files written while ΔH > 0 was the high-entropy test (no steps_after_tool column) keep every other field,
    but their high-entropy counts meant something else: read as absent, so quantity (a) is undefined for them."""
    write_profiles(tmp_path / "p.parquet", {Arm(8, "arpo"): [PROFILE]})
    old = pq.read_table(tmp_path / "p.parquet").drop_columns(["steps_after_tool", "steps_after_high"])
    pq.write_table(old, tmp_path / "old.parquet")
    (back,), = read_profiles(tmp_path / "old.parquet").values()
    assert (back.high_entropy_steps, back.high_entropy_after_high) == (0, 0)
    assert back.branch_samples_by_root == (3, 1) and back.penalized == 2
