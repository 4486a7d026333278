"""Host/device memory of the update: the micro-batch token cap from a memory budget, and handing freed memory back.

Where a single-turn step's memory goes (SmolLM2-135M, float32 master weights, bf16 autocast, 8 questions × 4
samples of ≤ 64 new tokens, 5532 tokens; ``bench/train_step.py --step``): weights 0.54 GB, their gradients
0.54 GB, AdamW moments 1.08 GB, the engine's bf16 copy 0.27 GB, the interpreter and libraries ~0.45 GB; the rest
is the activations one micro-batch keeps for its backward, ~1.3 MB per token (30 layers: float32 residual stream
and RMSNorm inputs, bf16 copies of every linear's input, the MLP's four [tokens, 1536] bf16 tensors), 7 GB for a
whole 8192-token micro-batch, plus the [tokens × V] logits (see ``update._ChunkedLogprob``). Capping the
micro-batch is what brings the step under 6 GB; on CPU it costs nothing (smaller micro-batches train as fast).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging

import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from aepo_core.config import OptimConfig

log = logging.getLogger(__name__)

CPU_ACTIVATION_BUDGET_GB = 2.0
"""``optim.memory_budget_gb: auto`` on a CPU device: SmolLM2-135M gets 1449-token micro-batches. Measured on 2
cores, single-turn step: 1024-token micro-batches 154 tok/s and 4.2 GB peak, 2048-token 155 tok/s and 5.6 GB,
8192-token 99 tok/s and 10.7 GB. ``make demo``'s cold-start SFT (48 transcripts of ~600–700 tokens): 2 GB 267
tok/s and 6.0 GB peak, 1.5 GB (1087 tokens) 200 tok/s and 5.5 GB, 1 GB (724 tokens) 196 tok/s and 5.3 GB — below
two transcripts per micro-batch the per-op overhead shows; its RL updates (from the demo's checkpoint): 2 GB
140 / 164 tok/s and 5.7 / 5.8 GB, 1 GB 127 / 175 tok/s and 4.7 / 5.0 GB. The whole demo peaks at 7.3 GB with
2 GB and 6.4 GB with 1 GB (13 min 25 s instead of ~9.5). All of these figures are without activation
checkpointing; with it (``optim.activation_checkpointing``, the default since) a token costs ~0.12 MB, the 2 GB
budget no longer binds below ``micro_batch_tokens``, and measured peaks fell: cold-start SFT 6.0 → 4.76 GB, an RL
update from the demo's checkpoint 5.7 → 4.14 GB, the whole ``make demo`` 7.3 → 5.81 GB (5.41 GiB; 5.66 GB with
1449-token micro-batches)."""


def activation_bytes_per_token(layers: int, hidden: int, intermediate: int, checkpointed: bool = False) -> int:
    """Bytes one token's activations keep for the backward, an upper estimate for a Llama-like decoder under bf16
    autocast with float32 weights: ``layers × (48·hidden + 12·intermediate)`` (two RMSNorms keep their float32
    input and normalised output, 16·hidden; bf16 copies of the linears' inputs, 12·hidden; attention q/k/v/out in
    bf16 and the float32 rotary outputs, ~12·hidden; the MLP's gate, up, SiLU and product, 8·intermediate; the
    rest is slack for what the allocator cannot reuse). SmolLM2-135M: 1.38 MB (1.29 MB measured).

    ``checkpointed`` (:func:`checkpoint_decoder_layers`): each layer keeps only its float32 input, ``4·hidden``,
    and one layer at a time is recomputed with all of its activations during the backward:
    ``layers × 4·hidden + 48·hidden + 12·intermediate``. SmolLM2-135M: 0.12 MB."""
    one_layer = 48 * hidden + 12 * intermediate
    return layers * 4 * hidden + one_layer if checkpointed else layers * one_layer


def micro_batch_token_cap(optim: OptimConfig, model: torch.nn.Module, device: torch.device) -> int:
    """Tokens per forward/backward micro-batch: ``micro_batch_tokens``, capped at ``budget / bytes per token`` by
    ``optim.memory_budget_gb`` (``auto``: :data:`CPU_ACTIVATION_BUDGET_GB` on CPU, no cap elsewhere)."""
    budget = optim.memory_budget_gb
    if budget == "auto":
        budget = CPU_ACTIVATION_BUDGET_GB if device.type == "cpu" else None
    if budget is None:
        return optim.micro_batch_tokens
    dims = model.config.to_dict()  # a transformers PretrainedConfig
    hidden = int(dims["hidden_size"])
    per_token = activation_bytes_per_token(int(dims["num_hidden_layers"]), hidden,
                                           int(dims.get("intermediate_size") or 4 * hidden),
                                           checkpointed=optim.activation_checkpointing)
    cap = max(1, int(float(budget) * 1e9 // per_token))
    if cap < optim.micro_batch_tokens:
        log.info("micro-batches capped at %d tokens (optim.memory_budget_gb=%s, ~%.2f MB of activations per token)",
                 cap, optim.memory_budget_gb, per_token / 1e6)
    return min(optim.micro_batch_tokens, cap)


def _checkpointed_forward(layer: GradientCheckpointingLayer, *args: object, **kwargs: object) -> object:
    """``layer``'s own forward; under autograd through ``torch.utils.checkpoint`` (non-reentrant: keyword
    arguments pass, and only the inputs are kept, the rest recomputed in the backward)."""
    forward = type(layer).forward
    # A KV cache (a caller's forward with use_cache=True) would be filled a second time by the recompute: such a
    # call runs plainly (transformers' own checkpointing turns the cache off instead; ours leaves the call as is).
    if torch.is_grad_enabled() and not kwargs.get("use_cache"):
        return checkpoint(forward, layer, *args, use_reentrant=False, **kwargs)
    return forward(layer, *args, **kwargs)


def checkpoint_decoder_layers(model: torch.nn.Module, enabled: bool) -> int:
    """Recompute each decoder layer's activations in the backward instead of keeping them
    (``optim.activation_checkpointing``); returns how many layers are checkpointed.

    Not transformers' ``gradient_checkpointing_enable``: that one checkpoints only a module in training mode,
    and the update runs the policy in eval mode (dropout would make the gradient pass another policy than the one
    that sampled). The layers are transformers' own ``GradientCheckpointingLayer`` modules, so any decoder that
    supports gradient checkpointing there is covered. No-grad passes (generation, the scoring pass) are untouched.
    Idempotent; ``enabled=False`` restores the plain forward.
    """
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        if enabled:
            layer.forward = functools.partial(_checkpointed_forward, layer)
        else:
            layer.__dict__.pop("forward", None)
    return len(layers) if enabled else 0


_LIBC_NAME = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_NAME) if _LIBC_NAME else None


def freeze_live_objects() -> None:
    """Collect garbage, then take every object alive now out of the cycle collector's walk (``gc.freeze``) until
    :func:`thaw_live_objects`.

    Each :func:`release_memory` is a full collection, and a full collection walks every tracked object: after the
    trainer's imports that is ~650k (torch, transformers, MLflow, Prefect), walked at every phase boundary. On a
    2-core Xeon VM (2026-12-06) each walk took 0.6–2.4 s. With the objects that exist when a runtime starts (the
    libraries, the policy) frozen, a tiny 2-step ``aepo train`` under cProfile spent 0.27 s in its six
    ``release_memory`` calls instead of 6.37 s, plus 0.84 s for this one collection. Frozen objects are still freed
    by reference counting; only a cycle among them waits for the thaw. Nested runtimes: the inner one's thaw gives
    everything back (the outer run's collections walk it all again; nothing is lost).
    """
    gc.collect()
    gc.freeze()


def thaw_live_objects() -> None:
    """Give what :func:`freeze_live_objects` froze back to the collector (a process that goes on, e.g. a test
    session, then collects cycles among those objects again)."""
    gc.unfreeze()


def release_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the OS (glibc ``malloc_trim``).

    glibc keeps what a big phase freed in its heap: after a SmolLM2 single-turn update the process holds 4.2 GB,
    2.3 GB once trimmed (``bench/train_step.py --only-step``). In the single-turn bench the next phase reused those
    pages (peak 5.5 GB either way), but under ``make demo`` they did not: the pages a rollout's KV caches or the
    cold-start SFT freed stayed resident and the next phase's allocations landed on top (SFT → evaluation 5.6 →
    6.0 GB, rollout → update 5.2 → 7.5 GB). So every phase boundary trims: the end of each update, of each
    rollout (``PolicyRuntime.sample``) and of SFT.
    """
    gc.collect()
    if _LIBC is not None:
        try:
            _LIBC.malloc_trim(0)
        except AttributeError:  # not glibc (musl, macOS): nothing to trim
            pass
