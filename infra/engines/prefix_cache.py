"""Retained KV caches of finished rows, looked up by longest common token prefix (the in-process engine's reuse).

A rollout calls ``generate`` once per tool round, and every request's prompt is an earlier request's prompt plus
what was generated for it plus a tool result: a path that goes on (its transcript grows), or a branch forked from
a path at a tool-result node (its prompt is a prefix of the parent's transcript).  So when a row finishes, the
engine keeps its KV (every layer's keys and values of the tokens it fed, ``prompt + generated[:-1]``) here, and a
later request reuses the longest stored prefix that its prompt starts with and prefills only the rest.

Matching is on token ids, never on a request's identity, so it needs nothing from the caller: a continuation
matches its own path's entry, a branch its parent's (the parent's transcript holds the fork point), a segment that
the scheduler cut after a stop string matches up to the cut.  An entry whose tokens are a prefix of a newer entry's
is dropped (the newer one answers every lookup it would), so a rollout holds about one entry per path; beyond that
the store evicts the least recently used entries to stay under its byte cap.

The entries are only valid for the weights they were computed with: the engine clears the store when its weights
change (see ``HFEngine``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values of one sequence, each ``[kv_heads, tokens, head_dim]``."""


@dataclass(frozen=True)
class PrefixKV:
    """The KV of one token sequence: ``layers[l]`` holds layer ``l``'s keys and values of ``tokens``, in order."""

    tokens: np.ndarray  # int64, 1-D
    layers: tuple[LayerKV, ...]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixKVStore:
    """A byte-capped LRU store of :class:`PrefixKV` (see the module docstring).

    ``max_bytes`` bounds the sum of the entries' tensor bytes; an entry larger than the whole cap is not kept.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, PrefixKV] = OrderedDict()  # id → entry, least recently used first
        self._next_id = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def longest(self, prompt: np.ndarray, limit: int) -> tuple[PrefixKV | None, int]:
        """The entry sharing the longest prefix with ``prompt`` and that length, at most ``limit`` tokens
        (``(None, 0)`` when nothing matches); the entry becomes the most recently used."""
        best_key, best_n = -1, 0
        for key, entry in self._entries.items():
            n = common_prefix(prompt[:limit], entry.tokens)
            if n > best_n:
                best_key, best_n = key, n
        if best_n == 0:
            return None, 0
        self._entries.move_to_end(best_key)
        return self._entries[best_key], best_n

    def put(self, tokens: Sequence[int], layers: Sequence[LayerKV]) -> None:
        """Keep the KV of ``tokens``: entries that are prefixes of it are dropped; nothing is added when an entry
        already extends it; least recently used entries are evicted to stay under the cap."""
        entry = PrefixKV(np.asarray(tokens, dtype=np.int64), tuple(layers))
        size = entry.nbytes
        if not len(entry.tokens) or size > self.max_bytes:
            return
        for key, old in list(self._entries.items()):
            n = common_prefix(entry.tokens, old.tokens)
            if n == len(entry.tokens):  # an older entry holds all of it (and maybe more)
                self._entries.move_to_end(key)
                return
            if n == len(old.tokens):  # the new entry supersedes this one
                self._drop(key)
        while self._entries and self.nbytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[self._next_id] = entry
        self._next_id += 1
        self.nbytes += size

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
