"""Plots: training curves and a drawn rollout tree come out as valid PNGs, written atomically."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from scripted_engine import EchoSearch, ScriptedEngine, tool_then_answer

import infra.plots as plots
from aepo_core.config import RolloutConfig
from aepo_core.rollout.scheduler import Question, RolloutScheduler
from aepo_core.rollout.tree import RolloutTree
from aepo_core.scoring import LeafScore
from infra.plots import arm_curves_figure, metric_group, plot_curves, plot_rollout_tree

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_tree() -> RolloutTree:
    """A real aepo tree: probe, one branched step, penalized step, fills, failing tool calls."""
    cfg = RolloutConfig(mode="aepo", premonitor=True, beta=0.5, k=4, initial_rollouts=2, beam_size=2, gamma=0.2,
                        tau=0.5, branch_penalty=0.7, entropy_window=20, max_tool_calls=6, max_response_tokens=2000)
    engine = ScriptedEngine(tool_then_answer(calls=2, h_first=1.0, h_after_tool=4.0))
    res = RolloutScheduler(engine, {"search": EchoSearch(fail={"q1"})}, cfg).run(
        [Question("q0", [ord(c) for c in "Q: what is x?\n"])], seed=0)
    return res.trees[0]


def make_scores(tree: RolloutTree) -> list[LeafScore]:
    """Rewards 0, 0.5, … per leaf; the last leaf's is NaN (drawn as ``r=–``)."""
    return ([LeafScore(0.5 * j, "f1", 0.0, False) for j in range(len(tree.leaves) - 1)]
            + [LeafScore(math.nan, "", 0.0, False)])


def assert_png(path: Path, min_size: tuple[int, int] = (200, 100)) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] >= min_size[0] and img.size[1] >= min_size[1]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_curves_png_groups_metrics(tmp_path: Path) -> None:
    history = {
        "rollout/reward_mean": [(0, 0.1), (1, 0.3), (2, 0.35)],
        "rollout/accuracy": [(0, 0.0), (1, 0.2), (2, math.nan)],
        "train/entropy_mean": [(0, 1.2), (1, 1.1), (2, 1.0)],
        "rollout/h_root_mean": [(0, 1.0), (1, 0.9), (2, 0.95)],
        "rollout/branch_samples": [(0, 3), (1, 4), (2, 5)],
        "rollout/tool_error_rate": [(0, 0.1), (1, 0.0), (2, 0.05)],
        "train/loss": [(2, 0.1), (0, 0.3), (1, 0.2)],  # unsorted steps are fine
        "train/clip_frac_high_entropy": [(0, 0.01)],
        "eval/synthetic/pass@1": [(2, 0.3)],
    }
    out = plot_curves(history, tmp_path / "plots" / "curves.png", title="run x")
    assert out == tmp_path / "plots" / "curves.png"
    assert_png(out, (600, 400))
    assert {metric_group(k) for k in history} == {"reward / accuracy", "entropy", "branching", "tools", "training"}
    assert metric_group("train/clip_frac_high_entropy") == "training"
    assert metric_group("something/else") == "other"
    fig = plots.curves_figure(history)
    assert isinstance(fig, Figure) and len(fig.axes) == 5
    # Against the run's budget: the reward/accuracy panel again, x = cumulative generated tokens (0 at step 0).
    fig = plots.curves_figure(history, tokens={1: 1500.0, 2: 4200.0})
    assert [ax.get_title() for ax in fig.axes][:2] == ["reward / accuracy", "reward / accuracy vs generated tokens"]
    by_tokens = {line.get_label(): list(line.get_xdata()) for line in fig.axes[1].get_lines()}
    assert by_tokens["rollout/reward_mean"] == [0.0, 1500.0, 4200.0]
    assert by_tokens["eval/synthetic/pass@1"] == [4200.0]
    assert len(fig.axes) == 6
    with pytest.raises(ValueError, match="no finite metric values"):
        plot_curves({"a": [(0, math.nan)], "b": []}, tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def test_rollout_tree_png(tmp_path: Path) -> None:
    tree = make_tree()
    assert any(n.branched for n in tree.nodes) and any(n.tool and not n.tool.ok for n in tree.nodes)
    out = plot_rollout_tree(tree, tmp_path / "tree.png", scores=make_scores(tree))
    assert_png(out, (600, 200))
    fig = plots.rollout_tree_figure(tree, scores=make_scores(tree))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sum(t.startswith("leaf ") for t in texts) == len(tree.leaves)
    assert any("answered · r=0.50" in t for t in texts) and any(t.endswith("r=–") for t in texts)
    unscored = [t.get_text() for t in plots.rollout_tree_figure(tree).axes[0].texts if t.get_text().startswith("leaf")]
    assert len(unscored) == len(tree.leaves) and all(t.endswith("r=–") for t in unscored)
    with pytest.raises(ValueError, match="has 4 leaves but 3 scores"):
        plots.rollout_tree_figure(tree, scores=make_scores(tree)[:3])
    assert any("branch" in t for t in texts) and any("search FAIL" in t for t in texts)
    branched_boxes = [t for t in fig.axes[0].texts if t.get_bbox_patch() is not None
                      and t.get_bbox_patch().get_linewidth() > 2]
    assert len(branched_boxes) == sum(n.branched for n in tree.nodes)


def test_failed_render_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = make_tree()
    plot_rollout_tree(tree, tmp_path / "tree.png")
    before = (tmp_path / "tree.png").read_bytes()

    def boom(self: Figure, *args: object, **kwargs: object) -> None:
        args[0].write(b"\x89PNG half")  # the open temporary file save_png renders into
        raise RuntimeError("disk full")

    monkeypatch.setattr(Figure, "savefig", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        plot_rollout_tree(tree, tmp_path / "tree.png")
    assert (tmp_path / "tree.png").read_bytes() == before  # the old PNG is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tree.png"]


def test_arm_curves_keep_an_arms_colour_in_every_panel_and_draw_its_seed_band() -> None:
    a = [(1, 1.0, 0.9, 1.1), (2, 0.8, 0.7, 0.9)]
    fig = arm_curves_figure({"entropy": {"aepo": a, "grpo": a}, "tool calls": {"grpo": a}, "empty": {"arpo": []}},
                            title="t")
    assert [ax.get_title() for ax in fig.axes] == ["entropy", "tool calls"]  # a panel without points is left out
    colours = [{line.get_label(): line.get_color() for line in ax.get_lines()} for ax in fig.axes]
    assert colours[0]["grpo"] == colours[1]["grpo"] != colours[0]["aepo"]
    assert [len(ax.collections) for ax in fig.axes] == [2, 1]  # one band per arm
    with pytest.raises(ValueError, match="no arm"):
        arm_curves_figure({"entropy": {"aepo": []}})
