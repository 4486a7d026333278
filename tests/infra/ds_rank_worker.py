"""One rank of a DeepSpeed data-parallel update on synthetic samples (run under ``torch.distributed.run``).

``ds_rank_worker.py OUT STAGE MODE``: MODE ``straight`` runs two updates; ``save`` runs one and writes the
checkpoint state (rank 0 holds every rank's optimizer partition); ``resume`` loads it into fresh backends and runs
the second. Rank 0 writes the gathered weights to ``OUT/weights-<MODE>.pt``; every rank writes its metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers the test modules import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from test_deepspeed_backend import OVERRIDES, TOTAL_STEPS
from test_update import make_samples, tiny_model

from aepo_core.config import build_config
from infra.training.deepspeed_backend import DeepSpeedBackend, init_single_process_distributed
from infra.training.update import PolicyUpdater

SAMPLES = {"n_groups": 5, "per_group": 3}  # 5 groups: shards of 3 + 2, a last mini-batch of one group


def main() -> None:
    out, stage, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    init_single_process_distributed()
    cfg = build_config({}, OVERRIDES)
    model = tiny_model()
    if mode == "resume":
        model.load_state_dict(torch.load(out / "weights-save.pt", weights_only=True))
    backend = DeepSpeedBackend(model, cfg.optim, TOTAL_STEPS, zero_stage=stage)
    rank = backend.ranks.rank
    updater = PolicyUpdater(backend, cfg, pad_id=0)
    steps = {"straight": [0, 1], "save": [0], "resume": [1]}[mode]
    if mode == "resume":
        backend.checkpoint_state()[0].load_state_dict(torch.load(out / "optimizer.pt", weights_only=True))
    metrics = [updater.update(make_samples(seed=s, **SAMPLES)) for s in steps]
    optimizer_state = backend.checkpoint_state()[0].state_dict() if mode == "save" else None  # a collective
    full = backend.consolidated_state_dict()  # a collective under ZeRO-3
    if rank == 0:
        torch.save(full, out / f"weights-{mode}.pt")
        if optimizer_state is not None:
            torch.save(optimizer_state, out / "optimizer.pt")
    (out / f"metrics-{mode}-rank{rank}.json").write_text(json.dumps(metrics))
    backend.ranks.finish()


if __name__ == "__main__":
    main()
