"""Shared storage (S3 on a moto server): a run whose checkpoints, trajectories and MLflow artifacts live on S3 is
evaluated by `aepo eval` on a worker that shares no disk with it, its per-question Parquet written to S3; bad S3
locations exit 2 naming them. (The kill-and-resume from S3 on a fresh runs dir is test_train_flow's.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from test_train_flow import TINY
from typer.testing import CliRunner

from flows.cli import app
from infra.config_files import load_config
from infra.store import TrajectoryStore

pytestmark = pytest.mark.slow  # the heavy tier (CI runs every tier)

FAST = ["rollout.k=2", "rollout.initial_rollouts=1", "rollout.max_response_tokens=32", "rollout.max_segment_tokens=16",
        "rollout.entropy_window=16", "algorithm.dynamic_sampling=false"]


def test_aepo_eval_of_an_s3_checkpoint_on_another_worker_writes_its_parquet_to_s3(
        prefect_harness: Any, s3_bucket: str, moto_s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.train import train

    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", moto_s3)
    monkeypatch.setattr("flows.train._Evaluations.run", lambda self, label, step: None)  # not what is tested here
    cfg = load_config(TINY, [
        "train.steps=1", "checkpoint.every=1", "data.max_questions=2", "train.batch_size=2", "eval.max_questions=1",
        "eval.n_samples=1", "eval.pass_k=1", "tracking.log_model=false", "tracking.system_metrics=false",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'tracking' / 'mlflow.db'}",
        "tracking.artifact_location=s3://aepo/mlartifacts", "storage.checkpoints_uri=s3://aepo/ckpt",
        "storage.trajectories_uri=s3://aepo/traj", f"storage.s3_endpoint_url={moto_s3}", *FAST])
    trained = train(config=cfg, runs_dir=str(tmp_path / "trainer"), run_name="trained")
    assert trained.checkpoint_dir == f"s3://aepo/ckpt/trained/{trained.run_id}" and trained.steps == 1
    store = TrajectoryStore("s3://aepo/traj", {"client_kwargs": {"endpoint_url": moto_s3}})
    assert store.steps(trained.run_id) == [1]

    # aepo eval of the run name's S3 folder (its one run's newest checkpoint), the Parquet to S3, on another runs dir
    evals = tmp_path / "eval-worker"
    result = CliRunner().invoke(app, ["eval", "--checkpoint", "s3://aepo/ckpt/trained", "--runs-dir", str(evals),
                                      "--set", f"storage.s3_endpoint_url={moto_s3}",
                                      "--set", "storage.evaluations_uri=s3://aepo/eval", "--run-name", "ev"],
                                env={"COLUMNS": "250"}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    table = pq.read_table("aepo/eval/ev/synthetic_test.parquet", filesystem=store.fs)
    assert table.num_rows == 1 and table["checkpoint"][0].as_py() == f"{trained.checkpoint_dir}/step-000001"
    assert table["checkpoint_step"][0].as_py() == 1


def test_bad_s3_locations_exit_2_naming_them(s3_bucket: str, moto_s3: str, tmp_path: Path) -> None:
    def train(*sets: str) -> Any:
        args = ["train", "-c", str(TINY), "--runs-dir", str(tmp_path / "runs"), "--resume"]
        for item in (f"storage.s3_endpoint_url={moto_s3}", *sets):
            args += ["--set", item]
        return CliRunner().invoke(app, args, env={"COLUMNS": "250"}, catch_exceptions=False)

    empty = train("storage.checkpoints_uri=s3://aepo/nothing-here")  # no run of that name: as for a local root
    assert empty.exit_code == 2 and "nothing to resume: no MLflow run named 'tiny'" in empty.stderr
    assert "Traceback" not in empty.output
    missing = train("storage.checkpoints_uri=s3://no-such-bucket/ckpt")
    assert missing.exit_code == 2 and "s3://no-such-bucket/ckpt/tiny" in missing.stderr
    bad = train("storage.checkpoints_uri=s3://")
    assert bad.exit_code == 2 and "names no bucket" in bad.stderr
    no_ckpt = CliRunner().invoke(app, ["eval", "--checkpoint", "s3://aepo/ckpt/none", "--runs-dir",
                                       str(tmp_path / "runs"), "--set", f"storage.s3_endpoint_url={moto_s3}"],
                                 env={"COLUMNS": "250"}, catch_exceptions=False)
    assert no_ckpt.exit_code == 2 and "s3://aepo/ckpt/none holds no complete checkpoint" in no_ckpt.stderr
