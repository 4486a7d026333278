"""Training backends behind one small interface: plain torch (CPU or one GPU) and DeepSpeed ZeRO."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from aepo_core.config import OptimConfig
from infra.ranks import Ranks
from infra.training.backend import Stateful
from infra.training.optim import build_optimizer, build_scheduler

log = logging.getLogger(__name__)


def last_hidden_state(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states of a causal LM's decoder (the vocabulary projection is applied by the caller), with no
    KV cache: a training forward that builds one keeps every layer's keys and values alive to its end, which
    would undo activation checkpointing (``memory.checkpoint_decoder_layers``)."""
    return model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def decoder_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`last_hidden_state`; with ``compute_dtype`` under autocast: bf16 matmuls, float32 master weights."""
    with torch.autocast(input_ids.device.type, dtype=compute_dtype or torch.float32,
                        enabled=compute_dtype is not None):
        return last_hidden_state(model, input_ids, attention_mask)


class _InProcessModel:
    """A whole model in this process: forward passes under optional autocast; its parameters are its full weights."""

    def __init__(self, model: torch.nn.Module, compute_dtype: torch.dtype | None) -> None:
        self.model = model
        self.compute_dtype = compute_dtype

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def chunked_projection(self) -> bool:
        return True

    @property
    def ranks(self) -> Ranks:
        """One process: nothing all-reduces this backend's gradients (data parallelism is DeepSpeed's)."""
        return Ranks()

    @property
    def weights_from_optimizer_state(self) -> bool:
        """False: the model holds its full weights, which a checkpoint's weights are loaded into."""
        return False

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return decoder_hidden(self.model, input_ids, attention_mask, self.compute_dtype)

    def full_state_dict(self) -> Mapping[str, torch.Tensor] | None:
        return None  # the model holds its full weights


class TorchBackend(_InProcessModel):
    """Single-process training: AdamW, LR schedule, global-norm clipping."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, total_steps: int, lr: float | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        super().__init__(model, compute_dtype)
        self.grad_clip = cfg.grad_clip
        self.optimizer = build_optimizer(model, cfg, lr)
        self.scheduler = build_scheduler(self.optimizer, cfg, total_steps)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def checkpoint_state(self) -> tuple[Stateful | None, Stateful | None]:
        return self.optimizer, self.scheduler

    def step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip) if params else torch.tensor(0.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def current_lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])


class FrozenBackend(_InProcessModel):
    """A reference policy: forward only, never stepped."""

    def __init__(self, model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__(model.eval(), compute_dtype)
        for p in self.model.parameters():
            p.requires_grad_(False)

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError("the reference policy is frozen")

    def checkpoint_state(self) -> tuple[Stateful | None, Stateful | None]:
        return None, None  # nothing to resume: never stepped

    def step(self) -> float:
        raise RuntimeError("the reference policy is frozen")

    def current_lr(self) -> float:
        return 0.0
