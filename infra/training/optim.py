"""AdamW and the learning-rate schedule (constant / linear / cosine, with linear warmup)."""

from __future__ import annotations

import math

import torch

from aepo_core.config import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float | None = None) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and norms (the usual split)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr if lr is not None else cfg.lr, betas=cfg.betas, eps=cfg.eps)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of the base LR after ``step`` optimizer steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant" or total_steps <= cfg.warmup_steps:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))
