"""DeepSpeed data parallelism on 2 CPU ranks (gloo, ``torch.distributed.run``): the 2-rank update is the 1-rank one.

Each rank trains on its share of every mini-batch's question groups with normalisers over the global mini-batch,
so two updates on 2 ranks must give the weights of the same two updates in one process (ZeRO-2 and ZeRO-3), and a
2-rank run saved after one update and resumed on fresh models and engines must continue to the same weights.
The samples are fixed (5 groups of 3: shards of 3 + 2 groups, a last mini-batch of one group, so one rank runs
zero-weight filler micro-batches), and the clip, warmup and cosine schedule are those of test_deepspeed_backend.

A launch costs 10-20 s of imports and process-group setup on 2 cores, so each ZeRO stage is one launch
(``two_rank_run``) whose process group runs every scenario (straight, save, resume: ds_rank_worker.py) and the
tests read its files. Resuming in fresh processes under the launcher is ``aepo train --resume``'s test (ZeRO-2).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from capabilities import require
from ds_rank_worker import SAMPLES, SCENARIOS
from slowdown import scaled
from test_deepspeed_backend import OVERRIDES, TOTAL_STEPS
from test_update import make_samples, params, tiny_model

from aepo_core.overrides import build_config
from infra.ranks import Ranks
from infra.training.backends import TorchBackend
from infra.training.update import PolicyUpdater

pytestmark = pytest.mark.slow  # the heavy tier (CI runs every tier)

require(importlib.util.find_spec("deepspeed") is not None,
        "deepspeed is not installed (pip install -e '.[distributed]')")

WORKER = Path(__file__).with_name("ds_rank_worker.py")
PORT_TAKEN = re.compile(r"EADDRINUSE|[Aa]ddress already in use")
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(out: Path, stage: int, ranks: int = 2) -> None:
    """``torch.distributed.run`` of every worker scenario with ``ranks`` CPU processes on a free port; fails with
    the ranks' output tails."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for _attempt in range(3):  # the free port can be taken between our probe and the launcher's bind: retry
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               f"--master_port={free_port()}", str(WORKER), str(out), str(stage)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled(400))
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"ZeRO-{stage} launch timed out after {e.timeout} s\n{tails(e.stdout, e.stderr)}")
        if proc.returncode == 0 or not PORT_TAKEN.search(proc.stdout + proc.stderr):
            break
    assert proc.returncode == 0, f"ZeRO-{stage} launch exited {proc.returncode}\n{tails(proc.stdout, proc.stderr)}"


def tails(stdout: str | bytes | None, stderr: str | bytes | None) -> str:
    """The ends of a launch's output (TimeoutExpired may hold bytes)."""
    def text(s: str | bytes | None) -> str:
        return s.decode(errors="replace") if isinstance(s, bytes) else s or ""
    return f"--- stdout tail ---\n{text(stdout)[-3000:]}\n--- stderr tail ---\n{text(stderr)[-6000:]}"


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def two_rank_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank launch per ZeRO stage; the folder with every scenario's weights, metrics and saved state."""
    out = tmp_path_factory.mktemp(f"zero{request.param}-ranks")
    launch(out, request.param)
    return out


@pytest.fixture(scope="module")
def one_rank_reference() -> tuple[torch.Tensor, list[dict[str, float]]]:
    """Two updates in one process, torch backend (which test_deepspeed_backend shows is 1-rank DeepSpeed's update):
    the weights and each update's metrics."""
    cfg = build_config({}, OVERRIDES)
    model = tiny_model()
    updater = PolicyUpdater(TorchBackend(model, cfg.optim, TOTAL_STEPS), cfg, pad_id=0)
    metrics = [updater.update(make_samples(seed=s, **SAMPLES)) for s in SCENARIOS["straight"]]
    return params(model), metrics


def gathered(out: Path, mode: str) -> torch.Tensor:
    full = torch.load(out / f"weights-{mode}.pt", weights_only=True)
    return torch.cat([full[name].flatten() for name, _ in tiny_model().named_parameters()])


