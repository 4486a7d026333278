"""The sweep fanned out through Prefect: real servers and workers, no mocks.

One module-scoped stack: a moto S3 server (MLflow artifacts and the Parquet trajectories), an ``mlflow server``
(SQLite backend, artifacts proxied to S3), a ``prefect server``, a process work pool with the ``train``
deployment registered by ``prefect deploy`` from ``prefect.yaml`` (the README's command), and two ``prefect
worker start --limit 1`` processes. A sweep of 2 cells × 2 seeds on the tiny config runs in process (the
reference) and through the deployment with ``max_parallel=2``; the tables must agree, a re-run must submit
nothing, and a cell that fails on the workers must be reported by name and state. Every process started here
runs in its own session and its whole process group is stopped at the end. Measured: 195–208 s on 2 cores (stack
30–45 s, in-process sweep 32–45 s, fan-out 63–77 s, re-runs 2–4 s each, failing cell ~30 s, teardown 9–11 s).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
POOL = "aepo-test-pool"
DEPLOYMENT = "aepo-train/train"
BUCKET = "aepo-fanout"
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _base_env(**extra: str) -> dict[str, str]:
    """The test's environment without its Prefect/MLflow settings (each process gets its own, explicitly)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update({"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                **AWS, **extra})
    return env


@dataclass
class Stack:
    """URLs of the servers, the environment a Prefect client needs, and the started processes (with logs)."""

    tmp: Path
    s3_url: str = ""
    mlflow_url: str = ""
    prefect_api: str = ""
    procs: dict[str, subprocess.Popen[bytes]] | None = None

    def start(self, name: str, cmd: list[str], env: dict[str, str], cwd: Path = REPO) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        assert self.procs is not None
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, n: int = 40) -> str:
        path = self.tmp / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.is_file() else ""

    def wait_http(self, name: str, url: str, timeout_s: float = 150.0) -> None:
        assert self.procs is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                pytest.fail(f"{name} exited with {self.procs[name].returncode}:\n{self.log_tail(name)}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:  # not listening yet: poll again
                pass
            time.sleep(0.5)
        pytest.fail(f"{name} not up after {timeout_s} s ({url}):\n{self.log_tail(name)}")

    def prefect_cli(self, *args: str, timeout_s: float = 180.0) -> str:
        env = _base_env(PREFECT_API_URL=self.prefect_api, PREFECT_HOME=str(self.tmp / "prefect-cli"),
                        PWD=str(REPO), PYTHONPATH=str(REPO), PREFECT_CLI_PROMPT="false")
        proc = subprocess.run([str(BIN / "prefect"), "--no-prompt", *args], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=timeout_s)
        assert proc.returncode == 0, f"prefect {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def stop(self, name: str) -> None:
        assert self.procs is not None
        proc = self.procs[name]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError):  # children the leader left behind (a flow run subprocess)
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("fanout-stack")
    st = Stack(tmp, procs={})
    env = pytest.MonkeyPatch()
    env.setenv("PREFECT_HOME", str(tmp / "prefect-test"))  # this process's Prefect files, never ~/.prefect
    env.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        s3_port, mlflow_port, prefect_port = _free_port(), _free_port(), _free_port()
        st.s3_url = f"http://127.0.0.1:{s3_port}"
        st.start("moto", [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(s3_port)], _base_env())
        st.wait_http("moto", f"{st.s3_url}/moto-api/", timeout_s=60)
        import boto3

        boto3.client("s3", endpoint_url=st.s3_url, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)

        st.mlflow_url = f"http://127.0.0.1:{mlflow_port}"
        st.start("mlflow", [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                            "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
                            "--artifacts-destination", f"s3://{BUCKET}/mlartifacts", "--workers", "1"],
                 _base_env(MLFLOW_S3_ENDPOINT_URL=st.s3_url))
        st.prefect_api = f"http://127.0.0.1:{prefect_port}/api"
        st.start("prefect-server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                    str(prefect_port)],
                 _base_env(PREFECT_HOME=str(tmp / "prefect-server"), PREFECT_UI_ENABLED="false"))
        st.wait_http("mlflow", f"{st.mlflow_url}/health")
        st.wait_http("prefect-server", f"{st.prefect_api}/health")

        st.prefect_cli("work-pool", "create", POOL, "--type", "process")
        st.prefect_cli("deploy", "--name", "train", "--pool", POOL)  # prefect.yaml's train, on the test's pool
        for i in (1, 2):
            st.start(f"worker{i}", [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process",
                                    "--limit", "1", "--name", f"worker{i}"],
                     _base_env(PREFECT_API_URL=st.prefect_api, PREFECT_HOME=str(tmp / f"worker{i}"),
                               PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                               AEPO_MODEL_CACHE=str(model_cache), PREFECT_WORKER_QUERY_SECONDS="1",
                               PREFECT_WORKER_PREFETCH_SECONDS="5"))
        yield st
    finally:
        for name in reversed(list(st.procs or {})):
            st.stop(name)
        env.undo()


