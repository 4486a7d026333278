"""A SIGKILL at every phase of a run — the start evaluation, cold-start SFT, the evaluation after it, a rollout, a
checkpoint save, an update, the final evaluation, model logging and registration — and ``--resume`` after each: the
run finishes in the same MLflow run with the uninterrupted run's weights, evaluations, trajectories and metric
histories, no metric point, trace, logged model or registered version twice, nothing lost.

One chain of processes on one runs dir: each is killed at the next phase (``AEPO_TEST_DIE_AT``, see run_train.py:
the process SIGKILLs itself when a chosen call begins, so the phase is certain, not a timer's guess) and the next
resumes; beside it one uninterrupted run. Not vacuous: the policy (the session's tool user) calls tools and ends
some responses early, so rewards differ, updates have gradients and the weights move
between the two RL steps; every killed process must die of the SIGKILL (a point never reached would finish the run
and fail here)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from flow_processes import kill_group, log_tail
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from slowdown import scaled

from infra.store import TrajectoryStore
from infra.tracking.client import tracking_uri_for
from infra.tracking.traces import TAG_KIND, TAG_LABEL

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"

pytestmark = pytest.mark.slow

# The session's tool user as the base (memorized SFT: it calls tools and, in 200 tokens, answers some single-hop
# questions right and others not: rewards differ within a group; at 160 tokens every answer was cut, every reward
# the same and no gradient flowed) and a short SFT of the run's own (4 optimizer steps at SFT's default learning
# rate) that the kill can interrupt.
SFT = ["train.sft.enabled=true", "train.sft.max_examples=8", "train.sft.batch_size=2", "data.max_questions=8"]
RUN = [*SFT, "train.steps=2", "checkpoint.every=1", "checkpoint.keep=3", "train.batch_size=2",
       "eval.at_start=true", "eval.max_questions=2", "tracking.log_model=true",
       "rollout.max_response_tokens=200", "algorithm.overlong_buffer=160"]

# (phase, where the process dies, the last task run it finished): in run order, each process resuming what the one
# before it left. A count is per process, and a resume without a complete checkpoint starts again at step 0: after
# the kill in the checkpoint save of step 1, the next process runs step 1 again, so the update of step 2 is its second
# update (with ``update.fn:1`` it died in step 1's update, and the "final evaluation" kill then in the start one,
# unnoticed until the last task run finished became part of the check).
KILLS = [
    ("start evaluation", "flows.train:write_eval_results:1",  # its metrics logged, its Parquet not yet written
     "evaluate-start"),
    ("cold-start SFT", "infra.run.sft:_nll_sum:3",  # after two SFT optimizer steps
     "write-eval-results-start-synthetic_test"),
    ("evaluation after SFT", "flows.train:write_eval_results:2", "evaluate-sft"),
    ("rollout of step 1",
     "flows.collect:rollout.fn:1 > aepo_core.rollout.scheduler:RolloutScheduler._engine_generate:3",
     "write-eval-results-sft-synthetic_test"),
    ("checkpoint save of step 1", "flows.train:checkpoint.fn:1 > infra.training.checkpoint:_manifest_digest:1",
     "store-step-1"),
    ("update of step 2", "flows.train:update.fn:2 > infra.training.backends:TorchBackend.step:1", "score-step-2"),
    ("final evaluation", "flows.train:write_eval_results:1",  # after the last checkpoint
     "evaluate-final"),
    ("model logging", "infra.run.session:register_model:1",  # the model logged, not yet registered
     "write-eval-results-final-synthetic_test"),
    ("model registration", "infra.tracking.registry:_link_logged_model:1",  # the version made, not linked
     "write-eval-results-final-synthetic_test"),
]

def _measured(key: str) -> bool:
    """Metrics of time, throughput or memory: they differ between any two runs; and the tool cache's hit rate: the
    cache (``<runs>/tool_cache.sqlite``) keeps the calls of a killed attempt, so the step it repeats finds them there
    (step 2: 1.0 against 0.93 straight), the same results either way."""
    return (key.startswith(("time/", "system/")) or key.endswith("_s") or "peak_rss" in key
            or key == "rollout/tool_cache_hit_rate")


def _start(runs: Path, resume: bool, log: str, api_url: str, model_cache: Path, policy: Path, die_at: str | None
           ) -> subprocess.Popen:
    runs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AEPO_MODEL_CACHE": str(model_cache), "OMP_NUM_THREADS": "1",
           "PREFECT_API_URL": api_url}
    env.pop("AEPO_TEST_DIE_AT", None)
    if die_at:
        env["AEPO_TEST_DIE_AT"] = die_at
    args = [sys.executable, str(ROOT / "tests/flows/run_train.py"), str(TINY), str(runs),
            "resume" if resume else "fresh", *RUN, f"model.name={policy}"]
    out = open(runs / log, "w")
    return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _histories(client: Any, run_id: str) -> dict[str, list[tuple[int, float]]]:
    keys = client.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k))
            for k in keys if not _measured(k)}


def _trace_names(client: Any, run_id: str) -> list[str]:
    experiment = client.get_run(run_id).info.experiment_id
    return sorted(f"{t.info.tags[TAG_KIND]} {t.info.tags[TAG_LABEL]} {t.data.spans[0].name}"
                  for t in client.search_traces(locations=[experiment], run_id=run_id))


def _run_id(runs: Path) -> str:
    return str(json.loads((runs / "result.json").read_text())["run_id"])


def _eval_tables(runs: Path) -> dict[str, list[dict[str, Any]]]:
    """Every per-question evaluation Parquet file of the run, by stage and file, timestamps and ids left out."""
    out = {}
    for path in sorted((runs / "eval").rglob("*.parquet")):
        rows = pq.read_table(path).to_pylist()
        out[str(path.relative_to(runs / "eval"))] = [
            {k: v for k, v in row.items() if k not in ("eval_run_id", "run_id", "created_at", "evaluated_at", "wall_s")}
            for row in rows]
    return out


@pytest.mark.timeout(1800)
def test_a_kill_at_every_phase_resumes_to_the_uninterrupted_run(tmp_path: Path, model_cache: Path, tool_user: Path,
                                                                 prefect_api_url: str) -> None:
    straight_dir, chain_dir = tmp_path / "straight", tmp_path / "chain"
    straight = _start(straight_dir, False, "run.log", prefect_api_url, model_cache, tool_user, None)
    procs = [straight]
    try:
        for i, (phase, point, after) in enumerate(KILLS):
            proc = _start(chain_dir, i > 0, f"kill-{i}.log", prefect_api_url, model_cache, tool_user, point)
            procs.append(proc)
            rc = proc.wait(timeout=scaled(600))
            assert rc == -signal.SIGKILL, f"{phase}: exit {rc}, not killed\n{log_tail(chain_dir, f'kill-{i}.log')}"
            finished = re.findall(r"Task run '([^']+)' - Finished", (chain_dir / f"kill-{i}.log").read_text())
            assert finished[-1:] == [after], f"{phase}: killed after {finished[-1:]}, not after {after!r}"
        last = _start(chain_dir, True, "resume.log", prefect_api_url, model_cache, tool_user, None)
        procs.append(last)
        assert last.wait(timeout=scaled(600)) == 0, log_tail(chain_dir, "resume.log")
        assert straight.wait(timeout=scaled(600)) == 0, log_tail(straight_dir)
    finally:
        for proc in procs:
            kill_group(proc)

    a, b = MlflowClient(tracking_uri_for(straight_dir)), MlflowClient(tracking_uri_for(chain_dir))
    run_a, run_b = _run_id(straight_dir), _run_id(chain_dir)
    (only,) = b.search_runs([e.experiment_id for e in b.search_experiments()])  # one MLflow run, resumed 9 times
    assert only.info.run_id == run_b and only.info.status == "FINISHED"

    # Not vacuous: the run learned (rewards differed, gradients flowed) and its weights moved in step 2.
    ha, hb = _histories(a, run_a), _histories(b, run_b)
    assert any(v > 0 for _, v in ha["train/grad_norm"]), ha["train/grad_norm"]
    weights = [load_file(str(p)) for p in sorted((straight_dir / "checkpoints").rglob("model.safetensors"))]
    assert len(weights) == 2 and any((weights[0][k] != weights[1][k]).any() for k in weights[0])

    # Every metric point once (each run), and the same as the uninterrupted run's.
    for client, run_id in ((a, run_a), (b, run_b)):
        keys = client.get_run(run_id).data.metrics
        twice = {k: steps for k in keys if len(steps := [m.step for m in client.get_metric_history(run_id, k)])
                 != len(set(steps))}
        assert not twice, twice
    assert ha.keys() == hb.keys(), ha.keys() ^ hb.keys()
    differ = {k: (ha[k], hb[k]) for k in ha if ha[k] != hb[k]}
    assert not differ, differ
    # The same final weights, evaluation tables and trajectories.
    final_a = load_file(str(next((straight_dir / "checkpoints").rglob("step-000002/model/model.safetensors"))))
    final_b = load_file(str(next((chain_dir / "checkpoints").rglob("step-000002/model/model.safetensors"))))
    assert final_a.keys() == final_b.keys() and all((final_a[k] == final_b[k]).all() for k in final_a)
    assert _eval_tables(straight_dir) == _eval_tables(chain_dir)
    ta = TrajectoryStore(straight_dir).read_trajectories(run_a)
    tb = TrajectoryStore(chain_dir).read_trajectories(run_b)
    assert len(ta) == len(tb) and sorted(map(list, ta["response_tokens"])) == sorted(map(list, tb["response_tokens"]))

    # Nothing twice: traces (by name), logged models, registered versions.
    names_a, names_b = _trace_names(a, run_a), _trace_names(b, run_b)
    assert names_a and names_b == names_a, (len(names_a), len(names_b))
    assert len(a.search_model_versions()) == len(b.search_model_versions()) == 1
    models_b = b.search_logged_models(experiment_ids=[only.info.experiment_id])
    assert [m.name for m in models_b] == ["policy"], [(m.name, m.model_id) for m in models_b]
