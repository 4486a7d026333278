"""transformers' KV caches as the in-process engine and the training forward use them, across its versions: the
cache argument's name, a forward output's cache, and the one layout whose rows can be taken apart and rebuilt."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of ``model.forward``'s KV cache argument: ``cache`` in transformers ≥ 5.x (where
    ``past_key_values`` is deprecated), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(out: Any) -> Any:
    """The KV cache of a forward output under either transformers naming."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def is_plain_dynamic(cache: Any) -> bool:
    """Whether ``cache`` is a DynamicCache of full-attention layers only: the one layout whose rows' KV can be
    retained, expanded and rebuilt (a sliding-window layer keeps only its last positions)."""
    return isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer for layer in cache.layers)
