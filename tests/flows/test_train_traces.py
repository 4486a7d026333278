"""A tiny training run's MLflow traces: linked to the run and step, with spans whose attributes are the Parquet
rows of the same leaf and node (real MLflow SQLite store, real Prefect engine)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from infra.config_files import load_config
from infra.store import TrajectoryStore
from infra.tracking.traces import TAG_KIND, TAG_LABEL, TAG_STEP, attributes

pytestmark = pytest.mark.slow  # the heavy tier (CI runs every tier)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


@pytest.mark.timeout(900)
def test_step_traces_match_the_parquet_rows_of_their_leaves(prefect_harness, tmp_path, tool_user):
    """On the session's tool user (a random tiny policy never calls a tool)."""
    from mlflow.tracking import MlflowClient

    from flows.train import train

    overrides = ["train.steps=1", "eval.every=0", "eval.max_questions=1", "tracking.log_model=false",
                 "tracking.traces_per_step=2", f"model.name={tool_user}", "rollout.max_response_tokens=160"]
    out = train(config=load_config(TINY, overrides), runs_dir=str(tmp_path))
    client = MlflowClient(out.tracking_uri)
    run = client.get_run(out.run_id)
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on the runs
    everything = client.search_traces(locations=[exp.experiment_id], run_id=out.run_id)
    assert all(t.info.trace_metadata["mlflow.sourceRun"] == out.run_id for t in everything)
    traces = [t for t in everything if t.info.tags[TAG_KIND] == "train"]
    assert len(traces) == 2 and {t.info.tags[TAG_STEP] for t in traces} == {"1"}
    evals = [t for t in everything if t.info.tags[TAG_KIND] == "eval"]  # the final evaluation's first question
    assert [t.info.tags[TAG_LABEL] for t in evals] == ["final/synthetic_test"]
    assert len([s for s in evals[0].data.spans if s.span_type == "CHAIN"]) == 2  # eval.n_samples

    store = TrajectoryStore(Path(out.trajectories))
    leaves = {(r["question_id"], r["leaf_id"]): r for r in store.read_table("trajectories", out.run_id, 1).to_pylist()}
    nodes = {(r["question_id"], r["node_id"]): r for r in store.read_table("nodes", out.run_id, 1).to_pylist()}
    tool_spans = 0
    for trace in traces:
        spans = trace.data.spans
        by_id = {s.span_id: s for s in spans}
        root = next(s for s in spans if s.parent_id is None)
        assert root.inputs["golds"] and root.inputs["stage"] == "step1"  # the gold answers, what and when
        for leaf_span in (s for s in spans if s.span_type == "CHAIN"):
            attrs = attributes(leaf_span)
            row = leaves[(attrs["question_id"], attrs["leaf_id"])]
            assert attrs == {k: row[k] for k in attrs}, leaf_span.name
            assert {"reward", "reward_reason", "advantage", "status", "wall_ms"} <= set(attrs)
            walk, up = [], by_id[leaf_span.parent_id]  # the leaf hangs under its path's last segment
            while up is not root:
                walk.append(attributes(up)["node_id"])
                up = by_id[up.parent_id]
            assert walk[::-1] == row["path"][1:]
        question = root.attributes["question_id"]
        for span in (s for s in spans if s.span_type in ("LLM", "TOOL", "GUARDRAIL")):
            seg = attributes(span)
            node = nodes[(question, seg["node_id"])]
            assert {k: v for k, v in seg.items() if not k.startswith("aepo.")} == {
                k: node[k] for k in seg if not k.startswith("aepo.")}, span.name
            if node["kind"] == "model":
                assert span.span_type == "LLM" and span.inputs["context"]  # the text it continued
                assert {"segment_entropy", "delta_entropy", "branched", "branch_reason"} <= set(seg)
            elif span.span_type == "GUARDRAIL":  # the scheduler's notice: no tool ran
                assert span.name in ("limit", "invalid") and span.name == node["tool_name"]
            else:
                assert span.span_type == "TOOL" and span.name == node["tool_name"]
                tool_spans += 1
                assert span.inputs == {"argument": node["tool_argument"]}
                assert span.outputs == node["text"] or span.outputs.startswith(node["text"][:4000])
                assert (span.end_time_ns - span.start_time_ns) == pytest.approx(node["tool_latency_ms"] * 1e6,
                                                                                  abs=2)
                assert {"tool_latency_ms", "tool_cache_hit", "tool_error", "tool_ok"} <= set(seg)
    assert tool_spans >= 1
    assert [m.step for m in client.get_metric_history(out.run_id, "traces/train_s")] == [1]
    # ΔH exists only at tool steps: logged because this policy called tools (test_train_flow's random policy never
    # does, so there the same check held for any code).
    assert client.get_metric_history(out.run_id, "rollout/tool_calls_mean")[0].value > 0
    delta_h = client.get_metric_history(out.run_id, "rollout/delta_h_mean")
    assert [m.step for m in delta_h] == [1] and math.isfinite(delta_h[0].value)
