"""The `aepo` CLI through typer's CliRunner (in process, under the session's Prefect harness): train leaves an
MLflow run, Parquet parts and a checkpoint; bad configs exit 2 before anything exists; runs / trajectories /
eval / config show print their tables; deployments (prefect.yaml and `aepo serve`'s) are valid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from slowdown import scaled
from typer.testing import CliRunner

from flows.cli import app

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
FAST = ["rollout.k=2", "rollout.initial_rollouts=1", "rollout.max_response_tokens=48", "rollout.max_segment_tokens=16",
        "rollout.entropy_window=16", "eval.max_questions=2", "eval.top_p=1.0"]
ENV = {"COLUMNS": "250"}  # wide tables: rich would fold long ids at 80 columns


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env=ENV, catch_exceptions=False)


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def trained(prefect_harness: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    # Prefect binds its console log handler to sys.stderr when its flow API is first imported: do that here (pytest's
    # stream), not inside CliRunner, whose stream is closed after each invoke.
    import flows.train  # noqa: F401

    runs = tmp_path_factory.mktemp("cli-runs")
    result = invoke("train", "-c", TINY, "--runs-dir", str(runs), *sets("train.steps=1", "eval.at_start=true",
                                                                        "train.sft.enabled=true",
                                                                        "train.sft.max_examples=4", *FAST))
    return result, runs


def _only_run(runs: Path) -> Any:
    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run import Tracker

    frame = Tracker(tracking_uri_for(runs)).search_runs()
    assert len(frame) == 1
    return frame.iloc[0]


@pytest.mark.slow  # trains
def test_train_leaves_mlflow_run_parquet_and_checkpoint(trained: tuple[Any, Path]) -> None:
    from infra.store import TrajectoryStore

    result, runs = trained
    assert result.exit_code == 0, result.output
    run = _only_run(runs)
    assert run["run_name"] == "tiny" and run["status"] == "FINISHED"
    assert run["params.storage.runs_dir"] == str(runs)
    store = TrajectoryStore(runs)
    assert store.steps(run["run_id"]) == [1]
    assert (runs / "nodes" / run["run_id"] / "step-000001.parquet").is_file()
    assert (runs / "checkpoints" / "tiny" / run["run_id"] / "step-000001" / "manifest.json").is_file()
    out = result.stdout
    assert "evaluations (1 RL steps)" in out and "synthetic_test" in out and "95% CI" in out
    stages = [line.split()[0] for line in out.splitlines() if line.split()[1:2] == ["synthetic_test"]]
    assert stages == ["start", "sft", "final"], out
    assert "final minus start on synthetic_test: pass@1" in out and "(paired over 2 questions)" in out
    assert run["run_id"] in out and "aepo ui --runs-dir" in out
    assert str(runs / "checkpoints" / "tiny" / run["run_id"]) in out


@pytest.mark.parametrize(("override", "needle"), [
    ("nope.key=1", "unknown key 'nope'"),
    ("rollout.k=-1", "rollout.k"),
    ("data.train=/nope.jsonl", "data.train: dataset '/nope.jsonl'"),
    ("rollout.engine=remote", "rollout.remote.reload_url"),  # a remote sampler must follow the trained weights
])
def test_bad_config_exits_2_before_anything_is_created(tmp_path: Path, override: str, needle: str) -> None:
    runs = tmp_path / "runs"
    result = invoke("train", "-c", TINY, "--runs-dir", str(runs), "--set", override)
    assert result.exit_code == 2
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not runs.exists()  # no MLflow store, no Prefect home, nothing


def test_exact_entropies_under_zero3_on_two_ranks_exit_2_before_anything_is_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 49 §6: rank 0 of a 2-rank launch (the launcher's WORLD_SIZE) refuses the combination that would hang
    in the first rollout, in one line naming the keys."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    runs = tmp_path / "runs"
    sets = ["rollout.engine=remote", "rollout.remote.url=http://127.0.0.1:9", "rollout.remote.weight_sync=vllm",
            "train.backend=deepspeed", "train.zero_stage=3"]
    result = invoke("train", "-c", TINY, "--runs-dir", str(runs), *[a for s in sets for a in ("--set", s)])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "rollout.exact_entropy=true" in result.stderr and "train.zero_stage=3 on 2 ranks" in result.stderr
    assert not runs.exists()


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = invoke("train", "-c", str(tmp_path / "none.yaml"), "--runs-dir", str(tmp_path / "runs"))
    assert result.exit_code == 2 and "config file not found" in result.stderr


def test_non_utf8_config_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(Path(TINY).read_bytes() + b"# caf\xe9\n")
    result = invoke("train", "-c", str(bad), "--runs-dir", str(tmp_path / "runs"))
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert str(bad) in result.stderr and "not UTF-8" in result.stderr and "Traceback" not in result.stderr


def _bad_jsonl(path: Path) -> Path:
    """A benchmark whose 4th line (after a blank one) has no question."""
    good = '{"question": "What is 2+2?", "answer": "4"}'
    path.write_text(f"{good}\n{good}\n\n{{\"answer\": \"no question\"}}\n", encoding="utf-8")
    return path


def _mlflow_statuses(runs: Path) -> list[str]:
    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run import Tracker

    if not (runs / "mlflow.db").exists():
        return []
    return list(Tracker(tracking_uri_for(runs)).search_runs()["status"])


@pytest.mark.parametrize("key", ["data.train", "eval.datasets"])
def test_bad_dataset_row_exits_2_with_one_line_and_no_failed_run(prefect_harness: Any, tmp_path: Path,
                                                                  key: str) -> None:
    """A user error in the data is reported like a bad config: exit 2, one line naming file, line and field, no
    traceback, and no FAILED MLflow run left behind."""
    import flows.train  # noqa: F401  (Prefect's console handler binds to pytest's stderr, see `trained`)

    data = _bad_jsonl(tmp_path / "bad.jsonl")
    runs = tmp_path / "runs"
    value = f"[{data}]" if key == "eval.datasets" else str(data)
    result = invoke("train", "-c", TINY, "--runs-dir", str(runs), *sets(f"{key}={value}", "train.steps=1", *FAST))
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert str(data) in result.stderr and "line 4: question: missing" in result.stderr
    assert "FAILED" not in _mlflow_statuses(runs)


@pytest.mark.slow  # trains
def test_runs_lists_the_run(trained: tuple[Any, Path]) -> None:
    _, runs = trained
    run = _only_run(runs)
    result = invoke("runs", "--runs-dir", str(runs))
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if run["run_id"][:12] in line)
    assert "tiny" in row and "FINISHED" in row and "aepo" in row and "train" in row


@pytest.mark.slow  # trains
def test_runs_piped_keep_every_cell_whole_and_csv_json_read_back(trained: tuple[Any, Path]) -> None:
    """stdout not a terminal and COLUMNS unset (``aepo runs | cat``): rich wrapped at 80 columns, cutting the run id
    and dropping columns; now the table is as wide as its cells. CSV and JSON carry the values unrounded."""
    import csv
    import io
    import json
    import re

    _, runs = trained
    run = _only_run(runs)
    reward = run["metrics.rollout/reward_mean"]
    piped = CliRunner().invoke(app, ["runs", "--runs-dir", str(runs)], env={"COLUMNS": None},
                               catch_exceptions=False)
    assert piped.exit_code == 0, piped.output
    row = next(line for line in piped.stdout.splitlines() if run["run_id"] in line)  # the whole id, on one line
    assert f"{reward:.3f}" in row.split() and "FINISHED" in row
    as_csv = invoke("runs", "--runs-dir", str(runs), "--format", "csv")
    (back,) = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert back["run_id"] == run["run_id"] and float(back["reward"]) == reward and back["status"] == "FINISHED"
    (obj,) = json.loads(invoke("runs", "--runs-dir", str(runs), "--format", "json").stdout)
    assert all(re.fullmatch(r"[a-z0-9_]+", key) for key in obj)  # keys a program can use as names
    assert obj["run_id"] == run["run_id"] and obj["reward"] == reward and obj["seed"] == int(back["seed"]) == 0
    assert obj["dataset"] == "synthetic_test" and obj["pass_at_1"] == run["metrics.eval/synthetic_test/pass_at_1"]
    # What the run spent (issue 27 §4): whole tokens and tool calls, as MLflow has them.
    assert obj["tokens"] == run["metrics.cost/total_generated_tokens"] > 0 and isinstance(obj["tokens"], int)
    assert obj["tool_calls"] == run["metrics.cost/total_tool_calls"]
    assert obj["cpu_s"] == run["metrics.cost/total_cpu_s"] > 0 and int(back["tokens"]) == obj["tokens"]
    assert str(obj["tokens"]) in row.split()


@pytest.mark.slow  # trains
def test_each_evaluation_stage_has_its_own_point(trained: tuple[Any, Path]) -> None:
    """Start (before SFT), SFT and final evaluations: ``eval/…`` is the RL curve with one point per step (the SFT
    policy at step 0, the final one at the last step); the start evaluation is ``eval_start/…``. Before, start and
    SFT were both logged at step 0 and every eval chart began with a vertical segment."""
    from mlflow.tracking import MlflowClient

    from infra.tracking.client import tracking_uri_for

    _, runs = trained
    run = _only_run(runs)
    client = MlflowClient(tracking_uri_for(runs))
    curve = client.get_metric_history(run["run_id"], "eval/synthetic_test/pass_at_1")
    assert sorted(m.step for m in curve) == [0, 1]
    (start,) = client.get_metric_history(run["run_id"], "eval_start/synthetic_test/pass_at_1")
    assert start.step == 0


def test_runs_without_a_store_says_so(tmp_path: Path) -> None:
    result = invoke("runs", "--runs-dir", str(tmp_path))
    assert result.exit_code == 2 and "no MLflow store" in result.stderr
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow  # trains
def test_trajectories_summarize_steps_and_questions(trained: tuple[Any, Path]) -> None:
    import csv
    import io
    import json

    from infra.store import TrajectoryStore

    _, runs = trained
    run = _only_run(runs)
    leaves = TrajectoryStore(runs).read_trajectories(run["run_id"])
    by_name = invoke("trajectories", "tiny", "--runs-dir", str(runs))  # resolved through MLflow's run name
    assert by_name.exit_code == 0, by_name.output
    assert any(line.split()[:3] == ["1", str(leaves["question_id"].nunique()), str(len(leaves))]
               for line in by_name.stdout.splitlines() if line.strip())
    as_csv = invoke("trajectories", "tiny", "--runs-dir", str(runs), "--format", "csv")
    (step_row,) = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert int(step_row["leaves"]) == len(leaves) and float(step_row["mean_reward"]) == leaves["reward"].mean()
    per_q = json.loads(invoke("trajectories", "tiny", "--step", "1", "--runs-dir", str(runs), "--format",
                              "json").stdout)
    assert sorted(r["question"] for r in per_q) == sorted(leaves["question_id"].unique())
    detail = invoke("trajectories", run["run_id"][:8], "--step", "1", "--runs-dir", str(runs))
    assert detail.exit_code == 0, detail.output
    for qid in leaves["question_id"].unique():
        assert qid in detail.stdout
    qid = leaves["question_id"].iloc[0]  # a real run's trajectory, in full
    shown = invoke("trajectories", run["run_id"], "--step", "1", "--show", f"{qid}/0", "--runs-dir", str(runs))
    assert shown.exit_code == 0, shown.output
    first = leaves[(leaves["question_id"] == qid) & (leaves["leaf_id"] == 0)].iloc[0]
    assert first["question"] in shown.stdout and f"leaf 0 ({first['sample_kind']}) · status {first['status']}" in (
        shown.stdout)
    missing = invoke("trajectories", "no-such-run", "--runs-dir", str(runs))
    assert missing.exit_code == 2 and "no stored trajectories" in missing.stderr


@pytest.mark.slow  # trains
def test_eval_command_on_the_trained_checkpoint(trained: tuple[Any, Path]) -> None:
    _, runs = trained
    result = invoke("eval", "--checkpoint", str(runs / "checkpoints" / "tiny"), "--runs-dir", str(runs),
                    *sets("eval.max_questions=1", "eval.top_p=1.0"), "--run-name", "cli-eval")
    assert result.exit_code == 0, result.output
    assert "aepo eval: cli-eval (step 1)" in result.stdout
    assert (runs / "eval" / "cli-eval" / "synthetic_test.parquet").is_file()
    bad = invoke("eval", "--checkpoint", str(runs / "nope"), "--runs-dir", str(runs))
    assert bad.exit_code == 2 and "does not exist" in bad.stderr


def test_config_show_prints_the_resolved_yaml() -> None:
    from infra.config_files import load_config

    result = invoke("config", "show", "-c", TINY, "--set", "rollout.k=3")
    assert result.exit_code == 0
    assert yaml.safe_load(result.stdout) == load_config(TINY, ["rollout.k=3"]).to_dict()


def test_serve_without_a_prefect_server_says_how_to_start_one(tmp_path: Path) -> None:
    result = invoke("serve", "-c", TINY, "--sweep", str(REPO / "configs" / "sweeps" / "tiny.yaml"),
                    "--runs-dir", str(tmp_path), "--api-url", "http://127.0.0.1:9/api")
    assert result.exit_code == 1 and "aepo ui" in result.stderr


def test_served_deployments_are_built(prefect_harness: Any, tmp_path: Path) -> None:
    from flows.serve import build_deployments

    deployments = {d.name: d for d in build_deployments(tmp_path, TINY, REPO / "configs" / "sweeps" / "tiny.yaml")}
    # not prefect.yaml's names
    assert set(deployments) == {"train-served", "evaluate-served", "rollout-study-served", "compare-served",
                                "sweep-served"}
    assert deployments["train-served"].parameters["config"]["name"] == "tiny"
    assert deployments["train-served"].parameters["runs_dir"] == str(tmp_path.resolve())
    assert deployments["sweep-served"].schedules == []  # a schedule only when asked (`aepo serve --cron`)


def test_prefect_yaml_deployments_load_and_validate(prefect_harness: Any) -> None:
    from prefect.flows import load_flow_from_entrypoint

    from infra.config_files import load_config

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {"train", "evaluate", "rollout-study", "compare", "sweep"}
    for d in deployments.values():
        assert d["work_pool"]["name"] == "aepo-process"
        assert d["parameters"]["runs_dir"] is None  # the worker's $AEPO_RUNS_DIR, else the config's
        flow = load_flow_from_entrypoint(str(REPO / d["entrypoint"]))
        flow.validate_parameters(d.get("parameters") or {})
    params = load_flow_from_entrypoint(str(REPO / "flows/train.py:train")).validate_parameters(
        deployments["train"]["parameters"])
    assert params["config"] == load_config(TINY)  # the deployment's default is the tiny config
    (schedule,) = deployments["sweep"]["schedules"]  # declared, paused: nobody gets a 03:00 run unasked
    assert schedule["cron"] and schedule["active"] is False
    assert deployments["sweep"]["parameters"]["dated"] is True  # each firing a new sweep (flows/sweep.py)


def _cmdline(p: Any) -> str:
    """A process's command line; "" for one that exited (or became a zombie) while we looked."""
    import psutil

    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def _start_long_train(runs: Path, log: Path, model_cache: Path, *extra: str) -> Any:
    """`aepo train` of 50 steps (and ``extra`` settings) in its own process and session, with no Prefect settings
    (its temporary API)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({"PYTHONPATH": str(REPO), "AEPO_MODEL_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"})
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "train", "-c", TINY, "--runs-dir", str(runs),
                                 *sets("train.steps=50", *FAST, *extra)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=REPO)


def _wait_for_its_server(proc: Any, runs: Path, log: Path, deadline: float) -> list[Any]:
    """The run's process tree once its flow runs (the MLflow store exists) and its temporary API server is up;
    recorded before any signal, so that it names the run's own processes."""
    import time

    import psutil

    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, log.read_text()[-3000:]
        tree = psutil.Process(proc.pid).children(recursive=True)
        if any("uvicorn" in _cmdline(c) for c in tree) and (runs / "mlflow.db").exists():
            return tree
        time.sleep(0.5)


