"""Training backends behind one small interface: plain torch (CPU or one GPU) and DeepSpeed ZeRO."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from transformers import DynamicCache

from aepo_core.config import OptimConfig, SharePrefix, resolved_share_prefix
from infra.kv_cache import cache_kwarg, is_plain_dynamic
from infra.ranks import Ranks
from infra.training.backend import Stateful
from infra.training.optim import build_optimizer, build_scheduler
from infra.training.token_tree import token_tree

log = logging.getLogger(__name__)


MIN_SHARED_PREFIX = 16
"""Fewest leading tokens common to every row for :func:`last_hidden_state` to run them once (below that, the second
decoder call costs more than the rows it saves)."""


def shared_prefix_len(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many leading positions hold the same attended token in every row of a right-padded batch (0 for one
    row), at most all but the last position: the part of a micro-batch's decoder forward that is the same for
    every row. Rollout prompts all begin with the system prompt (~100 of SmolLM2's ~117-token prompts)."""
    if input_ids.shape[0] < 2:
        return 0
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)
    return min(int(same.long().cumprod(0).sum()), input_ids.shape[1] - 1)


def full_attention(decoder: torch.nn.Module) -> bool:
    """Whether every layer of ``decoder`` attends to all earlier positions (no sliding window): what sharing a
    prefix needs. The layer types come from the config, before any forward."""
    return is_plain_dynamic(DynamicCache(config=decoder.config))


def last_hidden_state(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      share_prefix: SharePrefix = "off") -> torch.Tensor:
    """Last hidden states of a causal LM's decoder (the vocabulary projection is applied by the caller), with no
    KV cache: a training forward that builds one keeps every layer's keys and values alive to its end, which
    would undo activation checkpointing (``memory.checkpoint_decoder_layers``).

    ``share_prefix`` (``optim.share_prefix``): ``tree``: :func:`tree_hidden_state`. ``common``: the
    :func:`shared_prefix_len` leading tokens common to every row go through the decoder once, as one row whose keys
    and values every row then attends to (expanded, not copied), and only the rest of each row is run. A causal
    decoder's states at those positions do not depend on what follows, so the states, and through the expansion's
    backward (a sum over rows) the gradients, are the unshared forward's up to float rounding. Models whose cache
    is not a plain full-attention one (sliding windows: a window is not a prefix, nor a custom mask's business)
    and prefixes under :data:`MIN_SHARED_PREFIX` take the unshared forward."""
    decoder = model.base_model
    shared = share_prefix != "off" and full_attention(decoder)
    if shared and share_prefix == "tree":
        return tree_hidden_state(decoder, input_ids, attention_mask)
    p = shared_prefix_len(input_ids, attention_mask) if shared else 0
    if p < MIN_SHARED_PREFIX:
        return decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    cache = DynamicCache(config=decoder.config)
    kwarg = cache_kwarg(decoder)
    head = decoder(input_ids=input_ids[:1, :p], attention_mask=attention_mask[:1, :p], use_cache=True,
                   **{kwarg: cache})  # fills ``cache`` in place
    b = input_ids.shape[0]
    rows = DynamicCache(ddp_cache_data=[(layer.keys.expand(b, -1, -1, -1), layer.values.expand(b, -1, -1, -1))
                                        for layer in cache.layers])
    rest = decoder(input_ids=input_ids[:, p:], attention_mask=attention_mask, use_cache=True, **{kwarg: rows})
    return torch.cat([head.last_hidden_state.expand(b, -1, -1), rest.last_hidden_state], dim=1)


def tree_hidden_state(decoder: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states of a right-padded batch run as its :func:`token_tree`: each distinct prefix
    once, the rows' states gathered from their nodes (see :mod:`infra.training.token_tree`). Every real position's
    state, and through the gather's backward every gradient, is the unshared forward's up to float rounding; padded
    positions hold the first node's state (nothing reads them)."""
    tree = token_tree(input_ids, attention_mask)
    mask = tree.attention_mask
    if decoder.config._attn_implementation == "eager":  # eager adds its mask to the scores: 0 or the dtype's min
        mask = torch.zeros(mask.shape, dtype=decoder.dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(decoder.dtype).min)
    hidden = decoder(input_ids=tree.input_ids, attention_mask=mask, position_ids=tree.position_ids,
                     use_cache=False).last_hidden_state
    return hidden[0, tree.index]


def decoder_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   compute_dtype: torch.dtype | None = None, share_prefix: SharePrefix = "off") -> torch.Tensor:
    """:func:`last_hidden_state`; with ``compute_dtype`` under autocast: bf16 matmuls, float32 master weights."""
    with torch.autocast(input_ids.device.type, dtype=compute_dtype or torch.float32,
                        enabled=compute_dtype is not None):
        return last_hidden_state(model, input_ids, attention_mask, share_prefix)


class _InProcessModel:
    """A whole model in this process: forward passes under optional autocast; its parameters are its full weights."""

    def __init__(self, model: torch.nn.Module, compute_dtype: torch.dtype | None,
                 share_prefix: SharePrefix = "off") -> None:
        self.model = model
        self.compute_dtype = compute_dtype
        self.share_prefix = share_prefix
        """``optim.share_prefix``: which tokens the rows share run through the decoder once."""

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
    def shares_tree(self) -> bool:
        """``optim.share_prefix=tree`` on a full-attention model (a sliding-window one runs every row)."""
        return self.share_prefix == "tree" and full_attention(self.model.base_model)

    @property
    def ranks(self) -> Ranks:
        """One process: nothing all-reduces this backend's gradients (data parallelism is DeepSpeed's)."""
        return Ranks()

    @property
    def weights_from_optimizer_state(self) -> bool:
        """False: the model holds its full weights, which a checkpoint's weights are loaded into."""
        return False

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return decoder_hidden(self.model, input_ids, attention_mask, self.compute_dtype, self.share_prefix)

    def full_state_dict(self) -> Mapping[str, torch.Tensor] | None:
        return None  # the model holds its full weights


class TorchBackend(_InProcessModel):
    """Single-process training: AdamW, LR schedule, global-norm clipping."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, total_steps: int, lr: float | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        # A bare OptimConfig (no experiment config resolved it) may still ask `auto`: resolved for this model and
        # device by the experiment config's own rule.
        device = next(model.parameters()).device.type
        super().__init__(model, compute_dtype, resolved_share_prefix(cfg.share_prefix, "torch", device,
                                                                     model.config._attn_implementation))
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
