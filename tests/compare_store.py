"""A sweep's MLflow store for the comparison's tests (tests/infra/test_compare.py, tests/flows/test_compare_cli.py):
a parent run and four FINISHED children with metric histories and final evaluations, tagged as a sweep tags them."""

from __future__ import annotations

from pathlib import Path

from infra.run.compare import CLIP, ENTROPY, TOKENS
from infra.tracking.client import artifact_location_for, tracking_uri_for
from infra.tracking.run import Tracker

TOP1 = "rollout/branch_top1_share"
DATASET = "synthetic_test"

# run name → metric → [(step, value)]: aepo seed 1 is an "old" run without the branch shares; grpo seed 1 stopped
# after 2 steps; grpo never branches.
HISTORIES = {
    "tiny-sweep-aepo-s0": {ENTROPY: [(1, 1.0), (2, 0.9), (3, 0.8)], TOP1: [(1, 0.5), (2, 0.6), (3, 0.7)],
                           "rollout/reward_mean": [(1, -0.5), (2, 0.0), (3, 0.5)],
                           TOKENS: [(1, 100.0), (2, 250.0), (3, 400.0)], "step/wall_s": [(1, 10.0), (2, 12.0)],
                           CLIP: [(1, 0.0), (2, 0.01), (3, 0.02)], "rollout/delta_h_mean": [(1, 0.2), (2, 0.4)]},
    "tiny-sweep-aepo-s1": {ENTROPY: [(1, 1.2), (2, 1.1), (3, 1.0)], "rollout/reward_mean": [(1, 0.0), (3, 0.5)],
                           TOKENS: [(1, 120.0), (2, 250.0), (3, 380.0)],
                           CLIP: [(1, 0.0), (2, 0.03), (3, 0.03)], "rollout/delta_h_mean": [(1, 0.5)]},
    "tiny-sweep-grpo-s0": {ENTROPY: [(1, 1.0), (2, 0.4), (3, 0.2)], "rollout/reward_mean": [(1, 0.0)]},
    "tiny-sweep-grpo-s1": {ENTROPY: [(1, 1.0), (2, 0.5)]},
}
FAMILY = ["single_hop", "single_hop", "two_hop", "two_hop"]
CORRECT = {"tiny-sweep-aepo-s0": [2, 1, 0, 2], "tiny-sweep-aepo-s1": [2, 2, 0, 1],
           "tiny-sweep-grpo-s0": [1, 1, 0, 2], "tiny-sweep-grpo-s1": [2, 0, 0, 2]}


def make_store(runs: Path, legacy: str | None = "tiny-sweep-grpo-s0") -> tuple[str, str]:
    """The sweep's parent run and four FINISHED children with their histories and final evaluation, tagged as a sweep
    tags them (cell, seed) except ``legacy`` (a run from before the cell tag: its file's run name names it), plus an
    unfinished re-run of a cell (which must not count); (tracking URI, parent run id)."""
    uri = tracking_uri_for(runs)
    tracker = Tracker(uri, artifact_location=artifact_location_for(runs))
    client, exp = tracker.client, tracker.experiment_id()
    parent = client.create_run(exp, run_name="tiny-sweep", tags={"kind": "sweep", "sweep_name": "tiny-sweep"})
    parent_id = parent.info.run_id
    for name, history in HISTORIES.items():
        cell, seed = name.split("-")[2], name[-1]
        tags = {"mlflow.parentRunId": parent_id, "seed": seed, "algorithm": cell}
        if name != legacy:
            tags.update({"sweep_cell": cell, "sweep_name": "tiny-sweep"})
        rid = client.create_run(exp, run_name=name, tags=tags).info.run_id
        for metric, points in history.items():
            for step, value in points:
                client.log_metric(rid, metric, value, step=step)
        correct = CORRECT[name]
        client.log_metric(rid, f"eval/{DATASET}/pass_at_1", sum(correct) / 8, step=3)
        client.log_metric(rid, f"eval/{DATASET}/tool_calls_per_question", 1.0 + int(seed), step=3)
        client.log_param(rid, "eval.pass_k", 2)
        client.log_param(rid, "eval.bootstrap_samples", 200)
        client.log_dict(rid, {"questions": [{"question_id": f"q{i}", "n": 2, "correct": c, "family": FAMILY[i]}
                                            for i, c in enumerate(correct)]}, f"eval/final/{DATASET}.json")
        client.set_terminated(rid)
    client.create_run(exp, run_name="tiny-sweep-aepo-s0", tags={"mlflow.parentRunId": parent_id, "seed": "0",
                                                                "sweep_cell": "aepo", "sweep_name": "tiny-sweep"})
    client.set_terminated(parent_id)
    return uri, parent_id
