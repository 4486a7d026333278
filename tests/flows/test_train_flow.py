"""The train flow on the tiny config: MLflow, Parquet, checkpoints, Prefect state, retries, kill and resume."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlflow
import pyarrow.dataset as pads
import pytest
from flow_processes import kill_group, log_tail
from safetensors.torch import load_file
from slowdown import scaled

from infra.config_files import load_config
from infra.numerics import auto_dtype, device_facts
from infra.store import NODE_SCHEMA, TRAJECTORY_SCHEMA, TrajectoryStore
from infra.tracking.client import tracking_uri_for
from infra.training.checkpoint_store import CheckpointStore

pytestmark = pytest.mark.slow  # the heavy tier: every test trains a run

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
REQUIRED = ["rollout/reward_mean", "rollout/accuracy", "rollout/global_samples", "rollout/branch_samples",
            "rollout/max_branches_per_path", "rollout/tool_calls_mean", "rollout/tool_error_rate",
            "rollout/h_root_mean", "train/loss", "train/grad_norm", "train/entropy_mean", "train/clip_frac_high",
            "train/tokens_per_s"]  # train/clip_frac_high_entropy: only under algorithm.clip_gate=high_entropy


@pytest.fixture(scope="module")
def tiny_run(prefect_harness, tmp_path_factory):
    from flows.train import train

    runs = tmp_path_factory.mktemp("runs")
    out = train(config=load_config(TINY, ["train.steps=2", "tracking.log_model=false"]),  # (test_cli tests it)
                runs_dir=str(runs))
    return out, runs


def test_mlflow_run_has_params_metrics_and_artifacts(tiny_run):
    from mlflow.tracking import MlflowClient

    out, runs = tiny_run
    assert out.tracking_uri == f"sqlite:///{runs}/mlflow.db"
    client = MlflowClient(out.tracking_uri)
    run = client.get_run(out.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["rollout.k"] == "4" and run.data.params["algorithm.loss"] == "aepo"
    assert run.data.tags["algorithm"] == "aepo" and run.data.tags["mode"] == "aepo"
    # The numerics it computed in and the machine they were chosen for (tiny.yaml asks for float32 explicitly).
    facts = device_facts("cpu")
    assert run.data.params["numerics.compute_dtype"] == "float32"
    assert run.data.params["numerics.generation_dtype"] == "same"
    assert run.data.params["numerics.vllm_dtype"] == auto_dtype(facts)  # tiny.yaml leaves it auto
    assert run.data.tags["system.cpu"] == facts.name and run.data.tags["system.capability"] == facts.capability
    assert run.data.tags["system.native_bf16"] == str(facts.native_bf16).lower()
    for name in REQUIRED:
        steps = [m.step for m in client.get_metric_history(out.run_id, name)]
        assert steps == [1, 2], name
    # The common budget: each step's spend and the running total (issue 27 §4).
    def values(name: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(out.run_id, name), key=lambda m: m.step)]

    generated = values("cost/generated_tokens")
    assert generated == values("rollout/tokens_generated") and all(g > 0 for g in generated)  # one round per step
    for name in ("generated_tokens", "prompt_tokens", "tool_calls", "rollout_cpu_s", "update_cpu_s", "cpu_s"):
        step, total = values(f"cost/{name}"), values(f"cost/total_{name}")
        assert len(step) == 2 and total == pytest.approx([step[0], step[0] + step[1]]), name
    assert values("cost/prompt_tokens")[0] > generated[0] and min(values("cost/update_cpu_s")) > 0.1
    assert not client.get_metric_history(out.run_id, "cost/gpu_s")  # CPU only
    # Wall seconds by phase (issue 27 §2): the step's two phases within its wall, the scoring pass within the update
    rollout_s, update_s, wall_s = values("time/rollout_s"), values("time/update_s"), values("step/wall_s")
    assert len(rollout_s) == len(update_s) == 2 and min(rollout_s + update_s) > 0
    assert all(r + u <= w for r, u, w in zip(rollout_s, update_s, wall_s, strict=True))
    assert all(sp <= u for sp, u in zip(values("train/scoring_pass_s"), update_s, strict=True))
    final_eval = client.get_metric_history(out.run_id, "time/eval_final_s")
    assert [m.step for m in final_eval] == [2] and final_eval[0].value > 0
    tool_calls = [m.value for m in client.get_metric_history(out.run_id, "rollout/tool_calls_mean")]
    delta = client.get_metric_history(out.run_id, "rollout/delta_h_mean")
    # ΔH only exists at tool steps: logged whenever a step had any. The random tiny policy rarely calls tools, so
    # this often holds as 0 == 0: test_train_traces checks it on a policy that does.
    assert len(delta) == sum(1 for v in tool_calls if v > 0)
    assert client.get_metric_history(out.run_id, "eval/synthetic_test/pass_at_1")
    artifacts = {a.path for a in client.list_artifacts(out.run_id)}
    assert "config.yaml" in artifacts
    plots = {a.path for a in client.list_artifacts(out.run_id, "plots")}
    assert "plots/curves.png" in plots
    trees = {a.path for a in client.list_artifacts(out.run_id, "plots/rollout_tree")}
    assert trees == {"plots/rollout_tree/step-000001.png", "plots/rollout_tree/step-000002.png"}  # every step's
    samples = {a.path for a in client.list_artifacts(out.run_id, "trajectories")}
    assert {"trajectories/step_000001.json", "trajectories/step_000002.json"} <= samples
    assert Path(runs, "mlartifacts").is_dir() and not Path("mlruns").exists()


def test_parquet_store_has_both_tables_per_step(tiny_run):
    out, _runs = tiny_run
    root = Path(out.trajectories)
    for table, schema in (("trajectories", TRAJECTORY_SCHEMA), ("nodes", NODE_SCHEMA)):
        ds = pads.dataset(root / table, format="parquet", partitioning="hive")
        t = ds.to_table()
        assert sorted(set(t.column("step").to_pylist())) == [1, 2]
        for field in schema:
            assert field.name in t.schema.names, (table, field.name)
        for step in (1, 2):
            assert (root / table / out.run_id / f"step-{step:06d}.parquet").is_file()
    traj = pads.dataset(root / "trajectories", format="parquet", partitioning="hive").to_table().to_pandas()
    assert len(traj) == 2 * 2 * 4  # steps × questions × k
    assert set(traj["status"]) <= {"answered", "truncated", "tool_limit", "tool_error"}  # never engine_error


def test_trajectories_carry_their_questions_and_eval_writes_aepo_evals_parquet(tiny_run):
    """The stored rows hold question text, golds and dataset; the final evaluation wrote the per-question Parquet
    that `aepo eval` writes (same schema), under <runs>/eval/<run name>/final/, and logged it to MLflow."""
    import pandas as pd
    import pyarrow.parquet as pq
    from mlflow.tracking import MlflowClient

    from infra.run.evaluation import QUESTION_SCHEMA

    out, runs = tiny_run
    traj = pd.read_parquet(Path(out.trajectories) / "trajectories")
    assert traj["question"].str.len().gt(0).all() and traj["dataset"].notna().all()
    assert traj["golds"].map(len).gt(0).all()
    assert traj.groupby("question_id")["question"].nunique().eq(1).all()
    path = Path(runs) / "eval" / out.run_name / "final" / "synthetic_test.parquet"
    table = pq.read_table(path)
    assert table.schema.equals(QUESTION_SCHEMA, check_metadata=False) and table.num_rows > 0
    rows = table.to_pandas()
    assert set(rows["eval_run_id"]) == {out.run_id} and set(rows["checkpoint_step"]) == {2}
    assert rows["checkpoint"].isna().all() and rows["question"].str.len().gt(0).all()
    logged = {a.path for a in MlflowClient(out.tracking_uri).list_artifacts(out.run_id, "eval/final")}
    assert "eval/final/synthetic_test.parquet" in logged


def test_checkpoints_exist(tiny_run):
    out, runs = tiny_run
    assert Path(out.checkpoint_dir) == runs / "checkpoints" / "tiny" / out.run_id  # keyed by run id, not name
    ckpts = sorted(p.name for p in Path(out.checkpoint_dir).iterdir() if p.name.startswith("step-"))
    assert ckpts == ["step-000001", "step-000002"]
    assert (Path(out.checkpoint_dir) / "step-000002" / "model" / "model.safetensors").exists()


def test_prefect_api_shows_the_completed_runs(tiny_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    out, _ = tiny_run

    # Task runs are named with their step (the evaluation with its stage), so the UI's list reads as the run went.
    expected = {f"{verb}-step-{i}" for verb in ("rollout", "score", "update", "store", "checkpoint") for i in (1, 2)}

    # The train flow run of the fixture, by the id its MLflow run records (the session's API holds every test's
    # flow runs, more than one page of them, in no set order).
    flow_run_id = mlflow.tracking.MlflowClient(out.tracking_uri).get_run(out.run_id).data.tags["prefect_flow_run_id"]

    async def read():
        async with get_client() as client:
            flow = await client.read_flow_run(flow_run_id)
            mine = [flow] if flow.state and flow.state.is_completed() and flow.parameters.get(
                "runs_dir") == out.runs_dir else []
            # The server records task runs from their events, asynchronously: wait for them, bounded.
            deadline = time.monotonic() + scaled(60)
            while True:
                tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [mine[0].id]}))
                settled = expected <= {t.name for t in tasks} and all(t.state.is_completed() for t in tasks)
                if settled or time.monotonic() > deadline:
                    return mine, tasks
                await asyncio.sleep(0.5)

    flows, tasks = asyncio.run(read())
    assert len(flows) == 1
    names = {t.name for t in tasks}
    assert expected <= names, sorted(names)
    assert {"evaluate-final", "prepare-data"} <= names  # (issue 28: no more prepare_data-<random suffix>)
    assert all(t.state.is_completed() for t in tasks)


def test_prefect_and_mlflow_runs_link_each_other(tiny_run):
    """The flow run bears the MLflow run's name; the MLflow run names the flow run, its source, a description and
    its datasets; the Prefect summary artifact links to the MLflow run's page."""
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
    )

    out, runs = tiny_run
    run = MlflowClient(out.tracking_uri).get_run(out.run_id)
    tags = run.data.tags
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(tags["prefect_flow_run_id"])
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))
        task_names = {t.name for t in client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[flow_run.id])))}
    # Every task run named for what it did, none with Prefect's random suffix (prepare_data-3f2, …).
    assert {"prepare-data", "rollout-step-1", "write-eval-results-final-synthetic_test"} <= task_names, task_names
    assert not [n for n in task_names if re.fullmatch(r".+-[0-9a-f]{3}", n)], task_names
    assert flow_run.name == run.info.run_name == out.run_name == "tiny"
    assert tags["mlflow.source.name"] == "flows/train.py:train"
    # A URL even under a Prefect API without a UI (the test harness's): the UI that serves that database.
    assert tags["prefect_flow_run_url"].startswith("http") and tags["prefect_flow_run_url"].endswith(
        f"/runs/flow-run/{flow_run.id}")
    assert "aepo loss" in tags["mlflow.note.content"] and "2 RL steps" in tags["mlflow.note.content"]
    inputs = {(d.dataset.name, next(t.value for t in d.tags)): d.dataset for d in run.inputs.dataset_inputs}
    assert set(inputs) == {("synthetic", "training"), ("synthetic_test", "evaluation")}
    train_ds = inputs[("synthetic", "training")]
    assert json.loads(train_ds.profile)["num_rows"] > 0 and len(train_ds.digest) == 16
    summary = [a for a in arts if a.type == "markdown"]
    assert len(summary) == 1 and summary[0].key == "train-tiny"  # a key: listed on Prefect's Artifacts page
    assert {a.key for a in arts if a.type == "progress"} == {"progress-tiny"}
    exp = run.info.experiment_id  # the run page in MLflow's classic layout (3.17 opens GenAI's otherwise)
    assert out.run_url == f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{out.run_id}?workflowType=machine_learning"
    assert f"[tiny]({out.run_url})" in summary[0].data and f"aepo ui --runs-dir {runs}" in summary[0].data