@contextlib.contextmanager
def _on_server(stack: Stack, home: Path) -> Iterator[None]:
    """This process's Prefect client on the stack's server (overrides the session harness, if one runs)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: stack.prefect_api, PREFECT_HOME: str(home)}):
        yield


def _sweep_spec(stack: Stack, tracking_uri: str | None) -> dict[str, Any]:
    """configs/sweeps/tiny.yaml with two seeds, trajectories on S3 and (None: the runs dir's SQLite) MLflow."""
    spec = yaml.safe_load((REPO / "configs" / "sweeps" / "tiny.yaml").read_text())
    spec["base"] = str(REPO / "configs" / "tiny.yaml")
    spec["name"] = "fan"
    spec["seeds"] = [0, 1]
    spec["overrides"].update({"tracking.system_metrics": False, "storage.trajectories_uri": f"s3://{BUCKET}/traj",
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
            "max_branches_per_path"]


def test_fanout_sweep_runs_children_on_workers_and_matches_in_process(
        stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_cache: Path) -> None:
    import torch

    from flows.sweep import sweep
    from infra.tracking import Tracker

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
            t0 = time.monotonic()
            fan = sweep(sweep_config=_sweep_spec(stack, stack.mlflow_url), runs_dir=str(tmp_path / "fanout"),
                        deployment=DEPLOYMENT, max_parallel=2, child_timeout_s=600)
            t_fan = time.monotonic() - t0
            child_flow_runs = _flow_runs_on(stack, DEPLOYMENT)
            tracker = Tracker(stack.mlflow_url)  # (the re-run below re-parents the children: read them now)
            children = tracker.search_runs(filter_string=f"tags.mlflow.parentRunId = '{fan.parent_run_id}'")
            t0 = time.monotonic()
            again = sweep(sweep_config=_sweep_spec(stack, stack.mlflow_url), runs_dir=str(tmp_path / "fanout"),
                          deployment=DEPLOYMENT, max_parallel=2, child_timeout_s=600)
            t_again = time.monotonic() - t0
            flow_runs_after = _flow_runs_on(stack, DEPLOYMENT)
    finally:
        torch.set_num_threads(threads)
    print(f"in-process sweep {t_ref:.0f} s, fan-out {t_fan:.0f} s, re-run {t_again:.0f} s")
    names = [f"fan-{cell}-s{seed}" for cell in ("aepo", "grpo") for seed in (0, 1)]

    # the four children ran as flow runs of the deployment, named like their MLflow runs, on both workers
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
    import boto3

    s3 = boto3.client("s3", endpoint_url=stack.s3_url, region_name="us-east-1")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])]
    assert any(k.startswith("mlartifacts/") and k.endswith("comparison.csv") for k in keys)
    assert {f"run_id={rid}" for rid in children["run_id"]} <= {
        part for k in keys if k.startswith("traj/") for part in k.split("/")}

    # the comparison equals the in-process sweep's: same cells, seeds, rows and (seeded, one thread) values
    fan_runs = pd.DataFrame(fan.runs)[COMPARED]
    ref_runs = pd.DataFrame(ref.runs)[COMPARED]
    assert len(fan_runs) == 4 and list(fan_runs["run_name"]) == names
    pd.testing.assert_frame_equal(fan_runs, ref_runs)
    pd.testing.assert_frame_equal(pd.DataFrame(fan.summary), pd.DataFrame(ref.summary))
    # The tiny random policy never answers (measured: pass@1 0, reward -1 in every run), so the table alone would
    # match by accident; its rollout entropies differ by seed (10.48468 vs 10.48325 nats) and were measured
    # bit-equal between the worker processes and this one at one torch thread: compare them too.
    entropy = ["rollout/h_root_mean", "train/entropy_mean"]
    ref_children = Tracker(ref.tracking_uri).search_runs(  # (re-parented by the in-process re-run)
        filter_string=f"tags.mlflow.parentRunId = '{ref_again.parent_run_id}'")
    assert sorted(ref_children["run_name"]) == sorted(names)
    for frame in (children, ref_children):
        assert frame[[f"metrics.{m}" for m in entropy]].notna().all().all()
    by_name = {n: r for n, r in zip(ref_children["run_name"], ref_children.to_dict("records"), strict=True)}
    for row in children.to_dict("records"):
        assert [row[f"metrics.{m}"] for m in entropy] == [by_name[row["run_name"]][f"metrics.{m}"] for m in entropy]
    assert len(set(children["metrics.rollout/h_root_mean"])) > 1

    # a re-run, in process or fanned out, finds the four FINISHED children, runs or submits nothing and compares
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
    broken["seeds"] = [0, 1]
    with _on_server(stack, tmp_path / "prefect-home"), pytest.raises(RuntimeError) as failure:
        sweep(sweep_config=broken, runs_dir=str(tmp_path / "fanout"), deployment=DEPLOYMENT, max_parallel=2,
              child_timeout_s=600)
    assert "2 of 6 runs failed" in str(failure.value)
    assert "fan-broken-s0 (Failed)" in str(failure.value) and "fan-broken-s1 (Failed)" in str(failure.value)
    table = pd.read_csv(tmp_path / "fanout" / "sweeps" / "fan" / "comparison.csv")
    assert sorted(table["run_name"]) == sorted(names) and set(table["status"]) == {"FINISHED"}
    last = tracker.search_runs(filter_string="tags.kind = 'sweep'", order_by=["attributes.start_time DESC"])
    assert last["run_name"].iloc[0] == "fan" and last["status"].iloc[0] == "FAILED"
    assert sorted(fr.name for fr in _flow_runs_on(stack, DEPLOYMENT)) == sorted(
        [*names, "fan-broken-s0", "fan-broken-s1"])
