"""What the update, SFT and the checkpoints need from a training engine (:class:`TrainBackend`: plain torch or
DeepSpeed), and what a checkpoint saves (:class:`Stateful`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from infra.ranks import Ranks


class Stateful(Protocol):
    """What a checkpoint saves and restores: ``state_dict()`` / ``load_state_dict(state)``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainBackend(Protocol):
    """What the update and the checkpoints need from a training engine (plain torch, or DeepSpeed)."""

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def device(self) -> torch.device:
        """Where inputs go (under ZeRO-3 parameter offload the parameters themselves report the CPU)."""
        ...

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast dtype of forward passes (None: plain float32)."""
        ...

    @property
    def chunked_projection(self) -> bool:
        """Whether the gradient pass may project chunk by chunk with a backward that accumulates the projection's
        gradients itself (:class:`infra.training.logprobs.ChunkedLogprob`): False under DeepSpeed, whose ZeRO
        gradient hooks allow one accumulation per parameter per backward (tied embeddings would get two)."""
        ...

    @property
    def shares_tree(self) -> bool:
        """Whether :meth:`forward_hidden` runs a batch as its token tree (``optim.share_prefix=tree``): positions
        whose rows share their prefix then hold the very same state, so the vocabulary projection runs once per
        distinct (prefix, next token) (:func:`infra.training.logprobs.response_logprobs_and_entropy`)."""
        ...

    @property
    def ranks(self) -> Ranks:
        """The data-parallel ranks whose gradients ``step()`` combines (one process: ``Ranks(0, 1)``)."""
        ...

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate ``∇ loss``; across data-parallel ranks the update is the gradient of the ranks' losses
        *summed* (each rank's loss is its share of the global mini-batch loss)."""
        ...

    def step(self) -> float: ...

    def current_lr(self) -> float: ...

    def checkpoint_state(self) -> tuple[Stateful | None, Stateful | None]:
        """(optimizer-like, LR scheduler) as a checkpoint saves them; DeepSpeed keeps both in the first."""
        ...

    @property
    def weights_from_optimizer_state(self) -> bool:
        """Whether loading the optimizer state also restores the weights, and the live parameters cannot take a
        full state dict (ZeRO-3 partitions): a resume then skips loading the checkpoint's HF weights."""
        ...

    def full_state_dict(self) -> Mapping[str, torch.Tensor] | None:
        """The gathered full weights when the live parameters are partitions (ZeRO-3); None when the model
        holds them (then ``module.state_dict()`` is the full state)."""
        ...
