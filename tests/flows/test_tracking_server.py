"""One tracking server for every machine: ``aepo ui`` with its MLflow artifacts on S3, real processes, no mocks.

The session's stack (``tests/server_stack.py``): a moto S3 server and ``aepo ui --artifacts-destination
s3://… --s3-endpoint-url …`` (an ``mlflow server`` on SQLite and a ``prefect server``). A tiny ``aepo train`` in
its own process, in a runs dir that never gets an MLflow store, logs to the server (``tracking.tracking_uri=
http://…``) and its flow run to the ui's Prefect server, as a worker on another machine would; its artifacts
must land in the bucket, ``aepo runs --tracking-uri`` must list it, ``aepo trajectories <run name>
--tracking-uri`` must resolve the name through the server, and ``aepo eval`` of its checkpoint must log there
too. SIGTERM to an ``aepo ui`` of its own must stop both servers and every process they started. Bad ``aepo ui`` values
exit 2 with one line and create nothing; an unreachable tracking server exits 1 at once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from server_stack import REPO, Stack, base_env, free_port
from slowdown import scaled
from test_cli import FAST, TINY, invoke, sets

pytestmark = [pytest.mark.slow, pytest.mark.server]  # the heavy tier (CI runs every tier)



@pytest.fixture
def server(server_stack: Stack) -> Stack:
    return server_stack


def _aepo(st: Stack, model_cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``aepo <args>`` in its own process, its Prefect client on the ui's server."""
    env = base_env(PREFECT_API_URL=st.prefect_api, COLUMNS="250", OMP_NUM_THREADS="1",
                   AEPO_MODEL_CACHE=str(model_cache))
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=scaled(600))


def _prefect_state(st: Stack, flow_run_id: str) -> str:
    with urllib.request.urlopen(f"{st.prefect_api}/flow_runs/{flow_run_id}", timeout=10) as resp:
        return str(json.load(resp)["state"]["name"])


def test_train_eval_runs_and_trajectories_against_the_server(server: Stack, tmp_path: Path,
                                                             model_cache: Path) -> None:
    from infra.tracking.run import Tracker

    uri = server.mlflow_url
    runs = tmp_path / "worker-runs"
    train = _aepo(server, model_cache, "train", "-c", TINY, "--runs-dir", str(runs), "--run-name", "remote",
                  *sets("train.steps=1", f"tracking.tracking_uri={uri}", "tracking.system_metrics=false", *FAST))
    assert train.returncode == 0, train.stderr[-4000:]
    assert f"browse: {uri}" in train.stdout
    tracker = Tracker(uri)
    run = tracker.search_runs(filter_string="attributes.run_name = 'remote'").iloc[0]
    run_id = run["run_id"]
    assert run["status"] == "FINISHED" and run["artifact_uri"].startswith("mlflow-artifacts:")
    keys = server.keys("mlartifacts/")
    assert any(k.endswith(f"/{run_id}/artifacts/config.yaml") for k in keys), keys[:20]
    assert _prefect_state(server, run["tags.prefect_flow_run_id"]) == "Completed"  # on the ui's Prefect server
    # issue 54 §3: the run page links its flow run (the description is markdown) and opens on Pass@1 and reward
    flow_run = run["tags.prefect_flow_run_id"]
    assert f"Prefect flow run: [{flow_run}]({run['tags.prefect_flow_run_url']})" in run["tags.mlflow.note.content"]
    assert run["tags.prefect_flow_run_url"].endswith(f"/runs/flow-run/{flow_run}")
    assert {"metrics.Summary/pass_at_1_synthetic_test", "metrics.Summary/reward"} <= set(run.index)
    assert run["metrics.Summary/pass_at_1_synthetic_test"] == run["metrics.eval/synthetic_test/pass_at_1"]
    from infra.tracking.server import experiment_id

    assert experiment_id(uri, "aepo") == run["experiment_id"] and experiment_id(uri, "nosuch") is None
    traces = tracker.client.search_traces(locations=[run["experiment_id"]], run_id=run_id)
    assert {t.info.tags["aepo.kind"] for t in traces} == {"train", "eval"}  # the step's and the final evaluation's

    listed = invoke("runs", "--tracking-uri", uri, "--runs-dir", str(tmp_path / "elsewhere"))
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.stdout.splitlines() if run_id[:12] in line)
    assert "remote" in row and "FINISHED" in row

    by_name = invoke("trajectories", "remote", "--runs-dir", str(runs), "--tracking-uri", uri)
    assert by_name.exit_code == 0, by_name.output
    assert f"run {run_id}: 1 steps" in by_name.stdout
    local_only = invoke("trajectories", "remote", "--runs-dir", str(runs))  # no local store to resolve the name
    assert local_only.exit_code == 2 and "no stored trajectories for run 'remote'" in local_only.stderr

    evaluated = _aepo(server, model_cache, "eval", "--checkpoint", str(runs / "checkpoints" / "remote"),
                      "--runs-dir", str(runs), "--run-name", "remote-eval",
                      *sets("eval.max_questions=1", "eval.top_p=1.0"))
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    ev = tracker.search_runs(filter_string="attributes.run_name = 'remote-eval'").iloc[0]
    assert ev["status"] == "FINISHED" and ev["tags.kind"] == "eval"
    ev_traces = tracker.client.search_traces(locations=[ev["experiment_id"]], run_id=ev["run_id"])
    assert ev_traces and {t.info.tags["aepo.label"] for t in ev_traces} == {"eval/synthetic_test"}
    assert any(f"/{ev['run_id']}/artifacts/" in k for k in server.keys("mlartifacts/"))
    assert not (runs / "mlflow.db").exists() and not (runs / "mlartifacts").exists()  # nothing tracked locally