def test_shards_are_contiguous_and_cover_everything():
    items = list(range(5))
    assert [Ranks(r, 2).shard(items) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [Ranks(r, 3).shard(items) for r in range(3)] == [[0, 1], [2, 3], [4]]
    assert Ranks(1, 4).shard([7]) == [] and Ranks().shard(items) == items
    assert Ranks().all_gather(3) == [3] and Ranks().sum(2.5) == 2.5


def test_two_ranks_make_the_one_rank_update(two_rank_run, one_rank_reference):
    """Two RL steps (4 optimizer steps, clipping active) on 2 ranks: the 1-rank weights, loss and grad norm."""
    want, want_metrics = one_rank_reference
    # fp32 all-reduce and ZeRO partition order: a few ulps, amplified by Adam (tolerance of test_deepspeed_backend).
    torch.testing.assert_close(gathered(two_rank_run, "straight"), want, rtol=1e-4, atol=2e-5)
    assert not torch.allclose(want, params(tiny_model()))
    for rank in range(2):
        got = json.loads((two_rank_run / f"metrics-straight-rank{rank}.json").read_text())
        for g, w in zip(got, want_metrics, strict=True):
            assert g["train/optimizer_steps"] == w["train/optimizer_steps"] == 3
            assert g["train/loss"] == pytest.approx(w["train/loss"], rel=1e-4, abs=1e-6)
            assert g["train/grad_norm"] == pytest.approx(w["train/grad_norm"], rel=1e-4)
            assert g["train/lr"] == pytest.approx(w["train/lr"], rel=1e-9)
    assert max(w["train/grad_norm_max"] for w in want_metrics) > 1.0  # clipping was exercised


def test_two_rank_resume_continues_exactly(two_rank_run):
    """Save after update 1 (every rank's ZeRO partition gathered to rank 0), resume on a fresh model and engine
    on both ranks from the saved files, update 2: the uninterrupted 2-rank run's weights."""
    saved = torch.load(two_rank_run / "optimizer.pt", weights_only=True)
    assert saved["world_size"] == 2 and len(saved["ranks"]) == 2
    torch.testing.assert_close(gathered(two_rank_run, "resume"), gathered(two_rank_run, "straight"), rtol=0, atol=0)


def aepo_train(runs: Path, api_url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``torch.distributed.run --nproc_per_node 2 -m flows.cli train`` on configs/tiny.yaml under ZeRO-2, rank 0's
    flow run on the session's Prefect API (rank 1 drops it for a private one: the CLI's rule under test), no
    model logged (not what is tested)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k not in
           ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PREFECT_API_URL=api_url)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "flows.cli", "train", "-c", str(ROOT / "configs" / "tiny.yaml"), "--runs-dir", str(runs),
           "--set", "train.backend=deepspeed", "--set", "train.zero_stage=2", "--set", "eval.max_questions=2",
           "--set", "tracking.log_model=false", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled(400), cwd=runs.parent)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def test_aepo_train_on_two_ranks_logs_once_and_resumes(tmp_path, prefect_api_url):
    """End to end under the launcher: step 1, then ``--resume`` to step 2. One MLflow run (rank 0's) with both
    steps, rank 0's checkpoints holding both ranks' optimizer partitions, one trajectory part per step; rank 1
    has only its private Prefect home."""
    from mlflow.tracking import MlflowClient

    from infra.tracking.client import tracking_uri_for

    runs = tmp_path / "runs"
    aepo_train(runs, prefect_api_url, "--set", "train.steps=1")
    aepo_train(runs, prefect_api_url, "--set", "train.steps=2", "--resume")
    client = MlflowClient(tracking_uri_for(runs))
    found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(found) == 1, [r.info.run_name for r in found]
    run = found[0]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2]
    folder = runs / "checkpoints" / "tiny" / run.info.run_id  # keyed by the run id; both ranks resumed from it
    checkpoints = sorted(p.name for p in folder.iterdir())
    assert checkpoints == ["step-000001", "step-000002"]
    saved = torch.load(folder / "step-000002" / "optimizer.pt", weights_only=True)
    assert saved["world_size"] == 2 and len(saved["ranks"]) == 2
    parts = sorted(p.relative_to(runs) for table in ("trajectories", "nodes")
                   for p in (runs / table).rglob("*.parquet"))
    assert {p.parts[1] for p in parts} == {run.info.run_id}
    assert sum(1 for p in parts if p.parts[0] == "trajectories") == 2  # one part per step, written by rank 0
    assert (runs / "prefect-rank1").is_dir() and not (runs / "mlflow-rank1").exists()


def test_zero3_on_two_ranks_trains_a_step_with_a_remote_engine(tmp_path, prefect_api_url, tiny_cfg):
    """The paper config's shape (a remote sampler, ZeRO-3 on several ranks) on configs/tiny.yaml: both ranks
    sample from the suite's OpenAI-compatible server, update partitioned weights, and the server is handed the
    step's full (gathered) weights through ``rollout.remote.reload_url``: once per version, equal to the step's
    checkpoint. ``rollout.exact_entropy`` is off (``check_ranks`` refuses it here: its scorer's forward of the
    partitioned model would be a collective the ranks' different rollouts cannot keep in step)."""
    from openai_compat_server import CompletionsServer
    from safetensors.torch import load_file

    from infra.engines.hf import HFEngine
    from infra.models import load_policy

    model, tokenizer = load_policy(tiny_cfg)  # the server's own copy: reloads change it in place
    runs = tmp_path / "runs"
    with CompletionsServer(HFEngine(model, tokenizer, seed=0)) as srv:
        aepo_train(runs, prefect_api_url, "--set", "train.steps=1", "--set", "train.zero_stage=3",
                   "--set", "rollout.engine=remote", "--set", f"rollout.remote.url={srv.url}",
                   "--set", f"rollout.remote.reload_url={srv.url}/reload", "--set", "rollout.exact_entropy=false",
                   "--set", "eval.max_questions=1")
        completions = len(srv.requests) - len(srv.reloads)
    assert completions > 0  # both ranks' rollouts (and the evaluation) were sampled by the server
    assert [r["version"] for r in srv.reloads] == ["1"], srv.reloads  # rank 0 alone exports, after the update
    (step,) = (runs / "checkpoints" / "tiny").glob("*/step-000001")
    saved = load_file(str(step / "model" / "model.safetensors"))
    served = model.state_dict()
    for name, tensor in saved.items():
        torch.testing.assert_close(served[name], tensor, rtol=0, atol=0, msg=name)
