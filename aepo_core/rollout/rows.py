"""The one row shape of a rollout tree: a row per segment (node) and per trajectory (leaf), as plain Python values.

Three writers record the same rows: the Parquet store (:mod:`infra.store`, its ``nodes`` and ``trajectories``
tables), the MLflow traces (:mod:`infra.tracking.traces`, span attributes) and the MLflow table of a step's
sample (:meth:`infra.tracking.run.Tracker.log_trajectory_sample`, :func:`sample_row`: a projection of the leaf
row). The rows are defined here, once, so that a span joins its Parquet row on (run_id, step, question_id,
node_id / leaf_id) with the same names and values, and a column added to a row reaches all three.

Floats that are NaN (not measured) are None (:func:`null_nan`): SQL aggregates skip nulls, and JSON has no NaN.
Pure data shaping: no I/O, no pyarrow, no MLflow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from aepo_core.rollout.tree import Leaf, Node, RolloutTree
from aepo_core.scoring import LeafScore


def null_nan(x: float | None) -> float | None:
    """``x`` as a float, None where it is None or NaN (not measured): the rows' (and the study tables') null."""
    return None if x is None or math.isnan(x) else float(x)


class QuestionFacts(Protocol):
    """What a leaf row records of its question (``infra.data.rows.QuestionRow`` has these fields)."""

    @property
    def question(self) -> str: ...

    @property
    def golds(self) -> Sequence[str]: ...

    @property
    def data_source(self) -> str: ...

    @property
    def family(self) -> str: ...


def node_row(run_id: str, step: int, tree: RolloutTree, n: Node) -> dict[str, Any]:
    """The ``nodes`` row of one segment, as Python values (NaN as None)."""
    t = n.tool
    return {
        "run_id": run_id, "step": step, "question_id": tree.question_id, "node_id": n.node_id,
        "parent_id": n.parent_id, "depth": n.depth, "kind": n.kind, "num_tokens": len(n.token_ids),
        "token_start": n.token_start, "token_end": n.token_end, "finish_reason": n.finish_reason,
        "segment_entropy": null_nan(n.segment_entropy), "delta_entropy": null_nan(n.delta_entropy),
        "entropy_is_estimate": bool(n.entropy_is_estimate), "consecutive_branches": n.consecutive_branches,
        "branched": bool(n.branched), "branch_reason": n.branch_reason,
        "branch_score": null_nan(n.branch_score),
        "tool_name": t.name if t else None, "tool_argument": t.argument if t else None,
        "tool_ok": bool(t.ok) if t else None, "tool_error": t.error if t else None,
        "tool_latency_ms": t.latency_s * 1000.0 if t else None, "tool_cache_hit": bool(t.cache_hit) if t else None,
        "tool_result_chars": t.result_chars if t else None, "text": n.text, "weight_version": n.weight_version,
    }


def leaf_row(run_id: str, step: int | None, tree: RolloutTree, leaf: Leaf, score: LeafScore | None,
             question: QuestionFacts | None = None) -> dict[str, Any]:
    """The ``trajectories`` row of one leaf (None score: reward and advantage null, reason empty; None question:
    its dataset, text, golds and family null), as Python values (NaN as None). ``step`` None: a sample logged
    outside the RL steps (the MLflow table allows it; the Parquet store does not)."""
    events = tree.tool_events(leaf)
    reward, reason, advantage = (score.reward, score.reason, score.advantage) if score else (None, "", None)
    return {
        "run_id": run_id, "step": step, "question_id": tree.question_id,
        "dataset": question.data_source if question else None, "question": question.question if question else None,
        "golds": list(question.golds) if question else None, "family": question.family if question else None,
        "leaf_id": leaf.leaf_id,
        "sample_kind": leaf.sample_kind, "path": list(leaf.node_ids), "prompt_tokens": list(tree.prompt_ids),
        "response_tokens": tree.response_ids(leaf), "loss_mask": tree.loss_mask(leaf),
        "logprobs": tree.logprobs(leaf), "entropies": tree.entropies(leaf),
        "reward": null_nan(reward), "reward_reason": reason,
        "advantage": null_nan(advantage), "status": leaf.status, "num_tool_calls": len(events),
        "tool_names": [e.name for e in events], "tool_errors": sum(not e.ok for e in events),
        "branch_steps": leaf.branch_steps, "wall_ms": leaf.wall_s * 1000.0, "response_text": tree.text(leaf),
        "global_budget": tree.global_budget, "h_root": null_nan(tree.h_root), "h_tool": null_nan(tree.h_tool),
        "weight_version": _path_versions(tree, leaf),
    }


def _path_versions(tree: RolloutTree, leaf: Leaf) -> str | None:
    """The distinct weight versions of a trajectory's model segments, in path order (None: untracked)."""
    versions = [n.weight_version for n in tree.path(leaf) if n.kind == "model" and n.weight_version is not None]
    return ",".join(dict.fromkeys(versions)) or None


SAMPLE_COLUMNS = ("step", "question_id", "question", "leaf_id", "sample_kind", "status", "reward", "advantage",
                  "num_tool_calls", "tools", "response")
"""The columns of the MLflow table of a step's sample: the leaf row's that a reader scans in the UI."""


def sample_row(row: dict[str, Any], question: str) -> dict[str, Any]:
    """The MLflow table's row of a leaf: its :func:`leaf_row` cut to :data:`SAMPLE_COLUMNS`, the tool names joined
    (``search,python``), the response text, and ``question`` (its text; the table is written without the rows)."""
    return {"step": row["step"], "question_id": row["question_id"], "question": question, "leaf_id": row["leaf_id"],
            "sample_kind": row["sample_kind"], "status": row["status"], "reward": row["reward"],
            "advantage": row["advantage"], "num_tool_calls": row["num_tool_calls"],
            "tools": ",".join(row["tool_names"]), "response": row["response_text"]}


__all__ = ["SAMPLE_COLUMNS", "QuestionFacts", "leaf_row", "node_row", "null_nan", "sample_row"]
