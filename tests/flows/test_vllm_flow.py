"""The train flow on a real vLLM server (``rollout.engine: vllm``): every rollout is stamped with the weights
that sampled it, the server follows each update, comes back when it is killed, and is gone when the flow returns.

SmolLM2-135M (vLLM's CPU attention has no kernel for the tiny model's head size 16); see
tests/infra/test_vllm_engine.py for the engine-level checks and the lifecycle under SIGTERM/SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from pathlib import Path

import pyarrow.dataset as pads
import pytest
from vllm_support import VLLM, requires_vllm, server_processes

from infra.config_files import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"

pytestmark = [requires_vllm, pytest.mark.slow, pytest.mark.vllm]


def _kill_server_at(log: Path, marker: str, kills: list[int], stop: threading.Event) -> None:
    """SIGKILL the run's vLLM server at the first completion it answers once it has had ``kills[0]`` weight-version
    labels (the start's, then one per reload or restart), and so on for each count of ``kills`` (mid-rollout, mid-
    evaluation: other requests are in flight)."""
    done = 0
    while done < len(kills) and not stop.wait(0.2):
        labels = 0
        for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
            labels += "POST /update_weight_version" in line
            if labels >= kills[done] and "POST /v1/completions" in line:
                for group in {os.getpgid(p.pid) for p in server_processes(marker)}:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(group, signal.SIGKILL)
                done += 1
                break


def test_two_steps_on_vllm_sample_from_the_last_update_even_when_the_server_is_killed_twice(
        prefect_harness, model_cache, tmp_path, caplog):
    """Each step samples from the weights of the last update, and the server is gone when the flow returns — also
    when the whole server (API server, engine core, worker) is SIGKILLed in step 2's rollout, after it loaded update
    1, and again in the final evaluation, after update 2: each time the engine restarts it on its port with the
    weights it served (labelled with their version) and resends the failed requests; the run completes, every
    sample carries the version the trainer expects, and no failed request became a leaf."""
    from mlflow.tracking import MlflowClient

    from flows.train import train

    # One question a step (the update's forward and backward through SmolLM2 dominate the test); the final
    # checkpoint only; the smallest final evaluation; no MLflow model, no system metrics: none is under test here.
    cfg = load_config(TINY, [f"model.cache_dir={model_cache}", *VLLM, "train.steps=2", "train.batch_size=1",
                             "checkpoint.every=2", "eval.max_questions=1", "eval.n_samples=2", "eval.pass_k=1",
                             "tracking.log_model=false", "tracking.system_metrics=false",
                             "rollout.vllm.max_restarts=2"])
    stop = threading.Event()
    killer = threading.Thread(target=_kill_server_at, args=(tmp_path / "weights" / "tiny" / "vllm-server.log",
                                                            str(tmp_path), [2, 4], stop), daemon=True)
    killer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="infra.engines.restarting"):
            out = train(config=cfg, runs_dir=str(tmp_path))
    finally:
        stop.set()
        killer.join(timeout=10)
    restarts = [r.getMessage() for r in caplog.records if "restarting it" in r.getMessage()]
    assert len(restarts) == 2, restarts
    assert "(1 of 2)" in restarts[0] and "weight version 1" in restarts[0]
    assert "(2 of 2)" in restarts[1] and "weight version 2" in restarts[1]
    client = MlflowClient(out.tracking_uri)
    assert out.steps == 2 and client.get_run(out.run_id).info.status == "FINISHED"
    history = {name: [(m.step, m.value) for m in client.get_metric_history(out.run_id, name)]
               for name in ("rollout/weight_version", "rollout/stale_segments")}
    assert history["rollout/weight_version"] == [(1, 0.0), (2, 1.0)]  # the restarted server served update 1
    assert history["rollout/stale_segments"] == [(1, 0.0), (2, 0.0)]
    table = pads.dataset(Path(out.trajectories) / "trajectories", partitioning="hive").to_table(
        columns=["step", "weight_version", "status"]).to_pylist()
    assert {(r["step"], r["weight_version"]) for r in table} == {(1, "0"), (2, "1")}
    assert all(r["status"] != "engine_error" for r in table)
    (final,) = (tmp_path / "eval").rglob("final/*.parquet")  # the final evaluation: its one question, both samples
    evaluated = pads.dataset(final, format="parquet").to_table(columns=["n"]).to_pylist()
    assert evaluated == [{"n": 2}]
    assert not server_processes(str(tmp_path)), "the vLLM server outlived the flow"
    # The weights the server loaded are exports of ~650 MB each (SmolLM2 in float32); the checkpoint holds the
    # policy, so none may outlive the run (a CI disk once filled up with them).
    exports = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "weights").rglob("*.safetensors"))
    assert exports == [], f"weight exports left behind: {exports}"
