"""`aepo trajectories <run> --step N --show <question>[/<leaf>]` on a store of real scheduler trees (scripted engine):
the tree view, one trajectory's transcript, and the errors of a bad --show."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "infra"))
from test_store import make_questions, make_scores, make_trees

from aepo_core.rollout.tree import RolloutTree
from flows.cli import app
from infra.store import TrajectoryStore


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[RolloutTree]]:
    root = tmp_path_factory.mktemp("show")
    trees = make_trees()
    TrajectoryStore(root / "store").write_step("run-x", 3, trees, make_scores(trees), make_questions(trees))
    return root, trees


def show(root: Path, *args: str) -> Any:
    return CliRunner().invoke(app, ["trajectories", "run-x", "--store", str(root / "store"), "--runs-dir",
                                    str(root / "runs"), *args], env={"COLUMNS": "200"}, catch_exceptions=False)


def test_show_a_question_prints_its_tree(stored: tuple[Path, list[RolloutTree]]) -> None:
    root, trees = stored
    out = show(root, "--step", "3", "--show", "q1")
    assert out.exit_code == 0, out.output
    tree = trees[1]
    assert "What is x in q1?" in out.stdout and "x | ex-1" in out.stdout and "hotpotqa" in out.stdout
    assert f"m = {tree.global_budget}, H_root = 1.000" in out.stdout
    for node in tree.nodes[1:]:  # every segment once, with its decision
        assert (f"model {node.node_id} " in out.stdout) if node.kind == "model" else "tool search(" in out.stdout
        if node.branch_reason and node.branch_reason != "fork":
            assert f"branch point: {node.branch_reason} (score {node.branch_score:.3f}" in out.stdout
    for j, leaf in enumerate(tree.leaves):
        reward = f"{0.25 * j:.3f} (f1={0.25 * j})" if j < len(tree.leaves) - 1 else "– (not scored)"
        assert f"→ leaf {leaf.leaf_id}: reward {reward}, {leaf.status}" in out.stdout
    assert "error: unavailable" in out.stdout  # q1's search fails


def test_show_a_leaf_prints_its_transcript(stored: tuple[Path, list[RolloutTree]]) -> None:
    root, trees = stored
    tree = trees[1]
    leaf = next(lf for lf in tree.leaves if lf.sample_kind == "branch")
    out = show(root, "--step", "3", "--show", f"q1/{leaf.leaf_id}")
    assert out.exit_code == 0, out.output
    positions = []
    for node in tree.path(leaf)[1:]:  # the path's segments in order, each with its span; model ones with entropies
        head = f"node {node.node_id} · {'model' if node.kind == 'model' else 'tool result'} · tokens " \
               f"[{node.token_start}, {node.token_end})"
        positions.append(out.stdout.index(head))
        if node.kind == "model":
            mean = sum(node.entropies) / len(node.entropies)
            assert f"{head} · H_W {node.segment_entropy:.3f}, mean H {mean:.3f}" in out.stdout
    assert positions == sorted(positions)
    assert "search failed: backend unavailable" in out.stdout and "↳ first segment of a branch" in out.stdout
    j = tree.leaves.index(leaf)
    assert (f"leaf {leaf.leaf_id} (branch) · status {leaf.status} · reward {0.25 * j:.3f} (f1={0.25 * j}) · "
            f"advantage {0.5 - 0.25 * j:+.3f}") in out.stdout


def test_bad_show_arguments_say_what_exists(stored: tuple[Path, list[RolloutTree]]) -> None:
    root, _ = stored
    no_step = show(root, "--show", "q1")
    assert no_step.exit_code == 2 and "--show needs --step" in no_step.stderr
    no_question = show(root, "--step", "3", "--show", "q9")
    assert no_question.exit_code == 2 and "no such question at this step (questions: q0, q1, q2)" in no_question.stderr
    no_leaf = show(root, "--step", "3", "--show", "q1/9")
    assert no_leaf.exit_code == 2 and "question q1 has leaves [0, 1, 2, 3]" in no_leaf.stderr
    no_step_stored = show(root, "--step", "4", "--show", "q1")
    assert no_step_stored.exit_code == 2 and "steps: [3]" in no_step_stored.stderr


def test_a_transcript_into_a_file_is_as_wide_as_a_terminal_and_format_json_is_refused(
        stored: tuple[Path, list[RolloutTree]]) -> None:
    """Piped (COLUMNS unset, not a terminal) a transcript's rules spanned 100 000 columns: 2.1 MB for 34 lines.
    ``--format json`` printed the text view as if it were JSON; it is refused instead (a transcript is text)."""
    root, _ = stored
    base = ["trajectories", "run-x", "--store", str(root / "store"), "--runs-dir", str(root / "runs"), "--step", "3"]
    piped = CliRunner().invoke(app, [*base, "--show", "q1/0"], env={"COLUMNS": None}, catch_exceptions=False)
    assert piped.exit_code == 0, piped.output
    lines = piped.stdout.splitlines()
    assert len(piped.stdout) < 50_000 and max(len(line) for line in lines) <= 100
    assert any(set(line.strip()) == {"─"} for line in lines)  # the closing rule is there, 100 wide
    as_json = CliRunner().invoke(app, [*base, "--show", "q1", "--format", "json"], env={"COLUMNS": None},
                                 catch_exceptions=False)
    assert as_json.exit_code == 2 and "does not apply to --show" in as_json.stderr
