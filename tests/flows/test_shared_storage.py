"""Shared storage (S3 on a moto server): a run whose checkpoints, trajectories and MLflow artifacts live on S3 dies
after a checkpoint; a worker that shares no disk with it (a fresh runs dir; only the MLflow database stands in for
a tracking server) resumes it from S3 and ends with the very weights of an uninterrupted run. `aepo eval` reads an
S3 checkpoint and writes its per-question Parquet to S3; bad S3 locations exit 2 naming them."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file
from test_train_flow import TINY
from typer.testing import CliRunner

from aepo_core.interfaces import RewardResult
from flows.cli import app
from infra.config_files import load_config
from infra.store import TrajectoryStore
from infra.training.checkpoint_store import CheckpointStore

pytestmark = pytest.mark.slow  # the heavy tier (CI runs every tier)

STEPS = 2
FAST = ["rollout.k=2", "rollout.initial_rollouts=1", "rollout.max_response_tokens=32", "rollout.max_segment_tokens=16",
        "rollout.entropy_window=16", "algorithm.dynamic_sampling=false"]


def _overrides(endpoint: str, tracking_db: Path) -> list[str]:
    return [f"train.steps={STEPS}", "checkpoint.every=1", "checkpoint.keep=2", "data.max_questions=8",
            "train.batch_size=2", "eval.max_questions=1", "eval.n_samples=1", "eval.pass_k=1",
            "tracking.log_model=false", "tracking.system_metrics=false", f"tracking.tracking_uri=sqlite:///{tracking_db}",
            "tracking.artifact_location=s3://aepo/mlartifacts", "storage.checkpoints_uri=s3://aepo/ckpt",
            "storage.trajectories_uri=s3://aepo/traj", f"storage.s3_endpoint_url={endpoint}", *FAST]


def _reward_of_the_text(response_text: str, golds: Any, tool_names: Any = (), *, model_text: str | None = None
                        ) -> RewardResult:
    """A random tiny policy never answers: every reward would be equal, every advantage 0, and a resume that lost
    the optimizer moments would still look bit-identical. A reward that is a fixed function of the text gives real
    gradients (and the same reward to the same response, so the straight and the resumed run still agree)."""
    return RewardResult(zlib.crc32(response_text.encode()) % 1000 / 1000, "crc32 of the text")


def _weights(endpoint: str, cache: Path, checkpoints: str, step: int) -> dict[str, Any]:
    store = CheckpointStore(checkpoints, {"client_kwargs": {"endpoint_url": endpoint}}, cache_dir=cache)
    return load_file(str(store.fetch(step) / "model" / "model.safetensors"))


def _responses(store: TrajectoryStore, run_id: str, step: int) -> list[tuple[str, int, list[int]]]:
    df = store.read_trajectories(run_id=run_id, step=step)
    return sorted((r.question_id, r.leaf_id, list(r.response_tokens)) for r in df.itertuples())


@pytest.mark.timeout(900)
def test_resume_from_s3_on_a_worker_without_the_disk_is_bit_identical(
        prefect_harness: Any, s3_bucket: str, moto_s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.train import train
    from infra.trainer import Trainer

    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", moto_s3)
    monkeypatch.setattr("infra.runtime.make_reward_fn", lambda cfg: _reward_of_the_text)
    monkeypatch.setattr("flows.train._Evaluations.run", lambda self, label, step: None)  # not what is tested here
    cfg = load_config(TINY, _overrides(moto_s3, tmp_path / "tracking" / "mlflow.db"))
    straight = train(config=cfg, runs_dir=str(tmp_path / "straight"), run_name="straight")
    assert straight.checkpoint_dir == f"s3://aepo/ckpt/straight/{straight.run_id}" and straight.steps == STEPS

    # The second worker dies as the last step starts, after the previous step's checkpoint was committed.
    real_next_batch = Trainer.next_batch

    def dies_in_last_step(self: Trainer) -> Any:
        if self.step == STEPS - 1:
            raise RuntimeError("worker lost (injected)")
        return real_next_batch(self)

    with monkeypatch.context() as patched, pytest.raises(RuntimeError, match="worker lost"):
        patched.setattr(Trainer, "next_batch", dies_in_last_step)
        train(config=cfg, runs_dir=str(tmp_path / "first-worker"), run_name="resumed")
    by_name = CheckpointStore("s3://aepo/ckpt/resumed", {"client_kwargs": {"endpoint_url": moto_s3}})
    (killed_run,) = by_name.run_folders()  # checkpoints are keyed by MLflow run id under the run name
    assert by_name.child(killed_run).steps() == [STEPS - 1]

    # A third worker: a fresh runs dir, nothing of the others' disks.
    fresh = tmp_path / "second-worker"
    resumed = train(config=cfg, runs_dir=str(fresh), run_name="resumed", resume=True)
    assert resumed.steps == STEPS and resumed.run_id == killed_run
    assert resumed.checkpoint_dir == f"s3://aepo/ckpt/resumed/{killed_run}"
    assert not (fresh / "checkpoints").exists() and not (fresh / "trajectories").exists()
    assert (fresh / "cache" / "checkpoints" / "s3" / "aepo" / "ckpt" / "resumed" / killed_run /
            f"step-{STEPS - 1:06d}").is_dir()

    cache = tmp_path / "reader"
    before, a, b = (_weights(moto_s3, cache, straight.checkpoint_dir, STEPS - 1),
                    _weights(moto_s3, cache, straight.checkpoint_dir, STEPS),
                    _weights(moto_s3, cache, resumed.checkpoint_dir, STEPS))
    assert any((a[k] != before[k]).any() for k in a), "the last step did not change the weights"
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "resumed weights differ from straight"
    # The sampler's RNG came back too: the resumed step drew the very same responses (trajectories on S3).
    store = TrajectoryStore("s3://aepo/traj", {"client_kwargs": {"endpoint_url": moto_s3}})
    assert store.steps(resumed.run_id) == list(range(1, STEPS + 1))
    assert _responses(store, resumed.run_id, STEPS) == _responses(store, straight.run_id, STEPS)

    # aepo eval of the run name's S3 folder (its one run's newest checkpoint), the Parquet to S3, on yet another
    # runs dir.
    evals = tmp_path / "eval-worker"
    result = CliRunner().invoke(app, ["eval", "--checkpoint", "s3://aepo/ckpt/resumed", "--runs-dir", str(evals),
                                      "--set", f"storage.s3_endpoint_url={moto_s3}",
                                      "--set", "storage.evaluations_uri=s3://aepo/eval", "--run-name", "ev"],
                                env={"COLUMNS": "250"}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    fs = store.fs
    table = pq.read_table("aepo/eval/ev/synthetic_test.parquet", filesystem=fs)
    assert table.num_rows == 1 and table["checkpoint"][0].as_py() == f"{resumed.checkpoint_dir}/step-{STEPS:06d}"
    assert table["checkpoint_step"][0].as_py() == STEPS


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
