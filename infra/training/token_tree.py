"""A micro-batch's rows as one token tree: every distinct prefix once (``optim.share_prefix: tree``).

The samples of one question's rollout tree share their prompt and, past each branch point, their parent's
segments: the powered sweep's 3 840 training leaves held 1.54 M prompt + response tokens, their trees 0.65 M
distinct ones (2.35×; bench/README, "The claims sweep before and after"). A causal decoder's state at a position
depends only on the tokens up to it, so a token two rows share in the same place (the same prefix before it) has
the same state in both: packed as a trie, the decoder runs it once. Each node attends to itself and its ancestors
(a 4-D mask, no padding), at its depth as its position (the rotary phase a row would give it), and the rows'
states are gathered back from their nodes; the gather's backward sums a shared node's gradient over the rows
through it, which is what the unshared forward's backward would have added up. Log-probs, entropies and the loss
stay per row, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenTree:
    """The trie of a right-padded batch's attended tokens, packed into one sequence of its nodes (parents first)."""

    input_ids: torch.Tensor
    """[1, N]: each node's token."""
    position_ids: torch.Tensor
    """[1, N]: each node's depth, its position in any row through it."""
    attention_mask: torch.Tensor
    """[1, 1, N, N] bool: True where node i attends to node j (j is i or an ancestor of i)."""
    index: torch.Tensor
    """[B, T]: the node of each row position (0 at padding, whose states nothing reads)."""

    @property
    def nodes(self) -> int:
        return int(self.input_ids.shape[1])


class Trie:
    """Distinct prefixes of the rows added so far, numbered in order of first appearance (a parent before its
    children): what a micro-batch of them costs the decoder under ``tree``, and its packed sequence."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, int], int] = {}
        self.tokens: list[int] = []
        """Each node's token."""
        self.depths: list[int] = []
        """Each node's depth (its position in any row through it)."""

    @property
    def nodes(self) -> int:
        return len(self.tokens)

    def extension(self, row: Sequence[int]) -> int:
        """The nodes ``row`` would add: its tokens past its longest prefix already here."""
        node = -1
        for depth, tok in enumerate(row):
            child = self._children.get((node, tok))
            if child is None:
                return len(row) - depth
            node = child
        return 0

    def add(self, row: Sequence[int]) -> list[int]:
        """Add ``row``; returns its path (the node of each of its positions)."""
        node, path = -1, []
        for depth, tok in enumerate(row):
            child = self._children.get((node, tok))
            if child is None:
                child = self._children[(node, tok)] = len(self.tokens)
                self.tokens.append(tok)
                self.depths.append(depth)
            node = child
            path.append(node)
        return path


def _trie(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[Trie, list[list[int]]]:
    """The :class:`Trie` of the rows' real tokens and each row's path through it."""
    trie = Trie()
    paths = [trie.add(row[: int(n)]) for row, n in zip(input_ids.tolist(), attention_mask.sum(1).tolist(),
                                                       strict=True)]
    return trie, paths


def _index(paths: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    index = torch.zeros(like.shape, dtype=torch.long)
    for r, path in enumerate(paths):
        index[r, : len(path)] = torch.tensor(path, dtype=torch.long)
    return index.to(like.device)


def prefix_nodes(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: the :class:`TokenTree` node of each row position (0 at padding): positions with the same node have
    the same prefix, so under the tree the same state."""
    return _index(_trie(input_ids, attention_mask)[1], input_ids)


def token_tree(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TokenTree:
    """The :class:`TokenTree` of a right-padded batch (``attention_mask`` 1 on each row's leading real tokens)."""
    trie, paths = _trie(input_ids, attention_mask)
    mask = torch.zeros((trie.nodes, trie.nodes), dtype=torch.bool)
    for path in paths:  # along a row, position t attends to positions ≤ t: a lower triangle over its nodes
        p = torch.tensor(path, dtype=torch.long)
        q, k = torch.tril_indices(len(path), len(path))
        mask[p[q], p[k]] = True
    device = input_ids.device
    return TokenTree(input_ids=torch.tensor([trie.tokens], dtype=input_ids.dtype, device=device),
                     position_ids=torch.tensor([trie.depths], dtype=torch.long, device=device),
                     attention_mask=mask.to(device)[None, None], index=_index(paths, input_ids))
