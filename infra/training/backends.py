"""Training backends behind one small interface: plain torch (CPU or one GPU) and DeepSpeed ZeRO."""

from __future__ import annotations

import logging

import torch

from aepo_core.config import OptimConfig
from infra.training.optim import build_optimizer, build_scheduler

log = logging.getLogger(__name__)


def decoder_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states of a causal LM's decoder (the vocabulary projection is applied by the caller)."""
    return model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class TorchBackend:
    """Single-process training: AdamW, LR schedule, global-norm clipping."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, total_steps: int, lr: float | None = None) -> None:
        self.model = model
        self.grad_clip = cfg.grad_clip
        self.optimizer = build_optimizer(model, cfg, lr)
        self.scheduler = build_scheduler(self.optimizer, cfg, total_steps)

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return decoder_hidden(self.model, input_ids, attention_mask)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip) if params else torch.tensor(0.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def current_lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])


class FrozenBackend:
    """A reference policy: forward only, never stepped."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return decoder_hidden(self.model, input_ids, attention_mask)

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError("the reference policy is frozen")

    def step(self) -> float:
        raise RuntimeError("the reference policy is frozen")

    def current_lr(self) -> float:
        return 0.0
