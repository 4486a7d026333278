"""A readable transcript of one stored rollout tree (``aepo trajectories <run> --step N --show <question>[/<leaf>]``).

One leaf: its path in order — each model segment's text with its entropies (H over the first W tokens as the
scheduler measured it, the mean over the whole segment, ΔH against H_root) and the branch decision taken after it,
each tool call with its argument, outcome and result — then the reward, its reason and the advantage.  A whole
question: the tree, one line per segment, and a table of its leaves.  Reads the store's two tables as the store
returns them (pandas frames); renders with rich.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.rule import Rule
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

# How much of a segment's text one line of the tree view shows (the leaf view shows all of it).
TREE_TEXT_CHARS = 100


class ShowError(ValueError):
    """``--show`` names a question or leaf that the step does not hold; the message lists what it holds."""


def parse_show(value: str, question_ids: Sequence[str]) -> tuple[str, int | None]:
    """``<question>`` or ``<question>/<leaf>`` against the step's question ids (an id may itself hold '/')."""
    if value in question_ids:
        return value, None
    question, sep, leaf = value.rpartition("/")
    if sep and leaf.isdigit() and question in question_ids:
        return question, int(leaf)
    listed = ", ".join(sorted(question_ids)[:10]) + (" …" if len(question_ids) > 10 else "")
    raise ShowError(f"--show {value}: no such question at this step (questions: {listed or 'none'})")


def _num(x: Any, fmt: str = ".3f") -> str:
    """A float for people: '–' for null / NaN."""
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(float(x), fmt)


def _golds(row: pd.Series) -> str:
    golds = row["golds"]
    return " | ".join(golds) if golds is not None and len(golds) else "–"


def _header(run_id: str, step: int, leaves: pd.DataFrame) -> RenderableType:
    first = leaves.iloc[0]
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("run / step", f"{escape(run_id)} / {step}")
    grid.add_row("question", f"{escape(first['question_id'])}  ({escape(str(first['dataset'] or '–'))}"
                 f"{', ' + escape(first['family']) if first['family'] else ''})")
    grid.add_row("text", escape(first["question"]) if first["question"] is not None else "– (not stored)")
    grid.add_row("gold", escape(_golds(first)))
    grid.add_row("tree", f"m = {first['global_budget']}, H_root = {_num(first['h_root'])}, "
                 f"H_tool = {_num(first['h_tool'])}, {len(leaves)} leaves")
    return grid


def _decision(node: pd.Series) -> str:
    """The branch decision taken at a model segment, in words ('' where none was taken)."""
    reason = node["branch_reason"]
    if not reason:
        return ""
    if reason == "fork":
        return "[magenta]↳ first segment of a branch[/]"
    style = "bold green" if node["branched"] else "yellow"
    return (f"[{style}]branch point: {reason}[/] (score {_num(node['branch_score'])}, "
            f"l = {node['consecutive_branches']})")


def _tool_line(node: pd.Series) -> str:
    ok = "[green]ok[/]" if node["tool_ok"] else f"[red]error: {escape(str(node['tool_error']))}[/]"
    cache = ", cache hit" if node["tool_cache_hit"] else ""
    return (f"[bold cyan]tool {escape(str(node['tool_name']))}[/]({escape(repr(node['tool_argument']))}) → {ok}, "
            f"{_num(node['tool_latency_ms'], '.0f')} ms{cache}, {_num(node['tool_result_chars'], '.0f')} chars")


def _segment_entropy(node: pd.Series, entropies: np.ndarray) -> str:
    """H over the first W tokens (the scheduler's), the mean over the whole segment, and ΔH."""
    tokens = entropies[node["token_start"]:node["token_end"]]
    mean = float(np.mean(tokens)) if len(tokens) else math.nan
    est = " (top-k estimate)" if node["entropy_is_estimate"] else ""
    return (f"H_W {_num(node['segment_entropy'])}, mean H {_num(mean)}, ΔH {_num(node['delta_entropy'], '+.3f')}"
            f"{est}")


