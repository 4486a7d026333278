"""Two training runs from the same start in one runs dir (a sweep's cells): the second reads the first's start
evaluation back instead of sampling it, and logs it as a fresh one (metrics at step 0, the per-question file, the
final − start comparison), tagged with where it came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from infra.config_files import load_config
from infra.tracking.client import metric_key

pytestmark = pytest.mark.slow  # trains

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
SETS = ["train.steps=1", "eval.at_start=true", "eval.max_questions=2", "tracking.log_model=false"]
KEY = "synthetic_test"


def test_a_second_run_from_the_same_start_reuses_its_evaluation(prefect_harness, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    import tasks.rl
    from flows.train import train

    sampled: list[str] = []
    evaluate_dataset = tasks.rl.evaluate_dataset

    def counting(runtime: Any, dataset: str, *args: Any, **kwargs: Any) -> Any:
        sampled.append(runtime.cfg.tracking.run_name or "")
        return evaluate_dataset(runtime, dataset, *args, **kwargs)

    monkeypatch.setattr(tasks.rl, "evaluate_dataset", counting)
    runs = tmp_path / "runs"
    # The arms differ in what RL does, not in where it starts.
    a = train(config=load_config(TINY, [*SETS, "tracking.run_name=arm-a"]), runs_dir=str(runs))
    b = train(config=load_config(TINY, [*SETS, "tracking.run_name=arm-b", "algorithm.loss=ppo_clip",
                                        "rollout.mode=arpo"]), runs_dir=str(runs))
    assert sampled == ["arm-a", "arm-a", "arm-b"]  # a: start and final; b: final only

    client = MlflowClient(a.tracking_uri)
    tags_a, tags_b = client.get_run(a.run_id).data.tags, client.get_run(b.run_id).data.tags
    assert tags_b[f"start_eval/start/{KEY}/reused_from"] == f"{a.run_id} (arm-a, start)"
    assert tags_b[f"start_eval/start/{KEY}/key"] == tags_a[f"start_eval/start/{KEY}/key"]
    assert f"start_eval/start/{KEY}/reused_from" not in tags_a
    for name in ("pass@1", "pass@2", "pass@1_ci_low", "answered_rate", "tool_calls_per_question"):
        at0 = [[m.value for m in client.get_metric_history(r.run_id, metric_key(f"eval/{KEY}/{name}")) if m.step == 0]
               for r in (a, b)]
        assert at0[0] and at0[0] == at0[1], name
    files = [pq.read_table(runs / "eval" / r.run_name / "start" / f"{KEY}.parquet").to_pylist() for r in (a, b)]
    assert [row["pass_at_1"] for row in files[0]] == [row["pass_at_1"] for row in files[1]]
    assert {row["eval_run_id"] for row in files[1]} == {b.run_id}  # the run's own rows, as a fresh evaluation's
    assert "eval/start" in [f.path for f in client.list_artifacts(b.run_id, "eval")]
    assert b.evals["start"][KEY] == a.evals["start"][KEY]
    assert KEY in b.comparisons["final_minus_start"]
