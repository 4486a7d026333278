"""Rollout trees: one per question; nodes are segments (model text or tool result), leaves are trajectories.

Branches share their parent's prefix, so a leaf is a path of node ids from the prompt.  The token arrays of a
leaf (ids, loss mask, sampling log-probs, entropies) are derived from its path, never stored twice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

NodeKind = Literal["prompt", "model", "tool"]
# engine_error: the path's engine request failed. RolloutScheduler.run then raises EngineFailure, so no tree it
# returns holds one (a fault is never data); the value stays to read trajectories stored before that.
LeafStatus = Literal["answered", "truncated", "tool_limit", "tool_error", "engine_error"]
SampleKind = Literal["global", "branch", "fill"]
LEAF_STATUSES: tuple[LeafStatus, ...] = ("answered", "truncated", "tool_limit", "tool_error", "engine_error")
# Event names of the scheduler's own notices (call past the limit, malformed or unknown call): no tool ran.
NOTICE_EVENTS: frozenset[str] = frozenset({"limit", "invalid"})


@dataclass(frozen=True)
class ToolEvent:
    name: str
    argument: str
    ok: bool
    error: str | None
    latency_s: float
    cache_hit: bool
    result_chars: int

    @property
    def is_notice(self) -> bool:
        """The scheduler's notice, not a tool call: it counts toward no limit and no branch decision follows."""
        return self.name in NOTICE_EVENTS


@dataclass
class Node:
    """A segment.  Branch fields are set on model segments that follow a real tool result (the measured step).

    ``branch_reason``: ``branch`` / ``below_tau`` / ``penalized`` / ``budget_full`` for a decision, ``fork``
    for the first segment of a branch (no decision: its step already branched), ``probe`` for a step of a kept
    probe whose entropies set m (no decision: they must not also drive its own branching), ``""`` otherwise.
    """

    node_id: int
    parent_id: int | None
    depth: int
    kind: NodeKind
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    token_start: int = 0
    text: str = ""
    finish_reason: str = ""
    segment_entropy: float = math.nan
    delta_entropy: float = math.nan
    consecutive_branches: int = 0
    branched: bool = False
    branch_reason: str = ""
    branch_score: float = math.nan
    entropy_is_estimate: bool = False
    tool: ToolEvent | None = None
    weight_version: str | None = None  # model segments: the weights that sampled them, as the server said

    @property
    def token_end(self) -> int:
        return self.token_start + len(self.token_ids)


@dataclass
class Leaf:
    """A finished trajectory: the path of node ids from the prompt to its last segment.

    Its reward and advantage are not stored here: scoring returns them (:class:`aepo_core.scoring.LeafScore`).
    """

    leaf_id: int
    node_ids: list[int]
    sample_kind: SampleKind
    status: LeafStatus
    branch_steps: int  # tool steps on this path (ancestors included) at which a branch was created
    wall_s: float = 0.0


def is_tool_step(nodes: Sequence[Node], node: Node) -> bool:
    """A model segment right after a real tool result (not a notice): where a branch is decided and what H̄_tool
    averages.  ``nodes``: the tree's nodes by id."""
    parent = nodes[node.parent_id] if node.parent_id is not None else None
    return node.kind == "model" and parent is not None and parent.tool is not None and not parent.tool.is_notice


@dataclass
class RolloutTree:
    question_id: str
    prompt_ids: list[int]
    nodes: list[Node]
    leaves: list[Leaf]
    global_budget: int  # m
    h_root: float
    h_tool: float

    def path(self, leaf: Leaf) -> list[Node]:
        return [self.nodes[i] for i in leaf.node_ids]

    def ancestors(self, node: Node) -> list[Node]:
        """The path from the prompt to ``node``, both included."""
        path = [node]
        while path[-1].parent_id is not None:
            path.append(self.nodes[path[-1].parent_id])
        return path[::-1]

    def response_ids(self, leaf: Leaf) -> list[int]:
        return [t for n in self.path(leaf) if n.kind != "prompt" for t in n.token_ids]

    def loss_mask(self, leaf: Leaf) -> list[int]:
        """1 on model tokens, 0 on tool-result tokens."""
        return [int(n.kind == "model") for n in self.path(leaf) if n.kind != "prompt" for _ in n.token_ids]

    def logprobs(self, leaf: Leaf) -> list[float]:
        return [x for n in self.path(leaf) if n.kind != "prompt" for x in _per_token(n, n.logprobs)]

    def entropies(self, leaf: Leaf) -> list[float]:
        return [x for n in self.path(leaf) if n.kind != "prompt" for x in _per_token(n, n.entropies)]

    def tool_events(self, leaf: Leaf) -> list[ToolEvent]:
        return [n.tool for n in self.path(leaf) if n.tool is not None]

    def text(self, leaf: Leaf) -> str:
        return "".join(n.text for n in self.path(leaf) if n.kind != "prompt")


def _per_token(node: Node, values: list[float]) -> list[float]:
    return values if node.kind == "model" else [0.0] * len(node.token_ids)
