"""DeepSpeed data parallelism on 2 CPU ranks (gloo, ``torch.distributed.run``): the 2-rank update is the 1-rank one.

Each rank trains on its share of every mini-batch's question groups with normalisers over the global mini-batch,
so two updates on 2 ranks must give the weights of the same two updates in one process (ZeRO-2 and ZeRO-3), and a
2-rank run saved after one update and resumed in fresh processes must continue to the same weights.
The samples are fixed (5 groups of 3: shards of 3 + 2 groups, a last mini-batch of one group, so one rank runs
zero-weight filler micro-batches), and the clip, warmup and cosine schedule are those of test_deepspeed_backend.
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
from ds_rank_worker import SAMPLES
from test_deepspeed_backend import OVERRIDES, TOTAL_STEPS
from test_update import make_samples, params, tiny_model

from aepo_core.config import build_config
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


def launch(out: Path, stage: int, mode: str, ranks: int = 2) -> None:
    """``torch.distributed.run`` with ``ranks`` CPU processes on a free port; fails with the ranks' output."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for _attempt in range(3):  # the free port can be taken between our probe and the launcher's bind: retry
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               f"--master_port={free_port()}", str(WORKER), str(out), str(stage), mode]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0 or not PORT_TAKEN.search(proc.stdout + proc.stderr):
            break
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def reference(steps: list[int]) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """One process, torch backend (which test_deepspeed_backend shows is 1-rank DeepSpeed's update)."""
    cfg = build_config({}, OVERRIDES)
    model = tiny_model()
    updater = PolicyUpdater(TorchBackend(model, cfg.optim, TOTAL_STEPS), cfg, pad_id=0)
    metrics = [updater.update(make_samples(seed=s, **SAMPLES)) for s in steps]
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


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_make_the_one_rank_update(stage, tmp_path):
    """Two RL steps (4 optimizer steps, clipping active) on 2 ranks: the 1-rank weights, loss and grad norm."""
    launch(tmp_path, stage, "straight")
    want, want_metrics = reference([0, 1])
    # fp32 all-reduce and ZeRO partition order: a few ulps, amplified by Adam (tolerance of test_deepspeed_backend).
    torch.testing.assert_close(gathered(tmp_path, "straight"), want, rtol=1e-4, atol=2e-5)
    assert not torch.allclose(want, params(tiny_model()))
    for rank in range(2):
        got = json.loads((tmp_path / f"metrics-straight-rank{rank}.json").read_text())
        for g, w in zip(got, want_metrics, strict=True):
            assert g["train/optimizer_steps"] == w["train/optimizer_steps"] == 3
            assert g["train/loss"] == pytest.approx(w["train/loss"], rel=1e-4, abs=1e-6)
            assert g["train/grad_norm"] == pytest.approx(w["train/grad_norm"], rel=1e-4)
            assert g["train/lr"] == pytest.approx(w["train/lr"], rel=1e-9)
    assert max(w["train/grad_norm_max"] for w in want_metrics) > 1.0  # clipping was exercised


@pytest.mark.parametrize("stage", [2, 3])
def test_two_rank_resume_continues_exactly(stage, tmp_path):
    """Save after update 1 (every rank's ZeRO partition gathered to rank 0), resume in 2 new processes, update 2:
    the uninterrupted 2-rank run's weights."""
    launch(tmp_path, stage, "straight")
    launch(tmp_path, stage, "save")
    saved = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    assert saved["world_size"] == 2 and len(saved["ranks"]) == 2
    launch(tmp_path, stage, "resume")
    torch.testing.assert_close(gathered(tmp_path, "resume"), gathered(tmp_path, "straight"), rtol=0, atol=0)


def aepo_train(runs: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``torch.distributed.run --nproc_per_node 2 -m flows.cli train`` on configs/tiny.yaml under ZeRO-2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k not in
           ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "flows.cli", "train", "-c", str(ROOT / "configs" / "tiny.yaml"), "--runs-dir", str(runs),
           "--set", "train.backend=deepspeed", "--set", "train.zero_stage=2", "--set", "eval.max_questions=2", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=runs.parent)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def test_aepo_train_on_two_ranks_logs_once_and_resumes(tmp_path):
    """End to end under the launcher: step 1, then ``--resume`` to step 2. One MLflow run (rank 0's) with both
    steps, rank 0's checkpoints holding both ranks' optimizer partitions, one trajectory part per step; rank 1
    has only its private Prefect home."""
    from mlflow.tracking import MlflowClient

    from infra.tracking import tracking_uri_for

    runs = tmp_path / "runs"
    aepo_train(runs, "--set", "train.steps=1")
    aepo_train(runs, "--set", "train.steps=2", "--resume")
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
    parts = sorted(p.relative_to(runs) for p in (runs / "trajectories").rglob("*.parquet"))
    assert {p.parts[2] for p in parts} == {run.info.run_id}
    assert sum(1 for p in parts if p.parts[1] == "trajectories") == 2  # one part per step, written by rank 0
    assert (runs / "prefect-rank1").is_dir() and not (runs / "mlflow-rank1").exists()