def test_an_unreachable_tracking_server_fails_at_once(tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    listed = invoke("runs", "--tracking-uri", down, "--runs-dir", str(tmp_path))
    assert listed.exit_code == 1 and f"no MLflow server answers at {down}" in listed.stderr
    trained = invoke("train", "-c", TINY, "--runs-dir", str(tmp_path / "runs"), "--set",
                     f"tracking.tracking_uri={down}")
    assert trained.exit_code == 1 and f"no MLflow server answers at {down}" in trained.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("args", "needle"), [
    (["--backend-store-uri", "mysql://user:secret@db/mlflow"], "expected sqlite:///path/mlflow.db or postgresql"),
    (["--backend-store-uri", "postgresql://user:secret@db:5432/"], "name the database"),
    (["--backend-store-uri", "sqlite:///no/such/dir/mlflow.db"], "no such directory"),
    (["--artifacts-destination", "gs://bucket/prefix"], "expected a directory or s3://bucket/prefix"),
    (["--artifacts-destination", "s3:///prefix"], "name a bucket"),
    (["--s3-endpoint-url", "http://127.0.0.1:9000"], "only for an s3:// --artifacts-destination"),
    (["--artifacts-destination", "s3://b/p", "--s3-endpoint-url", "127.0.0.1:9000"], "expected http(s)://"),
    (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: unknown host name"),
    (["--host", "203.0.113.1"], "cannot listen on 203.0.113.1:"),  # TEST-NET-3: no address of this machine
])
def test_bad_ui_values_exit_2_with_one_line_and_create_nothing(tmp_path: Path, args: list[str], needle: str
                                                               ) -> None:
    runs = tmp_path / "runs"
    result = invoke("ui", "--runs-dir", str(runs), "--mlflow-port", str(free_port()), "--prefect-port",
                    str(free_port()), *args)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "secret" not in result.stderr and "Traceback" not in result.output
    assert not runs.exists()


def test_a_busy_port_or_a_missing_driver_exits_2(tmp_path: Path) -> None:
    import importlib.util

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = invoke("ui", "--runs-dir", str(tmp_path / "runs"), "--mlflow-port", str(port))
    assert result.exit_code == 2 and f"--mlflow-port {port}: cannot listen on 127.0.0.1:{port}" in result.stderr
    if importlib.util.find_spec("psycopg2") is None:
        result = invoke("ui", "--runs-dir", str(tmp_path / "runs"), "--mlflow-port", str(free_port()), "--no-prefect",
                        "--backend-store-uri", "postgresql://user:secret@db:5432/mlflow")
        assert result.exit_code == 2 and "driver psycopg2 is not installed" in result.stderr
        assert "secret" not in result.stderr
    assert not (tmp_path / "runs").exists()


def test_sigterm_stops_the_ui_and_both_servers(tmp_path: Path) -> None:
    """An ``aepo ui`` of its own (the session's stack serves the other tests): ready once its servers answer, its
    servers and no job runner, and SIGTERM stops them all."""
    server = Stack(tmp_path, bucket="unused")
    try:
        server.start_ui()
        ui = server.procs["ui"]
        # the ui says it is ready once both servers answer (not at its timeout)
        deadline = time.monotonic() + scaled(60)
        while "Ctrl-C stops the servers" not in (server.tmp / "ui.log").read_text(errors="replace"):
            assert time.monotonic() < deadline and ui.running, server.log_tail("ui")
            time.sleep(0.2)
        # the page it prints opens the classic layout (no experiment yet in a fresh runs dir: the list)
        assert f"{server.mlflow_url}/#/experiments?workflowType=machine_learning" in (server.tmp / "ui.log").read_text()
        tree = psutil.Process(ui.pid).children(recursive=True)
        cmdlines = [" ".join(p.cmdline()) for p in tree]
        assert any("mlflow" in c and "server" in c for c in cmdlines) and any("prefect" in c for c in cmdlines)
        # and nothing that polls while the ui idles: MLflow's job runners (GenAI scorer jobs, which no run here
        # uses) took 23 s of CPU a minute, idle (AMD EPYC, 2 cores)
        assert not [c for c in cmdlines if "huey" in c], cmdlines
        os.kill(ui.pid, signal.SIGTERM)
        assert ui.proc is not None and ui.proc.wait(timeout=scaled(60)) == 0
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
        for url in (f"{server.mlflow_url}/health", f"{server.prefect_api}/health"):
            with pytest.raises(OSError):
                urllib.request.urlopen(url, timeout=2)
    finally:
        if "ui" in server.procs:
            server.stop("ui")
