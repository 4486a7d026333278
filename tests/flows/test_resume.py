"""``--resume`` never silently starts over: a run killed before its first checkpoint continues in the same MLflow run
from step 0; a step's metrics are logged once however often it was started; runs that share a name keep their own
checkpoints (keyed by MLflow run id) and a resume by name finds the right one; nothing to resume is a clear exit 2.

A kill is emulated in process (as in test_shared_storage): a patched step raises, and the tracker is kept from
closing the MLflow run, which a SIGKILL leaves RUNNING."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from test_train_flow import TINY
from typer.testing import CliRunner

from flows.cli import app
from infra.config_files import load_config
from infra.store import TrajectoryStore
from infra.tracking.client import tracking_uri_for
from infra.tracking.run import Tracker

pytestmark = pytest.mark.slow  # the heavy tier (CI runs every tier)

FAST = ["checkpoint.every=1", "checkpoint.keep=2", "data.max_questions=8", "train.batch_size=2",
        "eval.max_questions=1", "eval.n_samples=1", "eval.pass_k=1", "tracking.log_model=false",
        "tracking.system_metrics=false", "rollout.k=2", "rollout.initial_rollouts=1",
        "rollout.max_response_tokens=32", "rollout.max_segment_tokens=16", "rollout.entropy_window=16",
        "algorithm.dynamic_sampling=false"]


def _cfg(*extra: str) -> Any:
    return load_config(TINY, [*FAST, *extra])


@pytest.fixture
def no_evals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("flows.train._Evaluations.run", lambda self, label, step: None)  # not what is tested here


@contextmanager
def killed_in_checkpoint(monkeypatch: pytest.MonkeyPatch, at_step: int) -> Iterator[None]:
    """The process dies while the checkpoint of ``at_step`` is being written (that step's trajectories and metrics
    are already out): earlier checkpoints go through, the MLflow run is left RUNNING like after a SIGKILL."""
    import flows.train

    real = flows.train.checkpoint

    def dies(trainer: Any) -> str:
        if trainer.step == at_step:
            raise RuntimeError("killed (injected)")
        return real(trainer)

    with monkeypatch.context() as patched, pytest.raises(RuntimeError, match="killed"):
        patched.setattr(flows.train, "checkpoint", dies)
        patched.setattr(Tracker, "__exit__", lambda self, *exc: None)
        yield


def _runs(runs: Path) -> list[Any]:
    client = MlflowClient(tracking_uri_for(runs))
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def _steps_logged(runs: Path, run_id: str) -> dict[str, list[int]]:
    client = MlflowClient(tracking_uri_for(runs))
    keys = client.get_run(run_id).data.metrics
    return {k: sorted(m.step for m in client.get_metric_history(run_id, k)) for k in keys}


def test_resume_before_the_first_checkpoint_continues_the_same_run_from_step_0(
        prefect_harness: Any, no_evals: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.train import train

    with killed_in_checkpoint(monkeypatch, at_step=1):
        train(config=_cfg("train.steps=2"), runs_dir=str(tmp_path))
    (killed,) = _runs(tmp_path)
    assert killed.info.status == "RUNNING"

    out = train(config=_cfg("train.steps=2"), runs_dir=str(tmp_path), resume=True)
    assert out.run_id == killed.info.run_id and out.steps == 2
    (run,) = _runs(tmp_path)
    assert run.info.status == "FINISHED"
    store = TrajectoryStore(tmp_path)
    assert store.run_ids() == [out.run_id] and store.steps(out.run_id) == [1, 2]
    steps = _steps_logged(tmp_path, out.run_id)
    assert steps["train/loss"] == [1, 2]
    assert all(len(s) == len(set(s)) for s in steps.values()), steps


def test_a_step_killed_after_its_metrics_logs_them_once(
        prefect_harness: Any, no_evals: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.train import train

    with killed_in_checkpoint(monkeypatch, at_step=2):
        train(config=_cfg("train.steps=2"), runs_dir=str(tmp_path))
    out = train(config=_cfg("train.steps=2"), runs_dir=str(tmp_path), resume=True)
    (run,) = _runs(tmp_path)
    assert run.info.run_id == out.run_id and out.steps == 2
    steps = _steps_logged(tmp_path, out.run_id)
    assert steps["train/loss"] == [1, 2]
    twice = {k: s for k, s in steps.items() if len(s) != len(set(s))}
    assert not twice, twice


def test_runs_of_one_name_keep_their_own_checkpoints_and_resume_finds_its_own(
        prefect_harness: Any, no_evals: None, tmp_path: Path) -> None:
    from flows.train import train

    first = train(config=_cfg("train.steps=1"), runs_dir=str(tmp_path))
    other = train(config=_cfg("train.steps=1", "algorithm.loss=ppo_clip"), runs_dir=str(tmp_path))
    assert first.run_name == other.run_name == "tiny" and first.run_id != other.run_id
    assert first.checkpoint_dir != other.checkpoint_dir
    for result in (first, other):
        state = json.loads((Path(result.checkpoint_dir) / "step-000001" / "trainer_state.json").read_text())
        assert state["run_id"] == result.run_id

    # The same config as the first run, with more steps: resuming by name continues the first run, not the
    # newer run of the same name whose algorithm differs.
    resumed = train(config=_cfg("train.steps=2"), runs_dir=str(tmp_path), resume=True)
    assert resumed.run_id == first.run_id and resumed.steps == 2
    assert resumed.checkpoint_dir == first.checkpoint_dir
    assert (Path(other.checkpoint_dir) / "step-000001" / "manifest.json").is_file()


def test_a_resumed_run_computes_in_the_numerics_it_started_with_and_does_not_probe(
        prefect_harness: Any, no_evals: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` chose bf16 at the start (the probe read 2.3× float32 on idle cores); the run is killed; by the resume
    the machine is busy (a probe would read 0.5×: float32) and its cached decision is gone. The resumed run reads the
    numerics it started with from its own record: bf16, no probe."""
    from flows.train import train
    from infra.numerics import device_facts

    readings = {"speedup": 2.3, "probes": 0}

    def probe(*args: object, **kwargs: object) -> float:
        readings["probes"] += 1
        return readings["speedup"]

    monkeypatch.setenv("AEPO_NUMERICS_CACHE", str(tmp_path / "numerics.json"))
    monkeypatch.setattr("infra.numerics._cpu_native_bf16", lambda: True)
    monkeypatch.setattr("infra.numerics.bf16_speedup", probe)
    auto = ("train.steps=2", "model.compute_dtype=auto", "model.generation_dtype=auto")
    device_facts.cache_clear()
    try:
        with killed_in_checkpoint(monkeypatch, at_step=2):
            train(config=_cfg(*auto), runs_dir=str(tmp_path))
        (killed,) = _runs(tmp_path)
        assert killed.data.params["numerics.compute_dtype"] == "bfloat16"
        assert killed.data.tags["system.bf16_speedup"] == "2.30" and readings["probes"] > 0

        readings.update(speedup=0.5, probes=0)  # loaded now
        (tmp_path / "numerics.json").unlink(missing_ok=True)
        device_facts.cache_clear()  # a new process
        out = train(config=_cfg(*auto), runs_dir=str(tmp_path), resume=True)
    finally:
        device_facts.cache_clear()
    assert out.run_id == killed.info.run_id and out.steps == 2
    assert readings["probes"] == 0
    (run,) = _runs(tmp_path)
    assert run.data.tags["system.bf16_speedup"] == "2.30"
    assert run.data.tags["system.numerics_source"] == f"run {out.run_id}"
    assert "resume_changed_params" not in run.data.tags


def test_resume_with_nothing_to_resume_exits_2(prefect_harness: Any, tmp_path: Path) -> None:
    import flows.train  # noqa: F401  (Prefect's console handler on pytest's stream, as in test_cli)

    args = ["train", "-c", str(TINY), "--runs-dir", str(tmp_path / "runs"), "--resume"]
    for item in (*FAST, "train.steps=1"):
        args += ["--set", item]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "250"}, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "nothing to resume" in result.stderr and "'tiny'" in result.stderr
    assert "Traceback" not in result.output
    assert not _runs(tmp_path / "runs") if (tmp_path / "runs" / "mlflow.db").exists() else True
