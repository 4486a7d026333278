"""Rollout correction: the sampler is not the trainer (AEPO.md §6, "Sampler–trainer mismatch").

Samples come from the engine's copy of the policy (a bf16 copy, a vLLM server), while π_old of the PPO ratio is the
trainer's own log-prob. The two differ by rounding and kernels, so the update is off-policy by that gap. Truncated
importance sampling (TIS, as verl's ``tis_imp_ratio_cap``) reweights each model token by

    ρ_t = π_old(y_t) / π_rollout(y_t) = exp(log π_old − log π_rollout),
    tis:   w_t = min(ρ_t, C)                       (truncated: bounded variance)
    mask:  w_t = 1[ρ_t ≤ C]                        (tokens the sampler under-weighted too much are dropped)

and the policy term of every loss is multiplied by w_t (detached). Every loss here is linear in the advantage for
w > 0 — −min(r·Â, clip(r)·Â)·w = −min(r·Âw, clip(r)·Âw) — so the update applies w to the advantage; the clip
decisions and the loss normalizers are unchanged, and the KL term is not reweighted.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from aepo_core.losses import Diagnostic

RolloutCorrection = Literal["none", "tis", "mask"]

QUANTIZED_SAMPLERS = frozenset({"int8"})
"""Resolved ``model.sampler_dtype`` values that are quantized copies of the policy (a gap of ~0.1-0.2 nats a token
against the trainer, where a bf16 copy's is ~0.03)."""


def resolved_correction(requested: str, sampler_dtype: str, max_staleness: int = 0) -> RolloutCorrection:
    """``algorithm.rollout_correction`` for a run whose rollouts are sampled by ``sampler_dtype`` (the resolved
    ``model.sampler_dtype``) from weights up to ``max_staleness`` updates old (``train.max_staleness``): ``auto`` →
    tis where the sampler is quantized (:data:`QUANTIZED_SAMPLERS`) or stale (the gap is then the policy's own
    movement, as in verl's and TRL's asynchronous trainers), none elsewhere; an explicit mode as it is."""
    if requested == "auto":
        return "tis" if sampler_dtype in QUANTIZED_SAMPLERS or max_staleness > 0 else "none"
    if requested not in ("none", "tis", "mask"):
        raise ValueError(f"unknown rollout correction {requested!r}")
    return requested  # type: ignore[return-value]


def rollout_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: RolloutCorrection, cap: float) -> tuple[torch.Tensor, dict[str, Diagnostic]]:
    """Per-token weights w (1 off the model tokens and for ``mode='none'``) and their diagnostics:
    ``rollout_is_weight_mean`` (mean w over model tokens) and ``rollout_is_truncated_frac`` (share of model tokens
    with ρ > C), both token-weighted means."""
    n = float(mask.sum())
    log_rho = (old_logprobs - rollout_logprobs).detach()
    over = (log_rho > math.log(cap)) & (mask > 0)
    if mode == "none":
        w = torch.ones_like(log_rho)
    elif mode == "tis":
        w = torch.exp(torch.clamp(log_rho, max=math.log(cap)))  # min(ρ, C) without overflowing exp
    elif mode == "mask":
        w = (~over).to(log_rho.dtype)
    else:
        raise ValueError(f"unknown rollout correction {mode!r}")
    w = torch.where(mask > 0, w, torch.ones_like(w))
    diag = {
        "rollout_is_weight_mean": Diagnostic(float((w * mask).sum()) / n if n else 1.0, "mean", n),
        "rollout_is_truncated_frac": Diagnostic(float(over.sum()) / n if n else 0.0, "mean", n),
    }
    return w, diag
