"""Replay one stored RL step's policy update (issue 29): the samples the update saw, read back from the trajectory
store, applied to the weights and optimizer state of the checkpoint before the step, and compared with the run's
own checkpoint after it.

What makes the replay exact: the store keeps, per trajectory, the advantage the update used (``update_advantage``)
and its group's position in the update (``update_group``), so the samples come back in the update's order (the
mini-batches split them in that order); token ids, loss masks and the sampler's log-probs and entropies are stored
as the tree held them (float32, which is what the in-process engine produces: lossless there); the checkpoint holds
weights, AdamW moments, the LR schedule and the RNG streams. What can make it inexact: another numerics (``auto``
resolves per CPU: the replay reports the dtypes it used), another torch or thread count (float sums in another
order), a remote engine's log-probs (float64 on the wire, float32 in the store), data-parallel ranks (each rank
updated its own share).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from aepo_core.config import ExperimentConfig
from infra.models import load_policy, model_dir, pad_token_id
from infra.numerics import Numerics
from infra.run.trainer import build_backend, build_updater
from infra.store import StoreError, TrajectoryStore
from infra.training.batching import TrainSample
from infra.training.checkpoint import load_checkpoint


class ReplayError(ValueError):
    """A step that cannot be replayed: not stored, stored before the update's order was kept, no checkpoint."""


def update_samples(store: TrajectoryStore, run_id: str, step: int) -> list[TrainSample]:
    """The samples of step ``step``'s update, in its order, from the store (see the module docstring)."""
    try:
        traj = store.read_trajectories(run_id=run_id, step=step)
        nodes = store.read_nodes(run_id=run_id, step=step, columns=["question_id", "node_id", "kind",
                                                                    "entropy_is_estimate"])
    except StoreError as exc:
        raise ReplayError(f"run {run_id} step {step}: {exc}") from None
    if traj.empty:
        raise ReplayError(f"run {run_id} step {step}: no stored trajectories in {store.uri} "
                          f"(stored steps: {store.steps(run_id) or 'none'})")
    used = traj[traj["update_group"].notna()]
    if used.empty:
        raise ReplayError(f"run {run_id} step {step}: no trajectory is marked as in the update (update_group): the "
                          "step was stored before schema version 4, or its update had no group")
    estimated = {(r.question_id, int(r.node_id)) for r in nodes.itertuples()
                 if r.kind == "model" and r.entropy_is_estimate}
    samples = []
    for r in used.sort_values(["update_group", "leaf_id"], kind="stable").itertuples():
        mask = [int(m) for m in r.loss_mask]
        if not any(mask):  # as samples_from_trees: a trajectory without a model token trains nothing
            continue
        if math.isnan(r.update_advantage):
            raise ReplayError(f"run {run_id} step {step}: question {r.question_id} leaf {r.leaf_id} is in the update "
                              "without an advantage")
        prompt = [int(t) for t in r.prompt_tokens]
        samples.append(TrainSample(
            input_ids=prompt + [int(t) for t in r.response_tokens], prompt_len=len(prompt), loss_mask=mask,
            rollout_logprobs=[float(x) for x in r.logprobs], advantage=float(r.update_advantage),
            group=int(r.update_group),
            rollout_entropies=None if any((r.question_id, int(n)) in estimated for n in r.path)
            else [float(x) for x in r.entropies]))
    return samples


@dataclass(frozen=True)
class WeightComparison:
    """The replayed weights against a checkpoint's, tensor by tensor."""

    tensors: int
    identical: int
    max_abs_diff: float
    first_different: str | None
    """The first tensor (in the checkpoint's order) whose values differ; None when all are bit-identical."""

    @property
    def bit_identical(self) -> bool:
        return self.identical == self.tensors


def compare_weights(weights: Mapping[str, torch.Tensor], checkpoint: Path) -> WeightComparison:
    """Every tensor of the checkpoint's model (its safetensors files) against ``weights`` of the same name."""
    files = sorted(model_dir(checkpoint).glob("*.safetensors"))
    if not files:
        raise ReplayError(f"checkpoint {checkpoint} has no safetensors weights")
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        saved.update(load_file(str(f)))
    missing = sorted(set(saved) - set(weights))
    if missing:
        raise ReplayError(f"the replayed model has no tensor {missing[0]!r} of checkpoint {checkpoint}")
    identical, worst, first = 0, 0.0, None
    for name, want in saved.items():
        got = weights[name].detach().to(want.dtype).cpu()
        if torch.equal(got, want):
            identical += 1
            continue
        first = first or name
        worst = max(worst, float((got.float() - want.float()).abs().max()))
    return WeightComparison(len(saved), identical, worst, first)


@dataclass(frozen=True)
class ReplayedUpdate:
    """The weights after the replayed update, and the update's metrics (the ``train/…`` the step logged)."""

    weights: dict[str, torch.Tensor]
    metrics: dict[str, float]


def replay_update(cfg: ExperimentConfig, numerics: Numerics, before: Path, samples: list[TrainSample],
                  steps: int) -> ReplayedUpdate:
    """The run's update on ``samples``, starting from checkpoint ``before`` (weights, optimizer, schedule, RNG), with
    the backend and updater the trainer builds (``steps``: the run's RL steps, which shape the LR schedule), without
    an engine or tools."""
    model, tokenizer = load_policy(cfg.model)
    backend = build_backend(cfg, model, numerics, steps)
    updater = build_updater(cfg, backend, numerics, pad_token_id(tokenizer))
    optimizer, scheduler = backend.checkpoint_state()
    load_checkpoint(before, model=model, optimizer=optimizer, scheduler=scheduler, config=cfg)
    metrics = updater.update(samples)
    return ReplayedUpdate({k: v.detach().clone() for k, v in model.state_dict().items()}, metrics)