def test_transient_rollout_failure_is_retried(prefect_harness, tmp_path, monkeypatch):
    from flows.train import train
    from infra.run.runtime import PolicyRuntime

    original = PolicyRuntime.sample
    calls = {"n": 0}

    def flaky(self, rows, rollout, seed, sampling=None, *, engine=None):
        if rollout is self.cfg.rollout:  # the training rollout, not an evaluation's
            calls["n"] += 1
            if calls["n"] == 1:
                raise ConnectionError("injected transient failure")
        return original(self, rows, rollout, seed, sampling, engine=engine)

    monkeypatch.setattr(PolicyRuntime, "sample", flaky)
    out = train(config=load_config(TINY, ["train.steps=1", "eval.every=0", "eval.max_questions=1",
                                          "tracking.log_model=false"]), runs_dir=str(tmp_path))
    assert out.steps == 1 and calls["n"] == 2


# A random tiny policy never stops or answers: every reward is the same, every advantage 0, and a resume that
# lost the optimizer state would still look bit-identical. The session's tool user (conftest.TOOL_USER_SFT: a
# memorizing cold-start SFT on 8 oracle transcripts) answers some single-hop questions right in 200 tokens and ends
# other responses at other lengths, which DAPO's soft overlong penalty turns into different rewards: real gradients
# in the first steps, and AdamW moments that keep moving every weight afterwards.
LEARNING = ["rollout.max_response_tokens=200", "algorithm.overlong_buffer=160"]


