"""PNG plots for tracking: training curves, curves of several arms with their seed bands, a drawn rollout tree, a
sweep's comparison.

Figures are built with :class:`matplotlib.figure.Figure` on an Agg canvas, never through ``pyplot``: no global
figure registry and no GUI backend, so plotting is safe from worker threads and headless machines.  Files are
written to a hidden temporary name in the target directory and renamed, so a reader never sees half a PNG.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from aepo_core.rollout.study import Estimate
from aepo_core.rollout.tree import Node, RolloutTree
from aepo_core.scoring import LeafScore, check_aligned
from infra.atomic import atomic_file

log = logging.getLogger(__name__)

History = Mapping[str, Sequence[tuple[int, float]]]
Band = tuple[float, float, float, float]
"""One arm's metric at one point of training: (x, mean over seeds, lowest seed's value, highest seed's value); x is the
RL step, or what the runs had spent by then (e.g. cumulative generated tokens)."""
ArmCurves = Mapping[str, Sequence[Band]]
"""arm → its curve, one :data:`Band` per step."""

REWARD_GROUP = "reward / accuracy"
BY_TOKENS = f"{REWARD_GROUP} vs generated tokens"
# (group title, substrings); the first group with a matching substring wins, so training-side names that also
# mention entropy (train/clip_frac_high_entropy) land in "training" before "entropy" is tried.
CURVE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("training", ("loss", "grad_norm", "clip", "tokens_per_s", "/lr", "kl")),
    (REWARD_GROUP, ("reward", "accuracy", "pass", "f1")),
    ("entropy", ("entropy", "h_root", "h_tool", "delta_h")),
    ("branching", ("branch", "global_samples", "fill_samples", "budget")),
    ("tools", ("tool",)),
    ("system", ("system/",)),
)
OTHER_GROUP = "other"
DISPLAY_ORDER = (REWARD_GROUP, "entropy", "branching", "tools", "training", "system", OTHER_GROUP)

NODE_COLOURS = {"prompt": "#d9d9d9", "model": "#9ecae1", "tool": "#fdd0a2", "tool_error": "#fc9272"}
BRANCH_EDGE = "#d62728"


def metric_group(name: str) -> str:
    """The subplot a metric goes to (see :data:`CURVE_GROUPS`)."""
    low = name.lower()
    for title, keys in CURVE_GROUPS:
        if any(k in low for k in keys):
            return title
    return OTHER_GROUP


def save_png(fig: Figure, path: str | os.PathLike[str], dpi: int = 100) -> Path:
    """Write ``fig`` as a PNG atomically (:func:`infra.atomic.atomic_file`)."""
    out = Path(path)
    FigureCanvasAgg(fig)
    with atomic_file(out) as fh:
        fig.savefig(fh, format="png", dpi=dpi, bbox_inches="tight")
    return out


def curves_figure(history: History, title: str | None = None, tokens: Mapping[int, float] | None = None) -> Figure:
    """One subplot per metric group (reward/accuracy, entropy, branching, tools, training, …), a line per metric.

    ``tokens`` (step → the run's cumulative generated tokens through that step; 0 at step 0) adds the
    reward/accuracy group once more against that budget: arms that branch spend more per step, and a curve over
    steps alone favours the one that spends more."""
    groups: dict[str, list[tuple[str, list[tuple[int, float]]]]] = {}
    for name, points in history.items():
        clean = sorted((int(s), float(v)) for s, v in points if v is not None and math.isfinite(float(v)))
        if clean:
            groups.setdefault(metric_group(name), []).append((name, clean))
    if not groups:
        raise ValueError("no finite metric values to plot (history is empty or all NaN)")
    titles = sorted(groups, key=DISPLAY_ORDER.index)
    by_tokens = {0: 0.0, **tokens} if tokens else {}
    if by_tokens and REWARD_GROUP in groups:
        titles.insert(titles.index(REWARD_GROUP) + 1, BY_TOKENS)
    fig, axes = _panel_grid(titles, "step", 3.4, title)
    for ax, group in zip(axes, titles, strict=True):
        for name, pts in sorted(groups[REWARD_GROUP if group == BY_TOKENS else group]):
            if group == BY_TOKENS:
                pts = [(by_tokens[s], v) for s, v in pts if s in by_tokens]  # type: ignore[misc]
            if not pts:
                continue
            x, values = zip(*pts, strict=True)
            ax.plot(x, values, marker="o" if len(pts) <= 30 else None, markersize=3, linewidth=1.4, label=name)
        if group == BY_TOKENS:
            ax.set_xlabel("generated tokens, cumulative")
            ax.xaxis.set_major_locator(MaxNLocator())
        ax.legend(fontsize=7, loc="best")
    return fig


def _panel_grid(titles: Sequence[str], xlabel: str, row_height: float, title: str | None) -> tuple[Figure, list[Axes]]:
    """A figure with one subplot per title, two columns unless there is one, each with integer steps on x and a
    grid; the caller draws into the axes (in ``titles`` order)."""
    ncols = 1 if len(titles) == 1 else 2
    nrows = math.ceil(len(titles) / ncols)
    fig = Figure(figsize=(6.5 * ncols, row_height * nrows), layout="constrained")
    axes = []
    for i, name in enumerate(titles):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        axes.append(ax)
    if title:
        fig.suptitle(title)
    return fig, axes


def plot_curves(history: History, path: str | os.PathLike[str], title: str | None = None) -> Path:
    """Training curves ``{metric: [(step, value), …]}`` as a PNG at ``path``; returns the path."""
    out = save_png(curves_figure(history, title), path)
    log.debug("wrote curves of %d metrics to %s", len(history), out)
    return out


def arm_curves_figure(panels: Mapping[str, ArmCurves], title: str | None = None, xlabel: str = "RL step") -> Figure:
    """One subplot per quantity (titled by its key), one line per arm (the mean over seeds) with a shaded band
    from the lowest to the highest seed, over the bands' x (``xlabel``); an arm keeps its colour in every panel."""
    panels = {name: curves for name, curves in panels.items() if any(curves.values())}
    if not panels:
        raise ValueError("no arm has a point to plot")
    arms = list(dict.fromkeys(arm for curves in panels.values() for arm in curves))
    colours = {arm: f"C{i % 10}" for i, arm in enumerate(arms)}
    fig, axes = _panel_grid(list(panels), xlabel, 3.6, title)
    for ax, curves in zip(axes, panels.values(), strict=True):
        for arm, band in curves.items():
            if not band:
                continue
            steps, mean, low, high = zip(*sorted(band), strict=True)
            ax.plot(steps, mean, color=colours[arm], marker="o" if len(steps) <= 30 else None, markersize=3,
                    linewidth=1.5, label=arm)
            ax.fill_between(steps, low, high, color=colours[arm], alpha=0.18, linewidth=0)
        ax.legend(fontsize=7, loc="best")
    return fig


def _layout(tree: RolloutTree) -> dict[int, tuple[float, float]]:
    """x = depth, y = leaf order (terminal nodes get consecutive rows; parents sit at their children's mean)."""
    depth = {n.node_id: n.depth for n in tree.nodes}
    children: dict[int, list[int]] = {n.node_id: [] for n in tree.nodes}
    roots = []
    for n in tree.nodes:
        if n.parent_id is None or n.parent_id not in children:
            roots.append(n.node_id)
        else:
            children[n.parent_id].append(n.node_id)
    pos: dict[int, tuple[float, float]] = {}
    row = 0
    for root in roots:  # iterative post-order: children are placed before their parent
        stack: list[tuple[int, bool]] = [(root, False)]
        while stack:
            nid, expanded = stack.pop()
            kids = sorted(children[nid])
            if not kids:
                y, row = float(row), row + 1
            elif not expanded:
                stack.append((nid, True))
                stack.extend((k, False) for k in reversed(kids))
                continue
            else:
                y = sum(pos[k][1] for k in kids) / len(kids)
            pos[nid] = (float(depth[nid]), y)
    return pos


def _node_label(n: Node) -> str:
    if n.kind == "prompt":
        return f"prompt\n{len(n.token_ids)} tok"
    if n.kind == "tool":
        t = n.tool
        head = f"{t.name} {'ok' if t.ok else 'FAIL'}" if t else "tool"
        return f"{head}\n{len(n.token_ids)} tok"
    lines = [f"M{n.node_id} · {len(n.token_ids)} tok"]
    if math.isfinite(n.segment_entropy):
        ent = f"H={n.segment_entropy:.2f}"
        if math.isfinite(n.delta_entropy):
            ent += f" ΔH={n.delta_entropy:+.2f}"
        lines.append(ent)
    if n.branch_reason:
        reason = n.branch_reason + (f" {n.branch_score:.2f}" if math.isfinite(n.branch_score) else "")
        lines.append(reason + (f" l={n.consecutive_branches}" if n.consecutive_branches else ""))
    return "\n".join(lines)


def rollout_tree_figure(tree: RolloutTree, title: str | None = None,
                        scores: Sequence[LeafScore] | None = None) -> Figure:
    """One question's tree: boxes coloured by kind, branched steps outlined red, forks dashed, leaves labelled.

    ``scores`` (one per leaf, in leaf order) add each leaf's reward to its label; without them it shows ``r=–``.
    """
    if not tree.nodes:
        raise ValueError(f"question {tree.question_id}: the tree has no nodes")
    if scores is not None:
        check_aligned([tree], [scores])
    pos = _layout(tree)
    max_depth = max(x for x, _ in pos.values())
    rows = max(y for _, y in pos.values()) + 1
    # 1.3 in a segment column and 0.8 in a row, text at 8.5 pt: MLflow's artifact view shows the PNG at its width,
    # and at 2 in a column and 6.5 pt a 5-deep tree was 1800 × 460 px with text too small to read there.
    fig = Figure(figsize=(min(2.0 + 1.3 * (max_depth + 3.6), 60), min(1.8 + 0.8 * rows, 60)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for n in tree.nodes:
        if n.parent_id is not None and n.parent_id in pos:
            (x0, y0), (x1, y1) = pos[n.parent_id], pos[n.node_id]
            ax.plot([x0, (x0 + x1) / 2, (x0 + x1) / 2, x1], [y0, y0, y1, y1], color="#888888", linewidth=0.8,
                    zorder=1)
    for n in tree.nodes:
        if n.node_id not in pos:  # unreachable from a root (a corrupt parent link): nothing to attach it to
            continue
        x, y = pos[n.node_id]
        colour = NODE_COLOURS["tool_error" if n.kind == "tool" and n.tool and not n.tool.ok else n.kind]
        edge, lw, ls = ("#555555", 0.8, "solid")
        if n.branched:
            edge, lw = BRANCH_EDGE, 2.4
        elif n.branch_reason == "fork":
            edge, lw, ls = BRANCH_EDGE, 1.4, "dashed"
        ax.text(x, y, _node_label(n), ha="center", va="center", fontsize=8.5, zorder=3,
                bbox={"boxstyle": "round,pad=0.35", "fc": colour, "ec": edge, "lw": lw, "ls": ls})
    for j, leaf in enumerate(tree.leaves):
        if not leaf.node_ids or leaf.node_ids[-1] not in pos:
            continue
        x, y = pos[leaf.node_ids[-1]]
        reward = f"r={scores[j].reward:.2f}" if scores is not None and math.isfinite(scores[j].reward) else "r=–"
        ax.text(x + 0.6, y, f"leaf {leaf.leaf_id} ({leaf.sample_kind}) · {leaf.status} · {reward}", ha="left",
                va="center", fontsize=9, color="#1a7f37" if leaf.status == "answered" else BRANCH_EDGE, zorder=3)
    ax.set_xlim(-0.7, max_depth + 2.9)
    ax.set_ylim(rows - 0.4, -0.6)
    ax.axis("off")
    h_root = f"{tree.h_root:.2f}" if math.isfinite(tree.h_root) else "–"
    h_tool = f"{tree.h_tool:.2f}" if math.isfinite(tree.h_tool) else "–"
    ax.set_title(title or f"question {tree.question_id}: {len(tree.leaves)} leaves, m={tree.global_budget}, "
                          f"H_root={h_root}, mean H_tool={h_tool}", fontsize=9)
    handles = [Patch(fc=NODE_COLOURS[k], ec="#555555", label=lbl) for k, lbl in
               (("prompt", "prompt"), ("model", "model"), ("tool", "tool ok"), ("tool_error", "tool failed"))]
    handles += [Line2D([], [], color=BRANCH_EDGE, lw=2.4, label="branched step"),
                Line2D([], [], color=BRANCH_EDGE, lw=1.4, ls="dashed", label="fork")]
    ax.legend(handles=handles, loc="upper left", fontsize=8.5, frameon=False, ncols=3, bbox_to_anchor=(0, -0.01))
    return fig


def plot_rollout_tree(tree: RolloutTree, path: str | os.PathLike[str], title: str | None = None,
                      scores: Sequence[LeafScore] | None = None) -> Path:
    """Draw one question's rollout tree (with its leaves' ``scores``, if given) as a PNG at ``path``; returns
    the path."""
    out = save_png(rollout_tree_figure(tree, title, scores), path)
    log.debug("wrote rollout tree of %s (%d nodes) to %s", tree.question_id, len(tree.nodes), out)
    return out


# ------------------------------------------------------------------------------ estimates with CIs (study, rules)
EstimateBars = Mapping[str, Mapping[str, Estimate]]
"""panel series (e.g. an update rule) → group on the x axis (e.g. an arm, a token class) → estimate (a mean with its
95% CI)."""


def _estimate_bars(ax: Axes, arms: Sequence[str], series: Mapping[str, Mapping[str, Estimate]]) -> None:
    """Grouped bars: one group per arm, one bar per series, 95% CI whiskers; missing or NaN values are not drawn."""
    width = 0.8 / max(1, len(series))
    for j, (name, by_arm) in enumerate(series.items()):
        xs, ys, errs = [], [], [[], []]
        for i, arm in enumerate(arms):
            e = by_arm.get(arm)
            if e is None or math.isnan(e.mean):
                continue
            xs.append(i + (j - (len(series) - 1) / 2) * width)
            ys.append(e.mean)
            errs[0].append(max(0.0, e.mean - e.low) if not math.isnan(e.low) else 0.0)
            errs[1].append(max(0.0, e.high - e.mean) if not math.isnan(e.high) else 0.0)
        ax.bar(xs, ys, width=width, yerr=errs, capsize=3, label=name)
    ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def estimates_figure(panels: Mapping[str, EstimateBars], arms: Sequence[str], title: str | None = None) -> Figure:
    """One subplot per panel (e.g. "branch concentration" of the rollout study, "KL to the start" of the update-rule
    comparison), grouped bars of each series per x group (``arms``) with 95% CIs."""
    if not panels or not arms:
        raise ValueError("an estimates figure needs at least one panel and one x group")
    ncols = 2
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(6.5 * ncols, 3.6 * nrows), layout="constrained")
    for i, (name, series) in enumerate(panels.items()):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ax.set_title(name)
        _estimate_bars(ax, arms, series)
    if title:
        fig.suptitle(title)
    return fig


def budget_scatter_figure(points: Mapping[str, Sequence[tuple[float, float]]],
                          correlations: Mapping[str, Estimate], title: str | None = None) -> Figure:
    """m (global samples) against H_root − H̄_tool, one colour per arm, its Pearson r [95% CI] in the legend."""
    if not points:
        raise ValueError("no budget points to plot")
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    for arm, pts in points.items():
        finite = [(x, y) for x, y in pts if not (math.isnan(x) or math.isnan(y))]
        if not finite:
            continue
        r = correlations.get(arm)
        label = arm if r is None or math.isnan(r.mean) else f"{arm}: r = {r.mean:.2f} [{r.low:.2f}, {r.high:.2f}]"
        xs, ys = zip(*finite, strict=True)
        ax.scatter(xs, ys, s=12, alpha=0.6, label=label)
    ax.set_xlabel("H_root − H̄_tool (nats)")
    ax.set_ylabel("m (global samples)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    if title:
        ax.set_title(title)
    return fig


def comparison_figure(runs: pd.DataFrame, title: str) -> Figure:
    """Per dataset, two panels: mean Pass@1 per cell (bars, ± std over seeds) with each seed's value as a dot; and
    each run's Pass@1 against the generated tokens it spent (a cell's colour in both)."""
    datasets = list(dict.fromkeys(runs["dataset"])) or [""]
    fig = Figure(figsize=(max(5.0, 1.1 * runs["cell"].nunique() + 2) + 5.0, 3.2 * len(datasets)))
    colours = {cell: f"C{i % 10}" for i, cell in enumerate(dict.fromkeys(runs["cell"]))}
    for i, ds in enumerate(datasets):
        _pass1_vs_tokens(fig.add_subplot(len(datasets), 2, 2 * i + 2), runs[runs["dataset"] == ds], colours)
        ax = fig.add_subplot(len(datasets), 2, 2 * i + 1)
        sub = runs[runs["dataset"] == ds]
        cells = list(dict.fromkeys(sub["cell"]))
        stats = sub.groupby("cell", sort=False)["pass@1"].agg(["mean", "std"]).reindex(cells).fillna(0.0)
        ax.bar(range(len(cells)), stats["mean"], yerr=stats["std"], capsize=4, color="#9ecae1", edgecolor="#3182bd")
        for j, cell in enumerate(cells):
            vals = sub[sub["cell"] == cell]["pass@1"].dropna()
            ax.scatter([j] * len(vals), vals, color="#08306b", s=14, zorder=3)
        ax.set_xticks(range(len(cells)), cells, rotation=20, ha="right")
        ax.set_ylabel("pass@1")
        ax.set_ylim(0, max(1e-3, float(sub["pass@1"].max(skipna=True) or 0)) * 1.15 + 0.01)
        ax.set_title(f"{title} — {ds}" if ds else title)
    fig.tight_layout()
    return fig


def _pass1_vs_tokens(ax: Axes, runs: pd.DataFrame, colours: Mapping[str, str]) -> None:
    """Each run's final Pass@1 against its cumulative generated tokens, one colour per cell."""
    for cell, sub in runs.groupby("cell", sort=False):
        ax.scatter(sub["generated_tokens"], sub["pass@1"], color=colours[str(cell)], s=18, label=str(cell))
    ax.set_xlabel("generated tokens (the run's total)")
    ax.set_ylabel("pass@1")
    ax.set_title("pass@1 vs tokens spent")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")

