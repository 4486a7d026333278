"""From scored rollout trees to training samples and padding-aware micro-batches.

Samples keep the exact token ids of the rollout (prompt + response, tool tokens included but masked), so the
trainer sees what the sampler saw.  Micro-batches are length-sorted buckets under a token budget
(rows × longest row ≤ budget), which keeps padding waste small without sequence-packing kernels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aepo_core.rollout.tree import RolloutTree
from aepo_core.scoring import LeafScore, check_aligned
from infra.training.token_tree import Trie


@dataclass(frozen=True)
class TrainSample:
    input_ids: list[int]  # prompt + response
    prompt_len: int
    loss_mask: list[int]  # per response token: 1 model, 0 tool result
    rollout_logprobs: list[float]  # per response token (0 on tool tokens)
    advantage: float
    group: int  # question index within the step
    # Per response token, the sampler's exact full-vocabulary entropy (0 on tool tokens); None when the engine
    # only estimated it (top-k + tail). Lets an on-policy update skip the scoring pass.
    rollout_entropies: list[float] | None = None
    # The question's id (its rollout tree's): the leaves of one question share prefixes and one advantage
    # normalisation, so a statistic over samples resamples questions, not leaves (aepo_core.update_comparison).
    question_id: str = ""

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len


def samples_from_trees(trees: Sequence[RolloutTree], scores: Sequence[Sequence[LeafScore]]) -> list[TrainSample]:
    """One sample per leaf with a finite advantage and at least one model token.

    ``scores[i][j]`` is the score of leaf ``j`` of ``trees[i]`` (see :meth:`aepo_core.scoring.StepScores.kept`).
    """
    check_aligned(trees, scores)
    out = []
    for gi, (tree, tree_scores) in enumerate(zip(trees, scores, strict=True)):
        for leaf, score in zip(tree.leaves, tree_scores, strict=True):
            if math.isnan(score.advantage):
                raise ValueError(f"question {tree.question_id} leaf {leaf.leaf_id} has a NaN advantage")
            mask = tree.loss_mask(leaf)
            if not any(mask):
                continue
            out.append(
                TrainSample(
                    input_ids=list(tree.prompt_ids) + tree.response_ids(leaf),
                    prompt_len=len(tree.prompt_ids),
                    loss_mask=mask,
                    rollout_logprobs=tree.logprobs(leaf),
                    advantage=float(score.advantage),
                    group=gi,
                    rollout_entropies=None
                    if any(n.entropy_is_estimate for n in tree.path(leaf) if n.kind == "model")
                    else tree.entropies(leaf),
                    question_id=tree.question_id,
                )
            )
    return out


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Greedy length-sorted buckets with rows × max_len ≤ token_budget (a longer single row gets its own)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if current and new_longest * (len(current) + 1) > token_budget:
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


def plan_tree_micro_batches(rows: Sequence[Sequence[int]], token_budget: int) -> list[list[int]]:
    """Micro-batches for ``optim.share_prefix=tree``: the rows in their order (a question's samples together, so
    that its leaves share their tree), each micro-batch taking rows while its :class:`Trie` holds ≤ token_budget
    distinct tokens (the decoder's tokens under ``tree``; a longer single row gets its own)."""
    batches: list[list[int]] = [[]]
    trie = Trie()
    for i, row in enumerate(rows):
        if batches[-1] and trie.nodes + trie.extension(row) > token_budget:
            batches.append([])
            trie = Trie()
        batches[-1].append(i)
        trie.add(row)
    return batches if batches[-1] else []


def split_mini_batches(samples: Sequence[TrainSample], questions_per_batch: int) -> list[list[int]]:
    """Sample indices per PPO mini-batch: whole question groups, in order."""
    groups = sorted({s.group for s in samples})
    out = []
    for start in range(0, len(groups), questions_per_batch):
        chosen = set(groups[start : start + questions_per_batch])
        out.append([i for i, s in enumerate(samples) if s.group in chosen])
    return out


@dataclass
class PaddedBatch:
    """Right-padded tensors of a micro-batch; response-aligned [B, R] tensors for the loss."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_start: torch.Tensor  # [B] index of the first response token
    targets: torch.Tensor  # [B, R] response token ids (0 where padded)
    loss_mask: torch.Tensor  # [B, R] float
    rollout_logprobs: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B, R] per-token, before entropy scaling
    real_tokens: int
    padded_tokens: int


def collate(samples: Sequence[TrainSample], pad_id: int, device: torch.device | str = "cpu") -> PaddedBatch:
    b = len(samples)
    max_len = max(len(s.input_ids) for s in samples)
    max_resp = max(s.response_len for s in samples)
    input_ids = torch.full((b, max_len), pad_id, dtype=torch.long)
    attn = torch.zeros((b, max_len), dtype=torch.long)
    targets = torch.zeros((b, max_resp), dtype=torch.long)
    mask = torch.zeros((b, max_resp), dtype=torch.float32)
    old = torch.zeros((b, max_resp), dtype=torch.float32)
    adv = torch.zeros((b, max_resp), dtype=torch.float32)
    starts = torch.zeros(b, dtype=torch.long)
    for i, s in enumerate(samples):
        n, r = len(s.input_ids), s.response_len
        input_ids[i, :n] = torch.tensor(s.input_ids)
        attn[i, :n] = 1
        targets[i, :r] = torch.tensor(s.input_ids[s.prompt_len :])
        mask[i, :r] = torch.tensor(s.loss_mask, dtype=torch.float32)
        old[i, :r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        adv[i, :r] = s.advantage * mask[i, :r]
        starts[i] = s.prompt_len
    real = sum(len(s.input_ids) for s in samples)
    return PaddedBatch(
        input_ids.to(device), attn.to(device), starts.to(device), targets.to(device), mask.to(device),
        old.to(device), adv.to(device), real, b * max_len,
    )
