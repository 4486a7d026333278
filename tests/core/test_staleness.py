"""The bounded-staleness schedule (train.max_staleness) and the staleness of an update's tokens."""

from __future__ import annotations

import itertools

import pytest

from aepo_core.correction import resolved_correction
from aepo_core.rollout.tree import Node, RolloutTree
from aepo_core.staleness import due_steps, sampling_version, staleness_metrics


def test_on_policy_samples_each_step_from_the_previous_update() -> None:
    assert [sampling_version(j, 0, 3) for j in range(1, 8)] == [0, 1, 2, 3, 4, 5, 6]
    assert [due_steps(v, 7, 0, 3) for v in range(7)] == [[1], [2], [3], [4], [5], [6], [7]]


def test_one_step_off_policy_restarts_after_each_checkpoint() -> None:
    # every = 4: checkpoints after updates 4 and 8; steps 5 and 9 are sampled by the checkpoint's own weights
    versions = [sampling_version(j, 1, 4) for j in range(1, 11)]
    assert versions == [0, 0, 1, 2, 4, 4, 5, 6, 8, 8]
    assert due_steps(0, 10, 1, 4) == [1, 2]
    assert due_steps(3, 10, 1, 4) == []  # step 5 waits for checkpoint 4
    assert due_steps(4, 10, 1, 4) == [5, 6]
    assert due_steps(9, 10, 1, 4) == []  # nothing past the run's end


@pytest.mark.parametrize(("s", "every", "total"), itertools.product([0, 1, 2, 3], [1, 2, 3, 5], [1, 6, 11]))
def test_every_step_is_sampled_once_by_weights_at_most_s_updates_old(s: int, every: int, total: int) -> None:
    due = {v: due_steps(v, total, s, every) for v in range(total)}
    steps = [j for v in range(total) for j in due[v]]
    assert steps == list(range(1, total + 1))  # each once, in order, as the versions arrive
    for v, js in due.items():
        for j in js:
            assert 0 <= (j - 1) - v <= s  # bounded staleness
            assert v >= (j - 1) // every * every  # never sampled across a checkpoint: resume is exact


def test_staleness_of_an_update_is_token_weighted_over_versioned_segments() -> None:
    def node(i: int, version: str | None, n: int, kind: str = "model") -> Node:
        return Node(node_id=i, parent_id=None, depth=0, kind=kind, token_ids=[1] * n, weight_version=version)

    tree = RolloutTree("q", [0], [node(0, "3", 30), node(1, None, 5, "tool"), node(2, "2", 10),
                                  node(3, None, 100)], [], 1, 0.0, 0.0)
    assert staleness_metrics([tree], trainer_version=3) == {
        "staleness_mean": 10 / 40, "staleness_max": 1.0, "version_spread": 1.0, "stale_token_share": 10 / 40}
    assert staleness_metrics([tree], trainer_version=4)["staleness_mean"] == pytest.approx((30 + 20) / 40)
    unversioned = RolloutTree("q", [0], [node(0, None, 9)], [], 1, 0.0, 0.0)
    assert staleness_metrics([unversioned], 2) == {}


def test_auto_correction_turns_on_for_stale_samplers() -> None:
    assert resolved_correction("auto", "generation", 0) == "none"
    assert resolved_correction("auto", "generation", 1) == "tis"
    assert resolved_correction("none", "generation", 2) == "none"  # an explicit choice stands
