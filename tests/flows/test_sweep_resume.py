"""A sweep stopped at any moment resumes with ``--resume`` (issue 27 §3): the finished cell is skipped, the cell in
progress resumes from its last checkpoint in its own MLflow run, the parent run is the same, and the final table
equals an uninterrupted sweep's.

Not vacuous: the sweep is SIGKILLed after a checkpoint of its second cell and before that cell ends (checked: its
MLflow run is left RUNNING short of its last step), and the cells learn (the session's tool user with DAPO's overlong
penalty, as in the train flow's kill-and-resume test), so a cell re-run from scratch with other seeds, or resumed
without its optimizer state or spend, would give another table."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from flow_processes import kill_group, log_tail
from slowdown import scaled

from infra.tracking.client import tracking_uri_for
from infra.training.checkpoint_store import CheckpointStore

REPO = Path(__file__).resolve().parents[2]
TINY_SWEEP = REPO / "configs" / "sweeps" / "tiny.yaml"
STEPS = 3
KILLED_CELL = "tiny-sweep-grpo-s0"  # the second cell: the first has finished by then
SAME = ["cell", "seed", "status", "dataset", "pass@1", "pass@k", "tool_calls_per_question", "answered_rate",
        "reward_mean", "branch_samples", "generated_tokens", "tool_calls"]  # all but run ids and CPU seconds


def _sweep(runs: Path, policy: Path, model_cache: Path, api_url: str, resume: bool = False) -> subprocess.Popen:
    runs.mkdir(parents=True, exist_ok=True)
    sets = [f"train.steps={STEPS}", "checkpoint.every=1", f"model.name={policy}", "data.max_questions=8",
            "train.batch_size=2", "rollout.max_response_tokens=160", "rollout.max_segment_tokens=40",
            "algorithm.overlong_buffer=120", "eval.max_questions=2"]
    args = [sys.executable, "-m", "flows.cli", "sweep", "-c", str(TINY_SWEEP), "--runs-dir", str(runs),
            *(["--resume"] if resume else []),
            *(a for s in sets for a in ("--set", s))]
    env = {**os.environ, "PYTHONPATH": str(REPO), "AEPO_MODEL_CACHE": str(model_cache), "OMP_NUM_THREADS": "1",
           "PREFECT_API_URL": api_url}
    log = open(runs / ("resume.log" if resume else "run.log"), "w")
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _runs(runs: Path) -> pd.DataFrame:
    from infra.tracking.run import Tracker

    return Tracker(tracking_uri_for(runs)).search_runs()


def _steps_logged(runs: Path, run_id: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    return sorted(m.step for m in MlflowClient(tracking_uri_for(runs)).get_metric_history(run_id, "train/loss"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sweep_killed_mid_cell_resumes_to_the_uninterrupted_table(
        tmp_path: Path, model_cache: Path, tool_user: Path, prefect_api_url: str) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run = dict(policy=tool_user, model_cache=model_cache, api_url=prefect_api_url)
    procs = [_sweep(straight, **run), _sweep(killed, **run)]  # type: ignore[arg-type]
    try:
        store = CheckpointStore(killed / "checkpoints" / KILLED_CELL)
        deadline = time.time() + scaled(600)
        while not any(1 in store.child(r).steps() for r in store.run_folders()):
            assert procs[1].poll() is None, log_tail(killed)
            assert time.time() < deadline, log_tail(killed)
            time.sleep(0.2)
        time.sleep(random.Random(0).uniform(0.0, 1.0))
        kill_group(procs[1])
        before = _runs(killed)
        assert procs[0].wait(timeout=scaled(600)) == 0, log_tail(straight)
        (child,) = before[before["run_name"] == KILLED_CELL]["run_id"]
        assert before.set_index("run_id").loc[child, "status"] == "RUNNING"  # killed mid-cell, short of the end
        assert _steps_logged(killed, child)[-1:] != [STEPS]
        procs.append(_sweep(killed, resume=True, **run))  # type: ignore[arg-type]
        assert procs[-1].wait(timeout=scaled(600)) == 0, log_tail(killed, "resume.log")
    finally:
        for proc in procs:  # whatever happened, no sweep process outlives the test
            kill_group(proc)

    after = _runs(killed)
    parents = after[after["tags.kind"] == "sweep"]
    assert len(parents) == 1 and parents["status"].tolist() == ["FINISHED"]  # the same parent run, finished
    children = after[after["tags.kind"] != "sweep"]
    assert sorted(children["run_name"]) == ["tiny-sweep-aepo-s0", KILLED_CELL]  # no second run of either cell
    assert set(children["tags.mlflow.parentRunId"]) == set(parents["run_id"])
    assert "tags.sweep_previous_parent_run_id" not in children or children[
        "tags.sweep_previous_parent_run_id"].isna().all()  # nobody was re-parented: there was one parent
    assert set(children["status"]) == {"FINISHED"} and child in set(children["run_id"])
    assert _steps_logged(killed, child) == list(range(1, STEPS + 1))  # each step once

    a = pd.read_csv(straight / "sweeps" / "tiny-sweep" / "comparison.csv")
    b = pd.read_csv(killed / "sweeps" / "tiny-sweep" / "comparison.csv")
    pd.testing.assert_frame_equal(a[SAME], b[SAME])
    # The equality is not vacuous: the cells learned something (a re-run from scratch would differ).
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri_for(straight))
    grpo = _runs(straight).set_index("run_name").loc[KILLED_CELL, "run_id"]
    assert any(m.value > 0 for m in client.get_metric_history(grpo, "train/grad_norm"))


def test_resume_of_a_sweep_that_never_ran_exits_2(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, ["sweep", "-c", str(TINY_SWEEP), "--runs-dir", str(tmp_path), "--resume"])
    assert result.exit_code == 2, result.output
    assert "nothing to resume" in result.output and "Traceback" not in result.output


def test_a_sweep_another_process_is_running_exits_2_and_touches_nothing(tmp_path: Path) -> None:
    """A second invocation of a sweep that is still running (the same command in another terminal, a schedule
    that fired again) would resume its parent run and start its cells a second time: it exits 2 naming the process
    that runs it, before it touches MLflow."""
    hold = ("import sys, time\nfrom infra.run.lock import Claims\nwith Claims(sys.argv[1], sweep='tiny-sweep'):\n"
            "    print('held', flush=True)\n    time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        second = subprocess.run([sys.executable, "-m", "flows.cli", "sweep", "-c", str(TINY_SWEEP), "--runs-dir",
                                 str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=scaled(300))
    finally:
        holder.kill()
        holder.wait()
    said = second.stdout + second.stderr
    assert second.returncode == 2, said[-3000:]
    assert f"sweep 'tiny-sweep' is in progress in another process (pid {holder.pid}" in said, said[-3000:]
    assert "Traceback" not in said
    assert _runs(tmp_path).empty  # no parent run, no child