def leaf_transcript(leaf: pd.Series, nodes: pd.DataFrame) -> RenderableType:
    """One trajectory from prompt to answer, then its outcome."""
    by_id = nodes.set_index("node_id")
    parts: list[RenderableType] = []
    for node_id in leaf["path"]:
        node = by_id.loc[int(node_id)]
        span = f"tokens [{node['token_start']}, {node['token_end']})"
        if node["kind"] == "prompt":
            parts.append(Rule(f"prompt · {node['num_tokens']} tokens", align="left", style="dim"))
            continue
        if node["kind"] == "tool":
            parts.append(Rule(f"node {node_id} · tool result · {span}", align="left", style="cyan"))
            parts.append(Text.from_markup(_tool_line(node)))
            parts.append(Text(node["text"], style="dim"))
            continue
        parts.append(Rule(f"node {node_id} · model · {span} · {_segment_entropy(node, leaf['entropies'])}",
                          align="left", style="blue"))
        parts.append(Text(node["text"]))
        decision = _decision(node)
        if decision:
            parts.append(Text.from_markup(decision))
    parts.append(Rule(style="bold"))
    parts.append(Text.from_markup(
        f"[bold]leaf {leaf['leaf_id']}[/] ({leaf['sample_kind']}) · status {leaf['status']} · "
        f"[bold]reward {_num(leaf['reward'])}[/] ({escape(leaf['reward_reason'] or 'not scored')}) · "
        f"advantage {_num(leaf['advantage'], '+.3f')} · {leaf['num_tool_calls']} tool calls "
        f"({leaf['tool_errors']} failed) · {leaf['branch_steps']} branch steps"))
    return Group(*parts)


def _tree_label(node: pd.Series, leaves_at: dict[int, list[pd.Series]]) -> str:
    text = node["text"].strip().replace("\n", "⏎ ")
    short = escape(text[:TREE_TEXT_CHARS] + ("…" if len(text) > TREE_TEXT_CHARS else ""))
    if node["kind"] == "prompt":
        label = f"[dim]prompt · {node['num_tokens']} tokens[/]"
    elif node["kind"] == "tool":
        label = f"{_tool_line(node)}  [dim]{short}[/]"
    else:
        label = (f"[blue]model {node['node_id']}[/] H_W {_num(node['segment_entropy'])} "
                 f"ΔH {_num(node['delta_entropy'], '+.3f')}  {short}")
        decision = _decision(node)
        label += f"\n{decision}" if decision else ""
    for leaf in leaves_at.get(int(node["node_id"]), []):
        label += (f"\n[bold]→ leaf {leaf['leaf_id']}[/]: reward {_num(leaf['reward'])} "
                  f"({escape(leaf['reward_reason'] or 'not scored')}), {leaf['status']}")
    return label


def tree_transcript(leaves: pd.DataFrame, nodes: pd.DataFrame) -> RenderableType:
    """The whole tree, one line per segment (text cut to ``TREE_TEXT_CHARS``), each leaf's outcome at its end."""
    leaves_at: dict[int, list[pd.Series]] = {}
    for _, leaf in leaves.iterrows():
        leaves_at.setdefault(int(leaf["path"][-1]), []).append(leaf)
    children: dict[int | None, list[pd.Series]] = {}
    for _, node in nodes.sort_values("node_id").iterrows():
        parent = None if pd.isna(node["parent_id"]) else int(node["parent_id"])
        children.setdefault(parent, []).append(node)
    root = children[None][0]
    tree = Tree(_tree_label(root, leaves_at))
    stack = [(tree, root)]
    while stack:
        branch, node = stack.pop()
        for child in children.get(int(node["node_id"]), []):
            stack.append((branch.add(_tree_label(child, leaves_at)), child))
    return tree


def render_show(run_id: str, step: int, value: str, traj: pd.DataFrame, nodes: pd.DataFrame) -> RenderableType:
    """What ``--show value`` prints for one step's rows (``traj``: its trajectories, ``nodes``: its nodes)."""
    question, leaf_id = parse_show(value, list(traj["question_id"].unique()))
    leaves = traj[traj["question_id"] == question]
    tree_nodes = nodes[nodes["question_id"] == question]
    if leaf_id is None:
        body = tree_transcript(leaves, tree_nodes)
        hint = Text(f"a full transcript: --show {question}/<leaf>", style="dim")
        return Group(_header(run_id, step, leaves), body, hint)
    chosen = leaves[leaves["leaf_id"] == leaf_id]
    if chosen.empty:
        raise ShowError(f"--show {value}: question {question} has leaves {sorted(leaves['leaf_id'].tolist())}")
    return Group(_header(run_id, step, leaves), leaf_transcript(chosen.iloc[0], tree_nodes))