@pytest.mark.slow
def test_sigterm_or_sigkill_of_the_trainer_leaves_no_temporary_prefect_server(tmp_path: Path,
                                                                                model_cache: Path) -> None:
    """`kill <pid>` of `aepo train` (SIGTERM: it unwinds) and the OOM killer's SIGKILL of `aepo train` alone (no
    unwinding, no atexit) must both leave no Prefect temporary API server (a child process) behind: after SIGTERM
    the run stops it, after SIGKILL it dies with its parent. Two runs at once, one signal each."""
    import contextlib
    import os
    import signal
    import time

    import psutil

    names = ("sigterm", "sigkill")
    runs = {n: tmp_path / n / "runs" for n in names}
    logs = {n: tmp_path / f"{n}.log" for n in names}
    for n in names:
        runs[n].parent.mkdir()
    procs = {n: _start_long_train(runs[n], logs[n], model_cache) for n in names}
    trees: dict[str, list[psutil.Process]] = {}
    try:
        deadline = time.time() + scaled(400)
        trees = {n: _wait_for_its_server(procs[n], runs[n], logs[n], deadline) for n in names}
        procs["sigterm"].send_signal(signal.SIGTERM)
        procs["sigkill"].kill()  # the main process only: its children are not signalled
        assert procs["sigterm"].wait(timeout=scaled(120)) != 0
        procs["sigkill"].wait(timeout=30)
        for n, timeout in (("sigterm", 60), ("sigkill", 10)):
            _, alive = psutil.wait_procs([p for p in trees[n] if "uvicorn" in _cmdline(p)], timeout=timeout)
            assert not alive, f"{n}: orphaned Prefect server: {[p.cmdline() for p in alive]}"
    finally:
        for p in (p for tree in trees.values() for p in tree):  # whatever is left (the sandbox, a server)
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_a_run_still_training_cannot_be_resumed_by_a_second_process(tmp_path: Path, model_cache: Path) -> None:
    """`aepo train --resume` of a run that another live process is training (a second terminal, a sweep started
    twice) must not become a second writer of that MLflow run and its checkpoints: it exits 2 at once, naming the
    pid that trains it, and the first run goes on."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    runs, log = tmp_path / "runs", tmp_path / "first.log"
    first = _start_long_train(runs, log, model_cache, "checkpoint.every=1")
    try:
        deadline = time.time() + scaled(400)
        _wait_for_its_server(first, runs, log, deadline)
        while not list(runs.glob("checkpoints/*/*/step-*")):  # its MLflow run exists and has trained a step
            assert first.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update({"PYTHONPATH": str(REPO), "AEPO_MODEL_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"})
        second = subprocess.run([sys.executable, "-m", "flows.cli", "train", "-c", TINY, "--runs-dir", str(runs),
                                 "--resume", *sets("train.steps=50", "checkpoint.every=1", *FAST)], env=env,
                                capture_output=True,
                                text=True, timeout=scaled(300), cwd=REPO)
        said = second.stdout + second.stderr
        assert second.returncode == 2, said[-3000:]
        assert f"in another process (pid {first.pid}" in said, said[-3000:]
        assert "Traceback" not in said
        assert first.poll() is None, log.read_text()[-3000:]  # the first run goes on
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def test_progress_comes_from_structured_events_not_from_the_log_text() -> None:
    """The bar reads the event a task attaches to its log record; the message itself may say anything."""
    import logging

    from flows.cli.render import ProgressHandler
    from tasks.progress import Progress, report

    seen: list[Progress] = []
    logger = logging.getLogger("aepo.test.progress")
    logger.setLevel(logging.INFO)
    handler = ProgressHandler(seen.append)
    logger.addHandler(handler)
    try:
        report(logger, Progress("update", done=3, total=5), "whatever wording: %s", "reworded")
        logger.info("step 4 update: loss 0.1")  # the old text pattern, without an event: no progress
    finally:
        logger.removeHandler(handler)
    assert seen == [Progress("update", done=3, total=5)]


@pytest.mark.slow  # trains
def test_the_logged_model_carries_its_lineage(trained: tuple[Any, Path]) -> None:
    """Issue 54 §2, read back through the MLflow client: the model holds the final step's metrics (the final
    evaluation's Pass@1, not the SFT evaluation's at step 0: MLflow links the metrics of the step a model is logged
    at), the run's params, and the run's output names it at that step; the registered version's source is the model
    (the registry page links "Source Model" from a ``models:/<model id>`` source), the model lists the version."""
    import json

    from mlflow import MlflowClient

    from infra.tracking.client import tracking_uri_for

    _, runs = trained
    uri = tracking_uri_for(runs)
    client = MlflowClient(uri, registry_uri=uri)
    [version] = client.search_model_versions("name='aepo-policy'")
    model_id = version.tags["model_id"]
    model = client.get_logged_model(model_id)
    run = client.get_run(version.run_id)
    assert {m.step for m in model.metrics} == {1}
    linked = {m.key: m.value for m in model.metrics}
    assert linked["eval/synthetic_test/pass_at_1"] == run.data.metrics["eval/synthetic_test/pass_at_1"]
    assert model.params["algorithm.loss"] == run.data.params["algorithm.loss"] and len(model.params) >= 50
    assert [(o.model_id, o.step) for o in run.outputs.model_outputs] == [(model_id, 1)]
    assert version.source == f"models:/{model_id}"
    assert {"name": "aepo-policy", "version": "1"} in json.loads(model.tags["mlflow.modelVersions"])


@pytest.mark.slow  # trains
def test_registered_policy_loads_in_mlflow_and_through_aepo_eval(trained: tuple[Any, Path]) -> None:
    """The trained policy is registered with its final metrics and its protocol; MLflow loads it as a transformers
    model whose prompt template is the rollout prompt; `aepo eval models:/…` evaluates exactly its weights and
    links the evaluation run to the model."""
    import mlflow
    import torch
    from mlflow import MlflowClient
    from safetensors.torch import load_file

    from aepo_core.protocol import SYSTEM_PROMPT
    from infra.models import chat_prompt_text
    from infra.tracking.client import tracking_uri_for

    _, runs = trained
    uri = tracking_uri_for(runs)
    client = MlflowClient(uri, registry_uri=uri)
    [version] = client.search_model_versions("name='aepo-policy'")
    assert str(version.version) == "1" and version.tags["step"] == "1"
    train_run = client.get_run(version.run_id)
    # The version carries the run's final evaluation, every metric of it, as the run logged it (a lost or
    # mislabelled metric, or one from another step, differs)
    final = {k: v for k, v in train_run.data.metrics.items()  # (the paired final − start comparison is not one)
             if k.startswith("eval/synthetic_test/") and "/final_minus_" not in k}
    assert len(final) >= 8, sorted(final)
    assert {k: v for k, v in version.tags.items() if k.startswith("eval/")} == {k: f"{v:.6g}" for k, v in final.items()}
    assert train_run.data.tags["registered_model"] == "models:/aepo-policy/1"
    from infra.tracking.client import fluent_uri

    with fluent_uri(uri):  # (and the process's own URI as it was: unset stays unset)
        parts = mlflow.transformers.load_model("models:/aepo-policy/1", return_type="components")
        info = mlflow.models.get_model_info("models:/aepo-policy/1")
    assert info.metadata["aepo_protocol"]["system_prompt"] == SYSTEM_PROMPT
    template = info.metadata["prompt_template"]
    assert template.format(prompt="What is 2+2?") == chat_prompt_text(parts["tokenizer"], "What is 2+2?")
    checkpoint = load_file(str(runs / "checkpoints" / "tiny" / version.run_id / "step-000001" / "model"
                               / "model.safetensors"))
    registered = parts["model"].state_dict()
    assert all(torch.equal(registered[k].float(), v.float()) for k, v in checkpoint.items())

    result = invoke("eval", "--checkpoint", "models:/aepo-policy@best", "--runs-dir", str(runs),
                    *sets("eval.max_questions=1", "eval.top_p=1.0"), "--run-name", "registry-eval")
    assert result.exit_code == 0, result.output
    assert "aepo eval: registry-eval (step 1)" in result.stdout
    [eval_run] = client.search_runs([train_run.info.experiment_id], "attributes.run_name = 'registry-eval'")
    assert eval_run.data.tags["checkpoint"] == "models:/aepo-policy/1"
    assert eval_run.data.tags["source_run_id"] == version.run_id
    linked = client.get_run(eval_run.info.run_id).inputs.model_inputs  # (search_runs leaves model inputs out)
    assert [m.model_id for m in linked] == [version.tags["model_id"]]
    assert client.get_logged_model(version.tags["model_id"]).source_run_id == version.run_id
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:  # renamed once its name was known (after reading the model)
        flow_run = prefect.read_flow_run(eval_run.data.tags["prefect_flow_run_id"])
    assert flow_run.name == "registry-eval" and {"aepo", "cli"} <= set(flow_run.tags)
    missing = invoke("eval", "--checkpoint", "models:/aepo-policy/9", "--runs-dir", str(runs))
    assert missing.exit_code == 2 and "no such registered model version" in missing.stderr


def test_flow_runs_dir_is_the_parameter_then_aepo_runs_dir_then_the_config(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    from flows.common import flow_runs_dir

    monkeypatch.delenv("AEPO_RUNS_DIR", raising=False)
    assert flow_runs_dir(None, "runs") == Path("runs")
    monkeypatch.setenv("AEPO_RUNS_DIR", str(tmp_path / "ui-runs"))  # a deployed run: the worker's environment
    assert flow_runs_dir(None, "runs") == tmp_path / "ui-runs"
    assert flow_runs_dir(str(tmp_path / "given"), "runs") == tmp_path / "given"