def _run(runs: Path, resume: bool, steps: int, model_cache: Path, policy: Path, api_url: str,
         storage: tuple[str, ...] = ()) -> subprocess.Popen:
    runs.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, str(ROOT / "tests/flows/run_train.py"), str(TINY), str(runs),
            "resume" if resume else "fresh", f"train.steps={steps}", "checkpoint.every=1", "checkpoint.keep=3",
            "data.max_questions=8", "train.batch_size=2", "eval.max_questions=1", "tracking.log_model=false",
            f"model.name={policy}", *LEARNING, *storage]
    # One thread each: the straight and the killed run share the CPU, and oversubscribed torch crawls. Their flow
    # runs go to the session's Prefect API (a temporary server of their own costs ~17 s per process; the CLI tests
    # test that server's lifecycle): the SIGKILL leaves the killed run's flow run Running there, as a lost worker
    # machine would on a real server, and the resume starts a new flow run.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AEPO_MODEL_CACHE": str(model_cache), "OMP_NUM_THREADS": "1",
           "PREFECT_API_URL": api_url}
    log = open(runs / ("resume.log" if resume else "run.log"), "w")
    # Own process group: the SIGKILL takes the flow process and anything it started down at once.
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _run_id(runs: Path) -> str:
    return str(json.loads((runs / "result.json").read_text())["run_id"])


