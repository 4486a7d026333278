"""The sweep fanned out through Prefect: real servers and workers, no mocks.

The session's server stack (``tests/server_stack.py``): a moto S3 server (MLflow artifacts and the Parquet
trajectories), ``aepo ui`` (an ``mlflow server`` on SQLite with its artifacts proxied to S3, and a ``prefect
server``), a process work pool with the ``train`` deployment registered by ``prefect deploy`` from ``prefect.yaml``
(the README's command); this module adds two ``prefect worker start --limit 1`` processes. A sweep of 2 cells × 1
seed (seed 1, not the default) on the tiny config runs in process (the reference) and through the deployment with
``max_parallel=2``, a child per worker; the tables must agree, a re-run must submit nothing, and a cell that fails
on the workers must be reported by name and state. Last, a worker is killed with the child it runs: the sweep must
report that child lost and compare the other. Every process started here runs in its own session and its whole
process group is stopped at the end. Measured on 2 cores with 2 × 2 children: the first test 118 s (in-process
sweep 32–45 s, fan-out 63–77 s in two waves, re-runs 2–4 s each, failing cell ~30 s), the killed worker ~85 s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from server_stack import AWS, BIN, POOL, REPO, Stack, base_env
from slowdown import scaled

pytestmark = [pytest.mark.slow, pytest.mark.server]  # the heavy tier (CI runs every tier)

DEPLOYMENT = "aepo-train/train"


@pytest.fixture(scope="module")
def stack(server_stack: Stack, model_cache: Path) -> Iterator[Stack]:
    """The session's server stack (prefect.yaml's train deployed on its pool) and two process workers on that pool,
    stopped after the module."""
    st = server_stack
    workers = ("worker1", "worker2")
    try:
        for name in workers:  # heartbeats every 30 s (Prefect's minimum; default 180): see the killed-worker test
            st.start(name, [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process",
                            "--limit", "1", "--name", name],
                     base_env(PREFECT_API_URL=st.prefect_api, PREFECT_HOME=str(st.tmp / name),
                              OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", AEPO_MODEL_CACHE=str(model_cache),
                              PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="5",
                              PREFECT_FLOWS_HEARTBEAT_FREQUENCY="30"))
        yield st
    finally:
        for name in workers:
            if name in st.procs:
                st.stop(name)


@contextlib.contextmanager
def _on_server(stack: Stack, home: Path) -> Iterator[None]:
    """This process's Prefect client on the stack's server (overrides the session harness, if one runs).

    Prefect keeps one events worker per process, bound to the API of the first event it sent (its key does not
    hold the URL): the one started here would send every later task run of this process to the stack, and the
    harness would show the next flow runs without their task runs (seen under xdist, where this module runs
    first on its worker). So the events worker is drained and dropped on the way in and out."""
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    EventsWorker.drain_all()
    with temporary_settings(updates={PREFECT_API_URL: stack.prefect_api, PREFECT_HOME: str(home)}):
        try:
            yield
        finally:
            EventsWorker.drain_all()


def _sweep_spec(stack: Stack, tracking_uri: str | None) -> dict[str, Any]:
    """configs/sweeps/tiny.yaml with seed 1 (a child that lost it would run seed 0), trajectories on S3 and (None:
    the runs dir's SQLite) MLflow."""
    spec = yaml.safe_load((REPO / "configs" / "sweeps" / "tiny.yaml").read_text())
    spec["base"] = str(REPO / "configs" / "tiny.yaml")
    spec["name"] = "fan"
    spec["seeds"] = [1]
    spec["overrides"].update({"tracking.system_metrics": False, "storage.trajectories_uri": f"s3://{stack.bucket}/traj",
                              "storage.s3_endpoint_url": stack.s3_url})
    if tracking_uri is not None:
        spec["overrides"]["tracking.tracking_uri"] = tracking_uri
    return spec


def _flow_runs_on(stack: Stack, deployment: str) -> list[Any]:
    """The flow runs of a deployment on the stack's server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with _on_server(stack, stack.tmp / "prefect-client"), get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(deployment)
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))


COMPARED = ["cell", "seed", "run_name", "status", "dataset", "pass@1", "pass@1_ci_low", "pass@1_ci_high", "k",
            "pass@k", "tool_calls_per_question", "answered_rate", "reward_mean", "branch_samples",
            "max_branches_per_path", "generated_tokens", "tool_calls"]  # all but run ids and measured CPU seconds


def test_fanout_sweep_runs_children_on_workers_and_matches_in_process(
        stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_cache: Path) -> None:
    import torch

    from flows.sweep import sweep
    from infra.tracking.run import Tracker

    for k, v in AWS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AEPO_MODEL_CACHE", str(model_cache))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers (OMP_NUM_THREADS=1), so that the two tables can be compared
    try:
        with _on_server(stack, tmp_path / "prefect-home"):
            t0 = time.monotonic()
            ref = sweep(sweep_config=_sweep_spec(stack, None), runs_dir=str(tmp_path / "in-process"))
            t_ref = time.monotonic() - t0
            ref_again = sweep(sweep_config=_sweep_spec(stack, None), runs_dir=str(tmp_path / "in-process"))
            lost = _sweep_spec(stack, None)  # what a child that lost its seed would run: seed 0, one cell
            lost.update(name="lost-seed", seeds=[0], grid={"algorithm": {"aepo": lost["grid"]["algorithm"]["aepo"]}})
            lost_seed = sweep(sweep_config=lost, runs_dir=str(tmp_path / "in-process"))
            t0 = time.monotonic()
            fan = sweep(sweep_config=_sweep_spec(stack, stack.mlflow_url), runs_dir=str(tmp_path / "fanout"),
                        deployment=DEPLOYMENT, max_parallel=2, child_timeout_s=scaled(600))
            t_fan = time.monotonic() - t0
            child_flow_runs = _flow_runs_on(stack, DEPLOYMENT)
            tracker = Tracker(stack.mlflow_url)  # (the re-run below re-parents the children: read them now)
            children = tracker.search_runs(filter_string=f"tags.mlflow.parentRunId = '{fan.parent_run_id}'")
            t0 = time.monotonic()
            again = sweep(sweep_config=_sweep_spec(stack, stack.mlflow_url), runs_dir=str(tmp_path / "fanout"),
                          deployment=DEPLOYMENT, max_parallel=2, child_timeout_s=scaled(600))
            t_again = time.monotonic() - t0
            flow_runs_after = _flow_runs_on(stack, DEPLOYMENT)
    finally:
        torch.set_num_threads(threads)
    print(f"in-process sweep {t_ref:.0f} s, fan-out {t_fan:.0f} s, re-run {t_again:.0f} s")
    names = [f"fan-{cell}-s{seed}" for cell in ("aepo", "grpo") for seed in (1,)]

    # the two children ran as flow runs of the deployment, named like their MLflow runs, on both workers
    assert sorted(fr.name for fr in child_flow_runs) == sorted(names)
    assert {fr.state.name for fr in child_flow_runs} == {"Completed"}
    assert fan.tracking_uri == stack.mlflow_url and sorted(fan.started) == sorted(names) and fan.reused == []

    # ... and logged to the one MLflow server, nested under the sweep's parent run
    parent = tracker.client.get_run(fan.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep_deployment"] == DEPLOYMENT
    assert sorted(children["run_name"]) == sorted(names) and set(children["status"]) == {"FINISHED"}
    assert dict(zip(children["run_name"], children["tags.sweep_cell"], strict=True)) == {
        n: n.split("-")[1] for n in names}
    assert set(children["tags.sweep_name"]) == {"fan"}
    assert set(children["params.tracking.tracking_uri"]) == {stack.mlflow_url}
    assert {a.path for a in tracker.client.list_artifacts(children["run_id"].iloc[0])} >= {"config.yaml"}
    assert parent.info.artifact_uri.startswith("mlflow-artifacts:")  # proxied by the server to moto's S3
    keys = stack.keys()
    assert any(k.startswith("mlartifacts/") and k.endswith("comparison.csv") for k in keys)
    assert set(children["run_id"]) <= {
        part for k in keys if k.startswith("traj/") for part in k.split("/")}

    # the comparison equals the in-process sweep's: same cells, seeds, rows and (seeded, one thread) values
    fan_runs = pd.DataFrame(fan.runs)[COMPARED]
    ref_runs = pd.DataFrame(ref.runs)[COMPARED]
    assert len(fan_runs) == 2 and list(fan_runs["run_name"]) == names
    pd.testing.assert_frame_equal(fan_runs, ref_runs)
    pd.testing.assert_frame_equal(pd.DataFrame(fan.summary).drop(columns="cpu_s"),
                                  pd.DataFrame(ref.summary).drop(columns="cpu_s"))
    # The tiny random policy never answers (measured: pass@1 0, reward -1 in every run), so the table alone would
    # match by accident; its rollout entropies differ by seed (10.48468 vs 10.48325 nats between seeds 0 and 1: the
    # questions differ) and were measured bit-equal between the worker processes and this one at one torch thread:
    # compare them too. (Between the two cells of one seed they differed only by float noise of the batch shape,
    # and were equal under AVX2 kernels: that is no evidence.)
    entropy = ["rollout/h_root_mean", "train/entropy_mean"]
    ref_children = Tracker(ref.tracking_uri).search_runs(  # (re-parented by the in-process re-run)
        filter_string=f"tags.mlflow.parentRunId = '{ref_again.parent_run_id}'")
    assert sorted(ref_children["run_name"]) == sorted(names)
    for frame in (children, ref_children):
        assert frame[[f"metrics.{m}" for m in entropy]].notna().all().all()
    by_name = {n: r for n, r in zip(ref_children["run_name"], ref_children.to_dict("records"), strict=True)}
    for row in children.to_dict("records"):
        assert [row[f"metrics.{m}"] for m in entropy] == [by_name[row["run_name"]][f"metrics.{m}"] for m in entropy]
    # ... and a child that lost its seed would have been caught: seed 0's entropies differ from seed 1's
    seed0 = Tracker(lost_seed.tracking_uri).search_runs(
        filter_string=f"tags.mlflow.parentRunId = '{lost_seed.parent_run_id}'").to_dict("records")
    assert len(seed0) == 1
    assert [seed0[0][f"metrics.{m}"] for m in entropy] != [by_name["fan-aepo-s1"][f"metrics.{m}"] for m in entropy]

    # a re-run, in process or fanned out, finds the two FINISHED children, runs or submits nothing and compares
    # them under its own parent
    assert ref_again.started == [] and sorted(ref_again.reused) == sorted(names)
    pd.testing.assert_frame_equal(pd.DataFrame(ref_again.runs)[COMPARED], ref_runs)
    assert again.started == [] and sorted(again.reused) == sorted(names)
    assert len(flow_runs_after) == len(child_flow_runs)
    moved = tracker.search_runs(filter_string=f"tags.mlflow.parentRunId = '{again.parent_run_id}'")
    assert sorted(moved["run_id"]) == sorted(children["run_id"])
    assert set(moved["tags.sweep_previous_parent_run_id"]) == {fan.parent_run_id}
    pd.testing.assert_frame_equal(pd.DataFrame(again.runs)[COMPARED], fan_runs)

    # a child that fails on its worker is reported by name and final state; the finished ones are reused and
    # compared, and the sweep (its parent run) ends failed. The broken cell fails at once (no such dataset).
    broken = _sweep_spec(stack, stack.mlflow_url)
    broken["cells"] = {"broken": {"data.train": str(tmp_path / "no-such-dataset.parquet")}}
    with _on_server(stack, tmp_path / "prefect-home"), pytest.raises(RuntimeError) as failure:
        sweep(sweep_config=broken, runs_dir=str(tmp_path / "fanout"), deployment=DEPLOYMENT, max_parallel=2,
              child_timeout_s=scaled(600))
    assert "1 of 3 runs failed: fan-broken-s1 (Failed)" in str(failure.value)
    table = pd.read_csv(tmp_path / "fanout" / "sweeps" / "fan" / "comparison.csv")
    assert sorted(table["run_name"]) == sorted(names) and set(table["status"]) == {"FINISHED"}
    last = tracker.search_runs(filter_string="tags.kind = 'sweep'", order_by=["attributes.start_time DESC"])
    assert last["run_name"].iloc[0] == "fan" and last["status"].iloc[0] == "FAILED"
    assert sorted(fr.name for fr in _flow_runs_on(stack, DEPLOYMENT)) == sorted(
        [*names, "fan-broken-s1"])


def _kill_tree(root_pid: int) -> list[int]:
    """SIGKILL a process and every descendant at once (a worker machine lost with its flow run)."""
    import psutil

    root = psutil.Process(root_pid)
    procs = [root, *root.children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    return [p.pid for p in procs]


def test_a_child_whose_worker_is_killed_mid_run_is_reported_and_the_others_compared(
        stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_cache: Path) -> None:
    """Two children, one per worker; while the ``slow`` one runs (its flow run Running, its MLflow run RUNNING),
    its worker and the worker's flow-run process are SIGKILLed together, as when a worker machine is lost.

    Why it is not vacuous: the process worker starts each flow run in a session of its own, so killing only the
    worker's process group leaves the flow run alive, and it then reports itself Crashed within ~2 s (measured),
    which the sweep already handled. Killing both leaves nobody to report: the test checks that Prefect still
    shows the flow run Running 15 s after the kill (so its Crashed state later can only come from the sweep), and
    the sweep, with no ``child_timeout_s`` short enough to catch it (300 s), must notice within ``lost_after_s``
    that the child's heartbeats stopped, report it by name as lost while the ``fast`` child is compared, mark its
    flow run Crashed and its MLflow run KILLED. Without that detection the sweep waited out the 300 s timeout (or,
    without a timeout, for ever). Runs last in the module: it leaves one worker. Measured: ~100 s.
    """
    import threading

    import psutil

    from flows.sweep import sweep
    from infra.tracking.run import Tracker

    for k, v in AWS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AEPO_MODEL_CACHE", str(model_cache))
    spec = _sweep_spec(stack, stack.mlflow_url)
    spec.pop("grid")
    spec.update(name="lost", seeds=[0], cells={"slow": {"train.steps": 20}, "fast": {}})
    victim = "lost-slow-s0"
    tracker = Tracker(stack.mlflow_url)
    killed: dict[str, Any] = {}

    def kill_the_victim_s_worker() -> None:
        deadline = time.monotonic() + scaled(300)
        with _on_server(stack, tmp_path / "killer-home"):
            while time.monotonic() < deadline:
                run = tracker.search_runs(filter_string=f"attributes.run_name = '{victim}'")
                flow_run = next((fr for fr in _flow_runs_on(stack, DEPLOYMENT) if fr.name == victim), None)
                if (not run.empty and run["status"].iloc[0] == "RUNNING" and flow_run is not None
                        and flow_run.infrastructure_pid):
                    pid = int(str(flow_run.infrastructure_pid).split(":")[-1])  # "pid" (or "host:pid")
                    worker = next(w for w in ("worker1", "worker2")
                                  if pid in {p.pid for p in psutil.Process(stack.procs[w].pid).children(True)})
                    killed.update(worker=worker, pids=_kill_tree(stack.procs[worker].pid), flow_run_id=flow_run.id)
                    time.sleep(15)
                    killed["state_15s_later"] = _flow_run_state(stack, flow_run.id)
                    return
                time.sleep(1)

    killer = threading.Thread(target=kill_the_victim_s_worker, daemon=True)
    killer.start()
    t0 = time.monotonic()
    with _on_server(stack, tmp_path / "prefect-home"), pytest.raises(RuntimeError) as failure:
        sweep(sweep_config=spec, runs_dir=str(tmp_path / "fanout"), deployment=DEPLOYMENT, max_parallel=2,
              child_timeout_s=scaled(300), child_lost_after_s=60)
    elapsed = time.monotonic() - t0
    killer.join(timeout=30)
    print(f"sweep with a killed worker: {elapsed:.0f} s; {killed}")

    assert killed.get("pids"), "the slow child's worker was not killed while it ran"
    assert not [p for p in killed["pids"] if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert killed["state_15s_later"] == "Running"  # Prefect itself never learns that the flow run is gone
    message = str(failure.value)
    assert "1 of 2 runs failed" in message and f"{victim} (lost: no heartbeat for over 60 s)" in message, message
    assert "timed out" not in message and elapsed < scaled(300)
    assert _flow_run_state(stack, killed["flow_run_id"]) == "Crashed"
    table = pd.read_csv(tmp_path / "fanout" / "sweeps" / "lost" / "comparison.csv")
    assert dict(zip(table["run_name"], table["status"])) == {"lost-slow-s0": "KILLED", "lost-fast-s0": "FINISHED"}
    # the survivor's row carries its own run's figures: its last logged reward, read back from MLflow
    (fast,) = tracker.search_runs(filter_string="attributes.run_name = 'lost-fast-s0'")["run_id"]
    last_reward = max(tracker.client.get_metric_history(fast, "rollout/reward_mean"), key=lambda m: m.step).value
    assert table.loc[table["run_name"] == "lost-fast-s0", "reward_mean"].tolist() == [pytest.approx(last_reward)]
    parent = tracker.search_runs(filter_string="tags.kind = 'sweep' AND attributes.run_name = 'lost'")
    assert list(parent["status"]) == ["FAILED"]


def _flow_run_state(stack: Stack, flow_run_id: Any) -> str | None:
    from prefect.client.orchestration import get_client

    with _on_server(stack, stack.tmp / "prefect-client"), get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        return state.name if state is not None else None
