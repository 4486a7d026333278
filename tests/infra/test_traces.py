"""Rollout trees as MLflow traces, written to a real MLflow SQLite store and read back."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from test_store import make_scores, make_trees

from aepo_core.config import ExperimentConfig
from aepo_core.rollout.tree import RolloutTree, ToolEvent
from aepo_core.scoring import LeafScore
from infra.data.rows import QuestionRow
from infra.store import TrajectoryStore
from infra.tracking.run import Tracker
from infra.tracking.traces import (
    TAG_KIND,
    TAG_LABEL,
    TAG_QUESTION,
    TAG_STAGE,
    TAG_STEP,
    TEXT_CHARS,
    TraceTarget,
    attributes,
    cut,
    tree_trace,
)


@pytest.fixture(scope="module")
def scored() -> tuple[list[RolloutTree], list[list[LeafScore]]]:
    """Real scheduler trees (branches, fills, a failing search) and their scores, as the store tests use."""
    trees = make_trees()
    return trees, make_scores(trees)


def test_logged_traces_carry_the_parquet_rows_of_their_leaves(
        tmp_path: Path, scored: tuple[list[RolloutTree], list[list[LeafScore]]]) -> None:
    """The span tree is the rollout tree: every segment one span under the segment it follows (a shared prefix
    once, a branch forking where its tree forks), a leaf span under its path's last segment, named by kind, reason
    and reward; span attributes are the Parquet rows; the root holds the question, its golds, the stage and step."""
    trees, scores = scored
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", artifact_location=(tmp_path / "art").as_uri())
    run_id = tracker.start(ExperimentConfig())
    questions = {t.question_id: QuestionRow(t.question_id, f"text of {t.question_id}", ("gold", "alias"), "synthetic")
                 for t in trees}
    future = tracker.log_rollout_traces(trees[:2], scores[:2], step=3, kind="train", label="step3",
                                        questions=questions)
    ids = future.result()
    store = TrajectoryStore(tmp_path / "traj")
    store.write_step(run_id, 3, trees, scores)
    leaves = {(r["question_id"], r["leaf_id"]): r for r in store.read_table("trajectories").to_pylist()}
    nodes = {(r["question_id"], r["node_id"]): r for r in store.read_table("nodes").to_pylist()}

    found = tracker.client.search_traces(locations=[tracker.experiment_id()], run_id=run_id)
    assert sorted(t.info.trace_id for t in found) == sorted(ids) and len(ids) == 2
    errors = shared = 0
    for trace, tree in zip(sorted(found, key=lambda t: t.info.tags[TAG_QUESTION]), trees[:2], strict=True):
        info = trace.info
        assert info.trace_metadata["mlflow.sourceRun"] == run_id
        assert (info.tags[TAG_KIND], info.tags[TAG_STEP], info.tags[TAG_LABEL], info.tags[TAG_STAGE]) == (
            "train", "3", "step3", "step3")
        assert info.request_preview == f"[step3 · step 3] text of {tree.question_id}"
        spans = trace.data.spans
        by_id = {s.span_id: s for s in spans}
        root = next(s for s in spans if s.parent_id is None)
        assert root.span_type == "AGENT" and root.name == f"{tree.question_id} · step 3"
        assert root.inputs == {"question_id": tree.question_id, "question": f"text of {tree.question_id}",
                               "golds": ["gold", "alias"], "stage": "step3", "step": 3}
        segments = [s for s in spans if s.span_type in ("LLM", "TOOL", "GUARDRAIL")]
        node_ids = [attributes(s)["node_id"] for s in segments]
        assert sorted(node_ids) == [n.node_id for n in tree.nodes if n.kind != "prompt"]  # each segment once
        span_of = dict(zip(node_ids, segments, strict=True))
        for node in tree.nodes:
            if node.kind == "prompt":
                continue
            parent = by_id[span_of[node.node_id].parent_id]
            parent_node = next(n for n in tree.nodes if n.node_id == node.parent_id)
            assert (parent is root) if parent_node.kind == "prompt" else (
                attributes(parent)["node_id"] == node.parent_id)
            seg = span_of[node.node_id]
            row = nodes[(tree.question_id, node.node_id)]
            assert {k: v for k, v in attributes(seg).items() if k != "aepo.duration_estimated"} == {
                k: row[k] for k in attributes(seg) if k != "aepo.duration_estimated"}
            assert seg.outputs == row["text"] and seg.start_time_ns >= parent.start_time_ns
            if row["kind"] == "tool":
                assert seg.span_type == "TOOL" and seg.name == row["tool_name"] == "search"
                assert seg.end_time_ns - seg.start_time_ns == pytest.approx(row["tool_latency_ms"] * 1e6, abs=2)
                assert (seg.status.status_code == "ERROR") == (not row["tool_ok"])
                errors += not row["tool_ok"]
            else:
                assert seg.span_type == "LLM" and attributes(seg)["aepo.duration_estimated"] is True
                assert seg.inputs["context"].startswith(f"text of {tree.question_id}") or seg.inputs[
                    "context"].startswith("…")
        leaf_spans = [s for s in spans if s.span_type == "CHAIN"]
        assert sorted(attributes(s)["leaf_id"] for s in leaf_spans) == [leaf.leaf_id for leaf in tree.leaves]
        for span in leaf_spans:
            row = leaves[(tree.question_id, attributes(span)["leaf_id"])]
            assert attributes(span) == {k: row[k] for k in attributes(span)}
            assert span.outputs == row["response_text"]  # short texts are whole
            reason = row["reward_reason"] or row["status"]
            reward = "" if row["reward"] is None else f" · r={row['reward']:.2f}"
            assert span.name == f"leaf {row['leaf_id']} · {row['sample_kind']} · {reason}{reward}"
            walk, up = [], by_id[span.parent_id]  # up from the leaf: its path, last segment first
            while up is not root:
                walk.append(attributes(up)["node_id"])
                up = by_id[up.parent_id]
            assert walk[::-1] == row["path"][1:]
        shared += sum(1 for n in tree.nodes if sum(n.node_id in leaf.node_ids for leaf in tree.leaves) > 1)
    assert errors  # the scripted search fails on q1: failed calls are ERROR spans
    assert shared  # trees with shared prefixes: each such segment is still a single span
    exp = tracker.client.get_experiment(tracker.experiment_id())
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert [m.step for m in tracker.client.get_metric_history(run_id, "traces/train_s")] == [3]
    tracker.finish()


def test_finish_waits_for_the_background_writes(tmp_path: Path,
                                                scored: tuple[list[RolloutTree], list[list[LeafScore]]]) -> None:
    trees, scores = scored
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", artifact_location=(tmp_path / "art").as_uri())
    run_id = tracker.start(ExperimentConfig())
    for step in (1, 2):
        tracker.log_rollout_traces(trees, scores, step=step, kind="train", label=f"step{step}", questions={})
    assert tracker.log_rollout_traces([], [], step=3, kind="train", label="step3", questions={}) is None
    tracker.finish()
    found = tracker.client.search_traces(locations=[tracker.experiment_id()], run_id=run_id)
    assert sorted(t.info.tags[TAG_STEP] for t in found) == ["1"] * len(trees) + ["2"] * len(trees)


def test_a_resumed_run_that_repeats_a_stage_does_not_log_its_traces_twice(
        tmp_path: Path, scored: tuple[list[RolloutTree], list[list[LeafScore]]]) -> None:
    """A run killed after an evaluation's (or a step's) traces were written but before the stage was recorded done
    repeats the stage when resumed: each trace (kind, label, step, question) goes in once, as its metric points do.
    Found by the kill-at-every-phase chain once its policy answered: a kill in the final evaluation after its traces
    were written left them twice. The other half, found next: traces still queued for the background writer when a
    kill came after their stage was done (checkpoint saved, evaluation file written) were lost for good, since a
    resume does not repeat that stage; the flow now flushes them first."""
    trees, scores = scored
    uri, art = f"sqlite:///{tmp_path}/mlflow.db", (tmp_path / "art").as_uri()
    first = Tracker(uri, artifact_location=art)
    run_id = first.start(ExperimentConfig())
    first.log_rollout_traces(trees, scores, step=2, kind="eval", label="final/gsm8k", questions={})
    first.log_rollout_traces(trees[:1], scores[:1], step=2, kind="train", label="step2", questions={})
    first.flush_traces()  # what the flow does before a stage's checkpoint or evaluation file; then the process dies
    on_disk = first.client.search_traces(locations=[first.experiment_id()], run_id=run_id, max_results=1000)
    assert len(on_disk) == len(trees) + 1  # all written by then, not left in the background queue
    resumed = Tracker(uri, artifact_location=art)
    resumed.start(ExperimentConfig(), resume_run_id=run_id)
    resumed.log_rollout_traces(trees, scores, step=2, kind="eval", label="final/gsm8k", questions={})
    resumed.log_rollout_traces(trees, scores, step=2, kind="train", label="step2", questions={})  # one more tree
    resumed.log_rollout_traces(trees, scores, step=3, kind="train", label="step3", questions={})
    resumed.finish()
    found = resumed.client.search_traces(locations=[resumed.experiment_id()], run_id=run_id, max_results=1000)
    keys = sorted((t.info.tags[TAG_KIND], t.info.tags[TAG_LABEL], t.info.tags[TAG_STEP], t.info.tags[TAG_QUESTION])
                  for t in found)
    assert len(keys) == len(set(keys)), keys
    per_stage = {}
    for kind, label, step, _ in keys:
        per_stage[(kind, label, step)] = per_stage.get((kind, label, step), 0) + 1
    assert per_stage == {("eval", "final/gsm8k", "2"): len(trees), ("train", "step2", "2"): len(trees),
                         ("train", "step3", "3"): len(trees)}


def test_runs_seeded_alike_keep_their_own_traces(tmp_path: Path,
                                                scored: tuple[list[RolloutTree], list[list[LeafScore]]]) -> None:
    """Trace and span ids must not come from the global ``random`` that a run seeds: OpenTelemetry's default id
    generator draws them there, so every run of seed 0 (and every resumed process of one run) wrote the same ids in
    the same order, and a second run's traces replaced the first one's in a shared store (found by the kill chain:
    7 traces left of 10). Drawing them there also moved the run's own random stream from a background thread."""
    import random
    import sys

    trees, scores = scored
    uri, art = f"sqlite:///{tmp_path}/mlflow.db", (tmp_path / "art").as_uri()
    # Draws from the global stream by tracing code, from any thread (the exporter's too). Counted by caller rather
    # than by comparing the stream before and after: another test's leftover thread in the same worker may draw from
    # it meanwhile (a full suite under xdist did, once), which says nothing about tracing.
    drawn: list[str] = []

    def watched(name: str):
        original = getattr(random, name)

        def draw(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None:
                module = frame.f_globals.get("__name__", "")
                if module.startswith(("opentelemetry", "mlflow", "infra.tracking")):
                    drawn.append(f"{name} from {module}")
                    break
                frame = frame.f_back
            return original(*args, **kwargs)
        return draw

    runs = []
    with pytest.MonkeyPatch.context() as patch:
        for name in ("random", "getrandbits", "randint", "randrange", "choice", "shuffle", "uniform"):
            patch.setattr(random, name, watched(name))
        for _ in range(2):
            tracker = Tracker(uri, artifact_location=art)
            runs.append(tracker.start(ExperimentConfig()))
            random.seed(0)  # what a run does at its start
            tracker.log_rollout_traces(trees, scores, step=1, kind="train", label="step1", questions={})
            tracker.finish()
    assert drawn == []  # the runs' stream was not drawn from
    for run_id in runs:
        found = tracker.client.search_traces(locations=[tracker.experiment_id()], run_id=run_id, max_results=100)
        assert len(found) == len(trees), run_id


def test_each_evaluation_s_trace_cost_is_its_own_metric_point(
        tmp_path: Path, scored: tuple[list[RolloutTree], list[list[LeafScore]]]) -> None:
    """The start and the post-SFT evaluations both log at step 0 (and each stage once per dataset): one key for all
    of them logged two points at one step, and a run resumed after the first kept only that one (a resumed run logs
    a (key, step) once), so the key names the evaluation."""
    trees, scores = scored
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", artifact_location=(tmp_path / "art").as_uri())
    run_id = tracker.start(ExperimentConfig())
    for label in ("start/gsm8k", "sft/gsm8k", "sft/hotpotqa"):
        tracker.log_rollout_traces(trees, scores, step=0, kind="eval", label=label, questions={})
    tracker.finish()
    logged = {key: [m.step for m in tracker.client.get_metric_history(run_id, key)]
              for key in tracker.client.get_run(run_id).data.metrics}
    assert logged == {"traces/eval/start/gsm8k_s": [0], "traces/eval/sft/gsm8k_s": [0],
                      "traces/eval/sft/hotpotqa_s": [0]}


def test_long_texts_are_cut_and_timing_is_rebuilt(scored: tuple[list[RolloutTree], list[list[LeafScore]]]) -> None:
    tree = scored[0][0]
    tool = next(n for n in tree.nodes if n.tool is not None)
    long = "x" * (TEXT_CHARS + 10)
    nodes = [replace(n, text=long, tool=ToolEvent(n.tool.name, n.tool.argument, True, None, 0.5, True, len(long)))
             if n.node_id == tool.node_id else n for n in tree.nodes]
    leaves = [replace(leaf, wall_s=2.0) for leaf in tree.leaves]
    tree = replace(tree, nodes=nodes, leaves=leaves)
    end = time.time_ns()
    trace = tree_trace(TraceTarget("0", "r", 1, "eval", "final/x"), tree, None, None, end)
    spans = trace.data.spans
    seg = next(s for s in spans if s.span_type == "TOOL" and attributes(s)["node_id"] == tool.node_id)
    assert seg.outputs == cut(long) and seg.outputs.endswith(f"[{len(long)} characters]")
    assert seg.end_time_ns - seg.start_time_ns == 500_000_000 and attributes(seg)["tool_cache_hit"] is True
    for leaf_span in (s for s in spans if s.span_type == "CHAIN"):
        assert leaf_span.end_time_ns == leaf_span.start_time_ns <= end  # a leaf ends its path, its time is the path's
        assert attributes(leaf_span)["reward"] is None and attributes(leaf_span)["reward_reason"] == ""
    # The first leaf's path is timed by its own wall time (2 s), the latest-ending path ends the trace.
    assert max(s.end_time_ns for s in spans) == end and trace.info.execution_duration >= 2000
    assert trace.info.tags[TAG_KIND] == "eval" and trace.data.spans[0].name == f"{tree.question_id} · final/x · step 1"
