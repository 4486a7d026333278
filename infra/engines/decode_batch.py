"""The in-process engine's batch of rows being decoded, shared by every ``generate`` call in flight
(:class:`~infra.engines.hf.HFEngine`, "Continuous batching"): a row's state, the batch's KV cache and mask, and how
rows leave it and join it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from aepo_core.interfaces import FinishReason, GenerationResult, SamplingParams


@dataclass
class Row:
    """Mutable state of one request during generation."""

    index: int
    prompt: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    seed: int
    sampling: SamplingParams
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    published_entropies: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    stop_string: str | None = None
    error: str | None = None
    stats: GenerationStats | None = None  # the cost record of the generate call the row came from

    def reset(self) -> None:
        """Forget what was generated (the row is run again from its prompt, with its seed)."""
        self.ids, self.logprobs, self.entropies, self.published_entropies = [], [], [], []
        self.finish = self.stop_string = self.error = None

    def result(self, published: bool, version: str | None) -> GenerationResult:
        """``published``: the published entropy terms were asked for (``SamplingParams.published_entropy``);
        ``version``: the engine's weight version."""
        return GenerationResult(
            token_ids=list(self.ids), logprobs=list(self.logprobs), entropies=list(self.entropies),
            finish_reason=self.finish or "error", stop_string=self.stop_string, error=self.error,
            published_entropies=list(self.published_entropies) if published else None, weight_version=version,
        )


@dataclass
class GenerationStats:
    """Cost of the last ``generate`` call (for metrics and benchmarks)."""

    rows: int = 0
    new_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model (padding excluded)
    reused_tokens: int = 0  # prompt tokens whose KV came from the prefix store instead (see prefix_cache)
    forward_passes: int = 0
    row_steps: int = 0  # Σ over forward passes of the active rows: what the work actually was
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class DecodeBatch:
    """A batch being decoded: its rows in batch order (a cache that cannot drop rows keeps finished ones, fed
    padding), their generators and stop windows, the KV cache and the attention mask over it, each row's next
    position, and the logits each row samples its next token from."""

    rows: list[Row]
    generators: list[torch.Generator]
    windows: list[int]
    cache: Any
    attention: torch.Tensor
    next_pos: torch.Tensor
    logits: torch.Tensor
    selectable: bool  # a transformers Cache: finished rows can leave it
    plain: bool  # a cache of full-attention layers only: rows can also join it and have their KV retained
    retain: bool  # finished rows' KV goes to the prefix store

    @property
    def sampling(self) -> SamplingParams:
        """How the batch samples (its rows were taken alike)."""
        return self.rows[0].sampling

    @property
    def mergeable(self) -> bool:
        """Whether rows can join the batch: a cache of full-attention layers, every row still going."""
        return self.plain and all(row.finish is None for row in self.rows)

    def select(self, keep: list[int]) -> None:
        """Keep only the rows at the batch indices ``keep``."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.attention.device)
        self.cache.batch_select_indices(idx)
        self.attention = self.attention.index_select(0, idx)
        self.next_pos = self.next_pos.index_select(0, idx)
        self.logits = self.logits.index_select(0, idx)
        self.rows = [self.rows[j] for j in keep]
        self.generators = [self.generators[j] for j in keep]
        self.windows = [self.windows[j] for j in keep]
        if self.plain:
            self._trim()

    def _trim(self) -> None:
        """Drop the leading cache columns no row attends to (the padding of rows that left). Without it a batch that
        rows keep joining stays as wide as its whole life: every decode step's cache append (a copy of the whole
        cache) and attention would pay for columns of rows long gone."""
        first = int(self.attention.any(0).nonzero()[0])
        if first:
            self.attention = self.attention[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def merged(self, other: DecodeBatch) -> DecodeBatch:
        """This batch and ``other`` (both ready to sample) as one: the narrower one's cache and mask padded on the
        left (masked, so no row's numbers change but by kernel rounding), then stacked. Costs one copy of both
        caches, what a decode step's own cache append costs."""
        width = max(self.attention.shape[1], other.attention.shape[1])

        def left(t: torch.Tensor, dim: int) -> torch.Tensor:
            pad = width - t.shape[dim]
            if not pad:
                return t
            shape = list(t.shape)
            shape[dim] = pad
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        layers = [(torch.cat([left(a.keys, 2), left(b.keys, 2)]), torch.cat([left(a.values, 2), left(b.values, 2)]))
                  for a, b in zip(self.cache.layers, other.cache.layers, strict=True)]
        return DecodeBatch(rows=self.rows + other.rows, generators=self.generators + other.generators,
                       windows=self.windows + other.windows, cache=DynamicCache(ddp_cache_data=layers),
                       attention=torch.cat([left(self.attention, 1), left(other.attention, 1)]),
                       next_pos=torch.cat([self.next_pos, other.next_pos]),
                       logits=torch.cat([self.logits, other.logits]), selectable=True, plain=True,
                       retain=self.retain and other.retain)


def count_pass(rows: list[Row]) -> None:
    """Charge one forward pass to each generate call with rows in it, and a row-step per row."""
    calls: dict[int, GenerationStats] = {}
    for row in rows:
        if row.stats is not None:
            calls[id(row.stats)] = row.stats
            row.stats.row_steps += 1
    for stats in calls.values():
        stats.forward_passes += 1


def stop_window(stops: tuple[str, ...]) -> int:
    """Generated tokens to decode when looking for a stop string: a token is at least one character except
    for partial UTF-8 bytes, so twice the longest stop string plus slack always holds a fresh match."""
    return 2 * max((len(s) for s in stops), default=0) + 4
