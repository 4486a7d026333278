"""Bounded-staleness overlap of rollout and update (train.max_staleness): the schedule of aepo_core.staleness in a
real train flow, the rollouts of later steps running on the Prefect engine while an update trains, and a SIGKILL in
the middle of an overlapped rollout resumed to the same run."""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlflow
import pytest
from flow_processes import kill_group, log_tail
from slowdown import scaled
from test_train_flow import LEARNING, TINY, _local_weights, _responses, _run_id

from aepo_core.staleness import sampling_version
from infra.config_files import load_config
from infra.store import TrajectoryStore
from infra.tracking.client import TAG_FLOW_RUN, tracking_uri_for

pytestmark = pytest.mark.slow  # the heavy tier: every test trains a run

ROOT = Path(__file__).resolve().parents[2]
OVERLAP = ["train.max_staleness=1", "train.steps=4", "checkpoint.every=2", "checkpoint.keep=3",
           "data.max_questions=8", "train.batch_size=2", "eval.max_questions=1", "eval.n_samples=1",
           "eval.pass_k=1", "tracking.log_model=false", "tracking.system_metrics=false",
           "algorithm.dynamic_sampling=false"]


def _history(client: Any, run_id: str, key: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_overlapped_rollouts_follow_the_schedule_and_run_beside_the_update(
        prefect_harness: Any, tmp_path: Path) -> None:
    from prefect import get_client

    from flows.train import train

    out = train(config=load_config(TINY, OVERLAP), runs_dir=str(tmp_path))
    client = mlflow.tracking.MlflowClient(tracking_uri_for(tmp_path))
    run = client.get_run(out.run_id)
    assert run.data.params["numerics.rollout_correction"] == "tis"  # auto: a stale sampler is corrected
    # Steps 1, 2 from the start's weights, 3, 4 from checkpoint 2's: staleness 0, 1, 0, 1 (s = 1, every = 2).
    expected = [(j - 1) - sampling_version(j, 1, 2) for j in (1, 2, 3, 4)]
    assert expected == [0, 1, 0, 1]
    assert _history(client, out.run_id, "rollout/staleness_max") == expected
    assert _history(client, out.run_id, "rollout/version_spread") == [0.0] * 4
    assert "train/rollout_is_weight_mean" in run.data.metrics
    # Every stored segment carries the version that sampled it: the trajectories say what the metrics say.
    frame = TrajectoryStore(tmp_path).read_trajectories(out.run_id)
    versions = {int(s): sorted(set(g["weight_version"])) for s, g in frame.groupby("step")}
    assert versions == {1: ["0"], 2: ["0"], 3: ["2"], 4: ["2"]}
    assert out.final_eval  # the final evaluation ran on the engine, after the overlap drained

    flow_run_id = _flow_run_id(run)

    async def task_runs() -> dict[str, tuple[Any, Any]]:
        async with get_client() as prefect:
            runs = await prefect.read_task_runs()
        return {r.name: (r.start_time, r.end_time) for r in runs if str(r.flow_run_id) == flow_run_id}

    spans = asyncio.run(task_runs())
    # The rollouts of step 2 (and 4) ran on the flow's task runner while update 1 (and 3) trained: they began
    # before that update ended. On-policy they could not: the update needs them first.
    for ahead, beside in (("collect-step-2", "update-step-1"), ("collect-step-4", "update-step-3")):
        assert spans[ahead][0] < spans[beside][1], (ahead, spans[ahead], beside, spans[beside])
    assert spans["collect-step-3"][0] > spans["update-step-2"][1]  # checkpoint 2 drained the overlap


def _flow_run_id(run: Any) -> str:
    return str(run.data.tags[TAG_FLOW_RUN])


def _run(runs: Path, resume: bool, model_cache: Path, policy: Path, api_url: str, die_at: str = "") -> subprocess.Popen:
    runs.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, str(ROOT / "tests/flows/run_train.py"), str(TINY), str(runs),
            "resume" if resume else "fresh", *OVERLAP, "eval.max_questions=1", f"model.name={policy}", *LEARNING]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AEPO_MODEL_CACHE": str(model_cache), "OMP_NUM_THREADS": "1",
           "PREFECT_API_URL": api_url, **({"AEPO_TEST_DIE_AT": die_at} if die_at else {})}
    log = open(runs / ("resume.log" if resume else "run.log"), "w")
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.timeout(900)
def test_a_kill_during_an_overlapped_rollout_resumes_to_the_straight_run(
        tmp_path: Path, model_cache: Path, tool_user: Path, prefect_api_url: str) -> None:
    """Killed as update 3 begins: the rollouts of step 4 were submitted just before it (the step takes its own
    rollouts after submitting the due ones; the test above sees them run beside update 3) and are in flight,
    sampled by checkpoint 2's weights; step 3's are done and were never stored. The resumed run starts from
    checkpoint 2 and must sample steps 3 and 4 exactly as the straight run did, and end with the same weights."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run = functools.partial(_run, model_cache=model_cache, policy=tool_user, api_url=prefect_api_url)
    procs = [run(straight, False), run(killed, False, die_at="infra.run.trainer:Trainer.update:3")]
    try:
        assert procs[1].wait(timeout=scaled(600)) == -9, log_tail(killed)
        assert procs[0].wait(timeout=scaled(600)) == 0, log_tail(straight)
        procs.append(run(killed, True))
        assert procs[-1].wait(timeout=scaled(600)) == 0, log_tail(killed, "resume.log")
    finally:
        for proc in procs:
            kill_group(proc)
    ta = TrajectoryStore(straight).read_trajectories(_run_id(straight))
    tb = TrajectoryStore(killed).read_trajectories(_run_id(killed))
    assert all(_responses(ta, s) == _responses(tb, s) for s in (1, 2, 3, 4))
    assert sorted(set(tb["weight_version"])) == ["0", "2"]
    # Not vacuous: the policy learned something between the checkpoint and the end, and both runs agree on it.
    at_kill, a, b = _local_weights(straight, 2), _local_weights(straight, 4), _local_weights(killed, 4)
    assert any((a[k] != at_kill[k]).any() for k in a), "steps 3-4 did not change the weights"
    assert all((a[k] == b[k]).all() for k in a), "resumed parameters differ from the straight run"