def _local_weights(runs: Path, step: int) -> dict[str, Any]:
    """A run's step checkpoint on its runs dir: ``checkpoints/<run name>/<MLflow run id>/step-…``."""
    return load_file(str(runs / "checkpoints" / "tiny" / _run_id(runs) / f"step-{step:06d}" / "model" /
                         "model.safetensors"))


def _questions_by_step(df: Any) -> dict[int, list[str]]:
    return {int(s): sorted(set(g["question_id"])) for s, g in df.groupby("step")}


def _responses(df: Any, step: int) -> list[tuple[str, str, list[int]]]:
    rows = df[df["step"] == step]
    return sorted((r.question_id, r.leaf_id, list(r.response_tokens)) for r in rows.itertuples())


def _history(runs: Path, name: str, tracking_uri: str | None = None) -> list[tuple[int, float]]:
    client = mlflow.tracking.MlflowClient(tracking_uri or tracking_uri_for(runs))
    return sorted((m.step, m.value) for m in client.get_metric_history(_run_id(runs), name))


def _grad_norms(runs: Path) -> list[float]:
    return [value for _step, value in _history(runs, "train/grad_norm")]


@pytest.mark.slow
@pytest.mark.timeout(900)  # three flow processes; ~75 s on an idle 2-core box
def test_kill_after_checkpoint_and_resume_on_another_worker_from_s3_is_bit_identical(
        tmp_path, model_cache, tool_user, prefect_api_url, s3_bucket, moto_s3, monkeypatch):
    """6 steps straight (on its own disk) vs a run whose checkpoints, trajectories and MLflow artifacts live on S3
    (moto), SIGKILLed right after the epoch-boundary checkpoint (step 4 of 4 per epoch) and resumed by a worker
    that shares no disk with it: a fresh runs dir; only the MLflow database stands in for a tracking server."""
    straight, killed, resumed = tmp_path / "straight", tmp_path / "killed", tmp_path / "resumed"
    (tmp_path / "tracking").mkdir()
    tracking_uri = f"sqlite:///{tmp_path / 'tracking' / 'mlflow.db'}"  # what the killed and the resumed run share
    on_s3 = (f"tracking.tracking_uri={tracking_uri}",
             f"tracking.artifact_location={s3_bucket}/mlartifacts", f"storage.checkpoints_uri={s3_bucket}/ckpt",
             f"storage.trajectories_uri={s3_bucket}/traj", f"storage.s3_endpoint_url={moto_s3}")
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", moto_s3)  # (the children's MLflow artifacts; as in MLflow's docs)
    s3 = {"client_kwargs": {"endpoint_url": moto_s3}}
    by_name = CheckpointStore(f"{s3_bucket}/ckpt/tiny", s3)  # checkpoints are keyed by MLflow run id under the name
    run = functools.partial(_run, model_cache=model_cache, policy=tool_user, api_url=prefect_api_url)
    procs = [run(straight, False, 6), run(killed, False, 6, storage=on_s3)]
    p_straight, p_killed = procs
    try:
        deadline = time.time() + scaled(600)
        while not any(4 in by_name.child(r).steps() for r in by_name.run_folders()):
            assert p_killed.poll() is None, log_tail(killed)
            assert time.time() < deadline
            time.sleep(0.2)
        time.sleep(random.Random(0).uniform(0.0, 1.5))  # a random point after the checkpoint
        kill_group(p_killed)
        assert p_straight.wait(timeout=scaled(600)) == 0, log_tail(straight)
        procs.append(run(resumed, True, 6, storage=on_s3))
        assert procs[-1].wait(timeout=scaled(600)) == 0, log_tail(resumed, "resume.log")
    finally:
        for proc in procs:  # whatever happened, no flow process or Prefect server outlives the test
            kill_group(proc)

    # The same MLflow run went on, from S3: nothing of it on the fresh worker's disk but its checkpoint cache.
    (run_id,) = by_name.run_folders()
    assert _run_id(resumed) == run_id and json.loads((resumed / "result.json").read_text())["steps"] == 6
    assert mlflow.tracking.MlflowClient(tracking_uri).get_run(run_id).info.status == "FINISHED"
    assert not (resumed / "checkpoints").exists() and not (resumed / "trajectories").exists()
    assert not (resumed / "nodes").exists()
    assert (resumed / "cache" / "checkpoints" / "s3" / "aepo" / "ckpt" / "tiny" / run_id / "step-000004").is_dir()

    # The comparison is not vacuous: rewards differed (some gradient), and the weights still moved after the kill.
    assert any(g > 0 for g in _grad_norms(straight)), _grad_norms(straight)
    at_kill, a = _local_weights(straight, 4), _local_weights(straight, 6)
    b = load_file(str(by_name.child(run_id).fetch(6) / "model" / "model.safetensors"))
    assert any((a[k] != at_kill[k]).any() for k in a), "steps 5-6 did not change the weights"
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), "resumed parameters differ from the straight run"
    # Data order: every step saw the same questions, none replayed, none skipped; one Parquet part per step.
    store = TrajectoryStore(f"{s3_bucket}/traj", s3)
    assert store.steps(run_id) == [1, 2, 3, 4, 5, 6]
    ta, tb = TrajectoryStore(straight).read_trajectories(_run_id(straight)), \
        store.read_trajectories(run_id)
    qa, qb = _questions_by_step(ta), _questions_by_step(tb)
    assert qa == qb and sorted(qa) == [1, 2, 3, 4, 5, 6]
    # The sampler's RNG was restored too: the resumed steps drew the very same responses.
    assert all(_responses(ta, s) == _responses(tb, s) for s in (5, 6))
    first_epoch = [q for s in (1, 2, 3, 4) for q in qa[s]]
    assert len(first_epoch) == len(set(first_epoch)) == 8
    # The run's spend went on from the checkpoint's: the same running totals as the straight run, step by step.
    for name in ("cost/total_generated_tokens", "cost/total_prompt_tokens", "cost/total_tool_calls"):
        assert _history(resumed, name, tracking_uri) == _history(straight, name), name
    assert _history(straight, "cost/total_tool_calls")[-1][1] > 0  # (the tool user called tools)
    # ... and answered some of its questions right: the resumed steps' accuracy is the straight run's, not 0 = 0
    accuracy = _history(straight, "rollout/accuracy")
    assert max(v for _, v in accuracy) > 0, accuracy
    assert _history(resumed, "rollout/accuracy", tracking_uri) == accuracy
