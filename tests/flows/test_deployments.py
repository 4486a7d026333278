"""`prefect deploy` (prefect.yaml, a process work pool) and `aepo serve` on one Prefect server, real processes.

Both used to declare ``aepo-train/train`` (and evaluate, sweep): the served deployment replaced the declared one
on the server, and a run of it crashed (``Downloading flow code from storage at None … FileNotFoundError``).
Served deployments now have names of their own; the declared ones stay as `prefect deploy` left them, and a run
of a served deployment completes in the serving process, in the runs dir `aepo serve` was given.
Measured: server start ~15 s, deploy ~10 s, serve start ~10 s, the evaluate run ~40 s (2 cores shared).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_stack import BIN, POOL, REPO, Stack, base_env
from slowdown import scaled

pytestmark = [pytest.mark.slow, pytest.mark.server]  # the heavy tier (CI runs every tier)


@pytest.fixture
def server(server_stack: Stack) -> Iterator[Stack]:
    """The session's server stack (prefect.yaml's deployments declared on it by `prefect deploy --all`); the
    test's `aepo serve` is stopped after it."""
    yield server_stack
    if "serve" in server_stack.procs:
        server_stack.stop("serve")


def _client(st: Stack) -> Any:
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(st.prefect_api)


def _wait_for_log(st: Stack, name: str, needle: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if needle in (st.tmp / f"{name}.log").read_text(errors="replace"):
            return
        if not st.procs[name].running:
            pytest.fail(f"{name} exited:\n{st.log_tail(name)}")
        time.sleep(0.5)
    pytest.fail(f"{name}: no {needle!r} after {timeout_s} s:\n{st.log_tail(name)}")


def test_serve_after_deploy_keeps_both_and_a_served_run_completes(server: Stack, tmp_path: Path,
                                                                  model_cache: Path) -> None:
    from prefect.exceptions import ObjectNotFound

    from flows.serve import SERVED_SUFFIX, build_deployments

    runs = tmp_path / "served-runs"
    served = {d.name for d in build_deployments(runs, REPO / "configs" / "tiny.yaml",
                                                REPO / "configs" / "sweeps" / "tiny.yaml")}
    assert not served & {"train", "evaluate", "sweep"}  # the names prefect.yaml declares
    server.start("serve", [str(BIN / "python"), "-m", "flows.cli", "serve", "--runs-dir", str(runs),
                           "--api-url", server.prefect_api],
                 base_env(COLUMNS="200", AEPO_MODEL_CACHE=str(model_cache), OMP_NUM_THREADS="1"))
    _wait_for_log(server, "serve", "serving")
    evaluate = next(name for name in served if name.startswith("evaluate"))
    with _client(server) as client:
        deadline = time.monotonic() + scaled(60)
        while True:  # the serving process registers its deployments after printing its banner
            try:
                dep = client.read_deployment_by_name(f"aepo-evaluate/{evaluate}")
                break
            except ObjectNotFound:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        declared = client.read_deployment_by_name("aepo-evaluate/evaluate")
        assert declared.id != dep.id and declared.work_pool_name == POOL and declared.pull_steps  # as deployed
        assert declared.parameters["runs_dir"] is None  # deployed runs use $AEPO_RUNS_DIR (aepo ui's store)
        assert dep.parameters["runs_dir"] == str(runs.resolve())
        flow_run = client.create_flow_run_from_deployment(
            dep.id, parameters={"overrides": ["eval.max_questions=1"]})
        deadline = time.monotonic() + scaled(420)
        while True:
            state = client.read_flow_run(flow_run.id).state
            if state is not None and state.is_final():
                break
            assert time.monotonic() < deadline, f"flow run still {state}:\n{server.log_tail('serve', 80)}"
            time.sleep(2)
        name = client.read_flow_run(flow_run.id).name
        # `aepo serve` schedules nothing unless asked (--cron); prefect.yaml's weekly sweep is declared paused
        assert client.read_deployment_by_name(f"aepo-sweep/sweep{SERVED_SUFFIX}").schedules == []
        weekly = client.read_deployment_by_name("aepo-sweep/sweep")
        assert [s.active for s in weekly.schedules] == [False] and weekly.parameters["dated"] is True
    assert state.is_completed(), f"{state}:\n{server.log_tail('serve', 80)}"
    assert name.startswith("tiny-eval-step0-")  # renamed after its MLflow run once that was named
    assert list((runs / "eval").glob("*/synthetic_test.parquet")) and (runs / "mlflow.db").is_file()
