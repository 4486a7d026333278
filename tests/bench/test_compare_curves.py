"""bench.compare_algorithms as a thin caller of infra.run.compare (tests/infra/test_compare.py tests the comparison
itself): the --analyse-only path (the sweep's stored runs → the comparison) on a real MLflow store (SQLite in
tmp_path), and what only the bench adds, where each arm's runs spent their wall time."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest

from bench.compare_algorithms import analyse, arm_phases, report, stored_runs, sweep_spec
from infra.tracking.client import artifact_location_for, tracking_uri_for
from infra.tracking.run import Tracker

REPO = Path(__file__).resolve().parents[2]
DATASET = "synthetic_test"
# run name → metric → [(step, value)]: wall seconds by phase; grpo's runs are older than these timings
HISTORIES = {
    "tiny-sweep-aepo-s0": {"time/sft_s": [(0, 60.0)], "time/eval_sft_s": [(0, 30.0)], "time/eval_final_s": [(3, 30.0)],
                           "time/rollout_s": [(1, 8.0), (2, 8.0), (3, 8.0)],
                           "time/update_s": [(1, 10.0), (2, 10.0), (3, 10.0)],
                           "train/scoring_pass_s": [(1, 2.0), (2, 2.0), (3, 2.0)]},
    "tiny-sweep-aepo-s1": {"time/sft_s": [(0, 120.0)], "time/eval_sft_s": [(0, 30.0)],
                           "time/eval_final_s": [(3, 50.0)], "time/rollout_s": [(1, 10.0), (2, 12.0), (3, 14.0)],
                           "time/update_s": [(1, 20.0), (2, 25.0), (3, 30.0)],
                           "train/scoring_pass_s": [(1, 4.0), (2, 5.0), (3, 6.0)]},
    "tiny-sweep-grpo-s0": {"train/entropy_mean": [(1, 1.0)]},
    "tiny-sweep-grpo-s1": {"train/entropy_mean": [(1, 1.0)]},
}


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The four children (named like the sweep's, FINISHED, with a final evaluation) under a parent, read back as
    ``--analyse-only`` reads them."""
    from infra.run.sweep_spec import load_sweep

    runs = tmp_path_factory.mktemp("runs")
    tracker = Tracker(tracking_uri_for(runs), artifact_location=artifact_location_for(runs))
    client, exp = tracker.client, tracker.experiment_id()
    parent = client.create_run(exp, run_name="tiny-sweep").info.run_id
    for name, history in HISTORIES.items():
        rid = client.create_run(exp, run_name=name, tags={"mlflow.parentRunId": parent}).info.run_id
        for metric, points in history.items():
            for step, value in points:
                client.log_metric(rid, metric, value, step=step)
        client.log_metric(rid, f"eval/{DATASET}/pass_at_1", 0.5, step=3)
        client.log_dict(rid, {"questions": [{"question_id": f"q{i}", "n": 2, "correct": i % 3} for i in range(4)]},
                        f"eval/final/{DATASET}.json")
        client.set_terminated(rid)
    checked = load_sweep(sweep_spec(REPO / "configs" / "sweeps" / "tiny.yaml", [], [0, 1], None, None))
    result = stored_runs(runs, checked, None)  # what --analyse-only reads
    assert len(result["runs"]) == 4
    with tempfile.TemporaryDirectory() as tmp:
        return analyse(result, DATASET, checked.name, Path(tmp))


def test_the_stored_runs_are_compared_by_infra(compared: object) -> None:
    from infra.run.compare import AlgorithmComparison

    assert isinstance(compared, AlgorithmComparison)
    assert [a.name for a in compared.arms] == ["aepo", "grpo"] and compared.baseline == "grpo"
    assert [p.name for p in compared.pairs] == ["aepo - grpo"]
    assert compared.arm("aepo").pass1_over_seeds.per_seed == {0: pytest.approx(0.375), 1: pytest.approx(0.375)}


def test_where_the_time_went_by_phase(compared: object, capsys: pytest.CaptureFixture[str]) -> None:
    """Per arm, the mean run's wall seconds by phase from the time/* metrics; the scoring pass apart from the rest of
    the update; runs from before the timings give NaN, not a zero that reads as free."""
    from bench.phases import PhaseSeconds

    phases = arm_phases(compared)
    aepo = phases["aepo"]
    # s0: sft 60, eval 30 + 30, rollout 24, update 30 (scoring 6); s1: 120, 30 + 50, 36, 75 (15); 3 steps each
    assert aepo == PhaseSeconds(sft=90.0, eval=70.0, rollout=30.0, update=52.5, scoring_pass=10.5, steps=3)
    assert aepo.per_step("rollout") == pytest.approx(10.0) and aepo.per_step("scoring_pass") == pytest.approx(3.5)
    assert aepo.per_step("gradient") == pytest.approx(14.0) and aepo.total == pytest.approx(242.5)
    grpo = phases["grpo"]
    assert math.isnan(grpo.total) and grpo.steps == 0 and math.isnan(grpo.per_step("rollout"))
    report(compared, phases)
    out = capsys.readouterr().out
    assert "Where a run's time went" in out and "Arms over seeds" in out and "Paired differences" in out
