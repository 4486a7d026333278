"""One rank of DeepSpeed data-parallel updates on synthetic samples (run under ``torch.distributed.run``).

``ds_rank_worker.py OUT STAGE``: one process group runs three scenarios in turn, each on a fresh model and a fresh
DeepSpeed engine, sharing nothing in memory with the others:

- ``straight``: two updates;
- ``save``: one update, then the checkpoint state (a collective: rank 0 holds every rank's optimizer partition)
  is written to ``OUT/optimizer.pt``;
- ``resume``: the weights and optimizer state read back from ``OUT``, then the second update.

After each scenario rank 0 writes the gathered weights to ``OUT/weights-<SCENARIO>.pt``, every rank writes its
metrics to ``OUT/metrics-<SCENARIO>-rank<R>.json``, and all ranks meet at a barrier (the next scenario may read
those files).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers the test modules import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from test_deepspeed_backend import OVERRIDES, TOTAL_STEPS
from test_update import make_samples, tiny_model

from aepo_core.overrides import build_config
from infra.ranks import Ranks
from infra.training.deepspeed_backend import DeepSpeedBackend, init_single_process_distributed
from infra.training.update import PolicyUpdater

SAMPLES = {"n_groups": 5, "per_group": 3}  # 5 groups: shards of 3 + 2, a last mini-batch of one group
SCENARIOS = {"straight": [0, 1], "save": [0], "resume": [1]}  # the sample seeds each scenario updates on, in order


def run_scenario(out: Path, stage: int, mode: str) -> Ranks:
    """``mode``'s updates on a fresh model and engine; its files written on return (every rank past a barrier)."""
    cfg = build_config({}, OVERRIDES)
    model = tiny_model()
    if mode == "resume":
        model.load_state_dict(torch.load(out / "weights-save.pt", weights_only=True))
    backend = DeepSpeedBackend(model, cfg.optim, TOTAL_STEPS, zero_stage=stage)
    ranks = backend.ranks
    updater = PolicyUpdater(backend, cfg, pad_id=0)
    if mode == "resume":
        backend.checkpoint_state()[0].load_state_dict(torch.load(out / "optimizer.pt", weights_only=True))
    metrics = [updater.update(make_samples(seed=s, **SAMPLES)) for s in SCENARIOS[mode]]
    optimizer_state = backend.checkpoint_state()[0].state_dict() if mode == "save" else None  # a collective
    full = backend.consolidated_state_dict()  # a collective under ZeRO-3
    if ranks.is_main:
        torch.save(full, out / f"weights-{mode}.pt")
        if optimizer_state is not None:
            torch.save(optimizer_state, out / "optimizer.pt")
    (out / f"metrics-{mode}-rank{ranks.rank}.json").write_text(json.dumps(metrics))
    ranks.barrier()  # rank 0's files are on disk before any rank starts the next scenario
    return ranks


def main() -> None:
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    init_single_process_distributed()
    for mode in SCENARIOS:
        ranks = run_scenario(out, stage, mode)
        gc.collect()  # the scenario's engine, optimizer and model are gone before the next one is built
    ranks.finish()


if __name__ == "__main__":
    main()
