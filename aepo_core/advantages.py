"""Advantage estimators (a registry, like verl's) and AEPO's entropy-aware advantage (AEPO.md §5).

An estimator maps per-trajectory rewards and group ids to per-trajectory advantages; the trainer broadcasts
them to the trajectory's model tokens.  The entropy-aware scaling then works per token (per sequence for GSPO,
whose advantage must stay one per sequence), with its statistics taken over the whole PPO mini-batch (pass
:class:`EntropyStats`) so the result does not depend on how the mini-batch is split into micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

AdvantageFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} registered twice")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return wrap


@dataclass(frozen=True)
class GroupStats:
    """Per-trajectory view of its group's statistics."""

    mean: torch.Tensor
    std: torch.Tensor  # unbiased (n − 1), as torch.std / verl / TRL; 0 for groups of one
    size: torch.Tensor


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Mean, unbiased std and size of each trajectory's group, gathered back per trajectory."""
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must be 1-D of equal shape, got {rewards.shape}, {group_ids.shape}")
    r = rewards.double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    size = torch.zeros(n_groups, dtype=torch.float64).scatter_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float64).scatter_add_(0, inverse, r)
    mean = total / size
    sq = torch.zeros(n_groups, dtype=torch.float64).scatter_add_(0, inverse, (r - mean[inverse]) ** 2)
    std = torch.where(size > 1, (sq / (size - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return GroupStats(mean=mean[inverse], std=std[inverse], size=size[inverse])


@register_advantage("grpo")
def grpo_advantage(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """Â = (R − mean_group) / (std_group + eps); a group of one has no baseline and gets 0."""
    s = group_stats(rewards, group_ids)
    adv = (rewards.double() - s.mean) / (s.std + eps)
    return torch.where(s.size > 1, adv, torch.zeros_like(adv)).to(rewards.dtype)


@register_advantage("dr_grpo")
def dr_grpo_advantage(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """Dr.GRPO: Â = R − mean_group (no std division, which over-weights near-uniform groups)."""
    s = group_stats(rewards, group_ids)
    adv = rewards.double() - s.mean
    return torch.where(s.size > 1, adv, torch.zeros_like(adv)).to(rewards.dtype)


@register_advantage("rloo")
def rloo_advantage(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """RLOO: Â_i = R_i − mean_{j≠i} R_j = n/(n−1) · (R_i − mean_group)."""
    s = group_stats(rewards, group_ids)
    adv = (rewards.double() - s.mean) * s.size / (s.size - 1).clamp(min=1)
    return torch.where(s.size > 1, adv, torch.zeros_like(adv)).to(rewards.dtype)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline_advantage(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the whole batch."""
    s = group_stats(rewards, group_ids)
    centred = rewards.double() - s.mean
    if centred.numel() < 2:
        return centred.to(rewards.dtype)
    return ((centred - centred.mean()) / (centred.std() + eps)).to(rewards.dtype)


def compute_advantages(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    try:
        fn = ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}") from None
    return fn(rewards, group_ids, eps)


def broadcast_to_tokens(seq_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-trajectory advantage on each of its model tokens (0 on tool/padding tokens)."""
    return seq_advantages[:, None].to(torch.float32) * mask.to(torch.float32)


@dataclass(frozen=True)
class EntropyStats:
    """Mean and std of token entropy over the model tokens of a PPO mini-batch, or (``per_sequence``) of the
    sequence entropies H̄_i over its sequences that have model tokens."""

    mean: float
    std: float
    per_sequence: bool = False


def sequence_entropy(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """H̄_i = Σ_t m_{i,t}·H_{i,t} / Σ_t m_{i,t}: each sequence's mean token entropy over its model tokens ([B]; 0
    for a sequence without any)."""
    m = mask.to(torch.float32)
    return (entropy.detach().float() * m).sum(-1) / m.sum(-1).clamp(min=1)


def entropy_stats(entropy: torch.Tensor, mask: torch.Tensor, per_sequence: bool = False) -> EntropyStats:
    """Population statistics over masked tokens, or over the sequences' H̄_i (``per_sequence``; every sequence
    with a model token counts once).  Computed once per mini-batch, shared by its micro-batches."""
    m = mask.bool()
    values = sequence_entropy(entropy, mask)[m.any(-1)] if per_sequence else entropy.detach().float()[m]
    if values.numel() == 0:
        return EntropyStats(0.0, 0.0, per_sequence)
    return EntropyStats(float(values.mean()), float(values.std(unbiased=False)), per_sequence)


def entropy_aware_advantage(
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    alpha: float,
    stats: EntropyStats | None = None,
    eps: float = 1e-6,
    per_sequence: bool = False,
) -> torch.Tensor:
    """Ã_t = Â_t · max(0, 1 + α · z(H_t)), z standardized with the mini-batch ``stats``.

    High-entropy tokens (forks of the reasoning) get larger updates, low-entropy ones smaller; the max(0, ·)
    means the sign of Â never flips.  ``entropy`` must be detached (it is a weight, not a target).

    Per sequence (``stats.per_sequence``, or ``per_sequence`` when no stats are given; GSPO, whose gradient
    needs one advantage per sequence): Ã_{i,t} = Â_i · max(0, 1 + α · z(H̄_i)), H̄_i = :func:`sequence_entropy`,
    z standardized over the mini-batch's sequences.
    """
    stats = stats if stats is not None else entropy_stats(entropy, mask, per_sequence)
    if stats.per_sequence:
        entropy = sequence_entropy(entropy, mask)[:, None].expand_as(advantages)
    z = (entropy.detach().float() - stats.mean) / (stats.std + eps)
    scale = (1.0 + alpha * z).clamp(min=0.0)
    return advantages * scale * mask.to(advantages.dtype)


# A group whose values' std is at most this is uniform: equal float rewards leave a std of ~1e-16, not 0.
INFORMATIVE_STD_TOL = 1e-6


def informative_groups(values: torch.Tensor, group_ids: torch.Tensor, tol: float = INFORMATIVE_STD_TOL
                       ) -> torch.Tensor:
    """DAPO dynamic sampling: True for trajectories whose group's values (scoring passes correctness, 0/1) are
    not all equal, i.e. whose group std exceeds ``tol``."""
    s = group_stats(values, group_ids)
    return s.std > tol


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_len − buffer, then linear down to −factor at max_len."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0.0)
    return -(over / buffer).clamp(max=1.0) * factor
