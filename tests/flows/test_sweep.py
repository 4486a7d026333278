"""The sweep flow: 2 cells on the tiny config → a parent MLflow run with 2 nested runs and a comparison table;
sweep files are validated cell by cell before anything runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from aepo_core.config_keys import ConfigError

REPO = Path(__file__).resolve().parents[2]
TINY_SWEEP = REPO / "configs" / "sweeps" / "tiny.yaml"


@pytest.mark.slow
def test_sweep_of_two_cells_nests_runs_and_compares(prefect_harness: Any, tmp_path: Path) -> None:
    from prefect.artifacts import Artifact

    from flows.sweep import sweep
    from infra.tracking.run import Tracker

    result = sweep(sweep_config=str(TINY_SWEEP), runs_dir=str(tmp_path))

    tracker = Tracker(result.tracking_uri)
    parent = tracker.client.get_run(result.parent_run_id)
    assert parent.info.run_name == "tiny-sweep" and parent.info.status == "FINISHED"
    assert parent.data.tags["kind"] == "sweep"
    # The parent stands for both cells: no single algorithm, mode or seed, no params of one config.
    assert not {"algorithm", "mode", "seed", "config_hash"} & set(parent.data.tags) and not parent.data.params
    assert parent.data.tags["mlflow.source.name"] == "flows/sweep.py:sweep"
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(parent.data.tags["prefect_flow_run_id"]).name == "tiny-sweep"
    children = tracker.search_runs(filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'")
    assert sorted(children["run_name"]) == ["tiny-sweep-aepo-s0", "tiny-sweep-grpo-s0"]
    assert set(children["status"]) == {"FINISHED"}
    assert sorted(children["tags.sweep_cell"]) == ["aepo", "grpo"]
    assert sorted(children["params.rollout.mode"]) == ["aepo", "independent"]

    out = tmp_path / "sweeps" / "tiny-sweep"
    table = pd.read_csv(out / "comparison.csv")
    assert list(table["cell"]) == ["aepo", "grpo"] and set(table["dataset"]) == {"synthetic_test"}
    # each row holds its own child's final evaluation, as MLflow has it (comparison_frame's mapping of distinct
    # values is tested below on a doctored search_runs frame: this tiny policy scores 0 everywhere)
    by_id = children.set_index("run_id")
    for _, row in table.iterrows():
        child = by_id.loc[row["run_id"]]
        for column, metric in (("pass@1", "pass_at_1"), ("pass@k", "pass_at_2"), ("answered_rate", "answered_rate"),
                               ("tool_calls_per_question", "tool_calls_per_question")):
            assert row[column] == pytest.approx(child[f"metrics.eval/synthetic_test/{metric}"]), (row["cell"], column)
        for column in ("generated_tokens", "tool_calls", "cpu_s"):  # what the run spent in all
            assert row[column] == pytest.approx(child[f"metrics.cost/total_{column}"]), (row["cell"], column)
        assert row["generated_tokens"] > 0 and row["cpu_s"] > 0
    summary = pd.read_csv(out / "summary.csv")
    assert len(summary) == 2 and (summary["generated_tokens"] > 0).all()
    assert (out / "comparison.png").stat().st_size > 1000
    logged = {f.path for f in tracker.client.list_artifacts(result.parent_run_id, "comparison")}
    assert {"comparison/comparison.csv", "comparison/comparison.png", "comparison/comparison.md"} <= logged

    artifact = Artifact.get("sweep-tiny-sweep")
    assert artifact is not None and artifact.type == "markdown"
    assert "## Per run" in artifact.data
    assert "| aepo |" in artifact.data and result.parent_run_id in artifact.data


@pytest.mark.slow
def test_a_sweep_continued_a_cell_at_a_time_is_compared_whole(prefect_harness: Any, tmp_path: Path) -> None:
    """A sweep run one cell (or seed) per invocation under one parent (``cells``, a bench's ``--seeds N``): the
    parent's comparison shows every finished child, not only the last invocation's (which overwrote it)."""
    from flows.sweep import sweep
    from infra.tracking.run import Tracker

    first = sweep(sweep_config=str(TINY_SWEEP), runs_dir=str(tmp_path), cells=["aepo"])
    second = sweep(sweep_config=str(TINY_SWEEP), runs_dir=str(tmp_path), cells=["grpo"], resume=True)
    assert second.parent_run_id == first.parent_run_id and second.started == ["tiny-sweep-grpo-s0"]
    assert [(r["cell"], r["seed"]) for r in second.runs] == [("aepo", 0), ("grpo", 0)]
    table = pd.read_csv(tmp_path / "sweeps" / "tiny-sweep" / "comparison.csv")
    assert list(table["run_name"]) == ["tiny-sweep-aepo-s0", "tiny-sweep-grpo-s0"]
    assert list(pd.read_csv(tmp_path / "sweeps" / "tiny-sweep" / "summary.csv")["cell"]) == ["aepo", "grpo"]
    metrics = Tracker(second.tracking_uri).client.get_run(second.parent_run_id).data.metrics
    assert {"sweep/aepo/synthetic_test/pass_at_1_mean", "sweep/grpo/synthetic_test/pass_at_1_mean"} <= set(metrics)


def test_the_comparison_puts_each_child_s_metrics_in_its_own_row(tmp_path: Path) -> None:
    """comparison_frame on a doctored ``search_runs`` frame: distinct values per child, dataset and metric, so that
    a swapped child, dataset or Pass@k, or a lost metric, changes the table."""
    from infra.run.sweep import comparison_frame
    from infra.run.sweep_spec import sweep_spec

    spec = sweep_spec(str(TINY_SWEEP), None)
    names = [r.run_name for r in spec.runs]
    rows = []
    for i, name in enumerate(reversed(names)):  # MLflow's order is not the sweep's
        row = {"run_id": f"id-{name}", "run_name": name, "status": "FINISHED", "params.eval.pass_k": "2",
               "metrics.rollout/reward_mean": -1.0 + i}
        for j, ds in enumerate(("a_set", "b_set")):
            base = 0.1 * (i + 1) + 0.01 * (j + 1)
            row.update({f"metrics.eval/{ds}/pass_at_1": base, f"metrics.eval/{ds}/pass_at_1_ci_low": base - 0.05,
                        f"metrics.eval/{ds}/pass_at_1_ci_high": base + 0.05, f"metrics.eval/{ds}/pass_at_2": base + 0.3,
                        f"metrics.eval/{ds}/answered_rate": base + 0.5})
        rows.append(row)
    rows[0].pop("metrics.eval/b_set/answered_rate")  # a metric the child never logged: NaN, not another's value
    table = comparison_frame(pd.DataFrame(rows), spec)
    assert list(zip(table["run_name"], table["dataset"], strict=True)) == [
        (n, ds) for n in names for ds in ("a_set", "b_set")]
    for _, r in table.iterrows():
        i = list(reversed(names)).index(r["run_name"])
        base = 0.1 * (i + 1) + 0.01 * (1 if r["dataset"] == "a_set" else 2)
        assert r["run_id"] == f"id-{r['run_name']}" and r["reward_mean"] == -1.0 + i and r["k"] == 2
        assert (r["pass@1"], r["pass@1_ci_low"], r["pass@1_ci_high"], r["pass@k"]) == pytest.approx(
            (base, base - 0.05, base + 0.05, base + 0.3))
        if i == 0 and r["dataset"] == "b_set":
            assert math.isnan(r["answered_rate"])
        else:
            assert r["answered_rate"] == pytest.approx(base + 0.5)


def test_the_whole_sweep_s_comparison_takes_the_other_shares_from_their_tags() -> None:
    """With ``whole_sweep`` a child outside the spec (an earlier invocation's seed or cell) is a row, its cell and
    seed from its tags, its cell first (it ran first); a run of another sweep never is. Without (a re-analysis of
    chosen cells), only the spec's runs."""
    from infra.run.sweep import TAG_CELL, TAG_SWEEP, comparison_frame
    from infra.run.sweep_spec import sweep_spec

    spec = sweep_spec(str(TINY_SWEEP), None, cells=["grpo"])

    def child(name: str, sweep: str, cell: str, seed: str, started: str) -> dict[str, Any]:
        return {"run_id": f"id-{name}", "run_name": name, "status": "FINISHED", "start_time": started,
                f"tags.{TAG_SWEEP}": sweep, f"tags.{TAG_CELL}": cell, "tags.seed": seed,
                "metrics.eval/a_set/pass_at_1": 0.5}

    children = pd.DataFrame([child("tiny-sweep-grpo-s0", "tiny-sweep", "grpo", "0", "2026-12-05 03:00"),
                             child("tiny-sweep-aepo-s1", "tiny-sweep", "aepo", "1", "2026-12-05 02:00"),
                             child("tiny-sweep-aepo-s0", "tiny-sweep", "aepo", "0", "2026-12-05 01:00"),
                             child("other-aepo-s0", "other", "aepo", "0", "2026-12-05 00:00")])
    whole = comparison_frame(children, spec, whole_sweep=True)
    assert list(zip(whole["cell"], whole["seed"], strict=True)) == [("aepo", 0), ("aepo", 1), ("grpo", 0)]
    assert list(whole["k"]) == [2, 2, 2]
    assert list(comparison_frame(children, spec)["run_name"]) == ["tiny-sweep-grpo-s0"]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text.replace("BASE", str(REPO / "configs" / "tiny.yaml")))
    return path


def test_grid_is_the_cross_product_plus_extra_cells(tmp_path: Path) -> None:
    from infra.run.sweep_spec import load_sweep

    spec = load_sweep(_write(tmp_path, """
name: g
base: BASE
overrides: ["train.steps=2"]
seeds: [0, 1]
grid:
  mode: {aepo: {rollout.mode: aepo}, arpo: {rollout.mode: arpo}}
  pen: {p0: {rollout.branch_penalty: 0}, p1: {rollout.branch_penalty: 0.1}}
cells:
  extra: {algorithm.loss: ppo_clip}
"""))
    assert list(spec.cells) == ["aepo-p0", "aepo-p1", "arpo-p0", "arpo-p1", "extra"]
    assert len(spec.runs) == 10 and spec.runs[0].run_name == "g-aepo-p0-s0"
    arpo_p1 = next(r for r in spec.runs if r.cell == "arpo-p1" and r.seed == 1)
    assert (arpo_p1.config.rollout.mode, arpo_p1.config.rollout.branch_penalty, arpo_p1.config.seed) == ("arpo", 0.1, 1)
    assert all(r.config.train.steps == 2 for r in spec.runs)


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_sweep_file_builds_its_runs(path: Path) -> None:
    """Each sweep file's every cell × seed is a valid config (tests/core/test_config.py leaves sweep files here)."""
    from infra.run.sweep_spec import load_sweep

    spec = load_sweep(path)
    assert len(spec.runs) == len(spec.cells) * len(spec.seeds) > 0
    assert len({r.run_name for r in spec.runs}) == len(spec.runs)


def test_the_powered_comparison_is_the_power_estimate_s_design() -> None:
    """112 test questions (80 companies: 16 held out × 7) × 5 seeds × aepo, arpo, grpo (bench/power.py), then the
    clip-balance ablation: AEPO's rollout and advantage with PPO's clipped loss."""
    from infra.data.synthetic import SyntheticTask
    from infra.run.sweep_spec import load_sweep

    spec = load_sweep(REPO / "configs" / "sweeps" / "claims_powered.yaml")
    assert spec.seeds == [0, 1, 2, 3, 4] and list(spec.cells) == ["aepo", "arpo", "grpo", "aepo-no-clip-balance"]
    by_cell = {r.cell: r.config for r in spec.runs if r.seed == 0}
    aepo, ablation = by_cell["aepo"], by_cell["aepo-no-clip-balance"]
    assert (ablation.rollout.mode, ablation.algorithm.loss, aepo.algorithm.loss) == ("aepo", "ppo_clip", "aepo")
    assert ablation.algorithm.entropy_advantage == aepo.algorithm.entropy_advantage  # only the loss differs
    cfg = spec.runs[0].config
    assert len(SyntheticTask.from_config(cfg.data).questions("test")) == cfg.eval.max_questions == 112
    assert cfg.clip_active()  # three mini-batches a step: the clipping losses act


def test_shipped_algorithms_sweep_is_valid() -> None:
    from infra.run.sweep_spec import load_sweep

    spec = load_sweep(REPO / "configs" / "sweeps" / "algorithms.yaml")
    assert spec.seeds == [0, 1, 2] and len(spec.runs) == 7 * 3
    cfg = {r.cell: r.config for r in spec.runs if r.seed == 0}
    assert (cfg["grpo"].rollout.mode, cfg["grpo"].algorithm.loss) == ("independent", "ppo_clip")
    assert (cfg["arpo"].rollout.mode, cfg["arpo"].algorithm.entropy_advantage) == ("arpo", False)
    assert cfg["aepo-no-premonitor"].rollout.premonitor is False
    assert cfg["aepo-no-branch-penalty"].rollout.branch_penalty == 0
    assert (cfg["aepo-no-clip-balance"].rollout.mode, cfg["aepo-no-clip-balance"].algorithm.loss) == ("aepo",
                                                                                                    "ppo_clip")
    assert cfg["aepo-no-entropy-advantage"].algorithm.entropy_advantage is False


@pytest.mark.parametrize(("body", "needle"), [
    ("cells: {bad: {rollout.k: -1}}", "cell bad"),
    ("cells: {typo: {rollout.nope: 1}}", "rollout.nope"),
    ("seeds: []", "seeds"),
    ("grids: {}", "grids"),
    ("cells: {x: {tracking.experiment: other}}", "tracking"),
])
def test_bad_sweep_fails_naming_the_problem(tmp_path: Path, body: str, needle: str) -> None:
    from infra.run.sweep_spec import load_sweep

    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_sweep(_write(tmp_path, f"name: s\nbase: BASE\n{body}\n"))


def test_shards_partition_the_runs_evenly(tmp_path: Path) -> None:
    from infra.run.sweep_spec import load_sweep, shard_runs

    spec = load_sweep(REPO / "configs" / "sweeps" / "algorithms.yaml")
    shards = [shard_runs(spec.runs, f"{i}/3") for i in (1, 2, 3)]
    names = [r.run_name for shard in shards for r in shard]
    assert sorted(names) == sorted(r.run_name for r in spec.runs) and len(set(names)) == len(names)
    assert [len(s) for s in shards] == [7, 7, 7]
    halves = [shard_runs(spec.runs, f"{i}/2") for i in (1, 2)]
    assert [len(h) for h in halves] == [11, 10]
    assert all({r.cell for r in h} == set(spec.cells) for h in halves)  # round-robin: every arm in each half
    assert shard_runs(spec.runs, None) == spec.runs
    for bad in ("0/2", "3/2", "1", "a/b", "1/0"):
        with pytest.raises(ConfigError, match="shard"):
            shard_runs(spec.runs, bad)


@pytest.mark.slow  # trains
def test_a_shard_runs_its_share_under_its_own_parent(prefect_harness: Any, tmp_path: Path) -> None:
    from flows.sweep import sweep
    from infra.tracking.run import Tracker

    result = sweep(sweep_config=str(TINY_SWEEP), runs_dir=str(tmp_path), shard="2/2")
    assert result.name == "tiny-sweep-shard2of2"
    children = Tracker(result.tracking_uri).search_runs(
        filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'")
    assert list(children["run_name"]) == ["tiny-sweep-grpo-s0"]
    assert [r["cell"] for r in result.runs] == ["grpo"]
    assert (tmp_path / "sweeps" / "tiny-sweep-shard2of2" / "comparison.csv").is_file()


def test_a_cell_finished_before_a_config_field_was_added_is_not_run_again(tmp_path: Path) -> None:
    """A release that adds a config field (at a default that keeps today's behaviour) changes every config's hash;
    the sweep then re-ran every finished cell. A run matches when its logged config, resolved by today's code, is the
    cell's config; one that really differs still runs again."""
    import yaml

    from infra.run.sweep import TAG_SWEEP, finished_children, started_children
    from infra.run.sweep_spec import load_sweep
    from infra.tracking.client import artifact_location_for, tracking_uri_for
    from infra.tracking.run import Tracker

    spec = load_sweep(TINY_SWEEP)
    configs = {run.run_name: run.config for run in spec.runs}
    tracker = Tracker(tracking_uri_for(tmp_path), artifact_location=artifact_location_for(tmp_path))

    def logged_before_the_field(name: str, status: str, parent: str | None = None, **changed: float) -> str:
        tree = configs[name].to_dict()
        del tree["eval"]["before_sft"]  # the field this release adds; the run predates it
        tree["optim"].update(changed)
        run_id = tracker.start(configs[name], run_name=name, tags={TAG_SWEEP: spec.name}, parent_run_id=parent)
        tracker.log_text(yaml.safe_dump(tree), "config.yaml")
        tracker.client.set_tag(run_id, "config_hash", "0123456789abcdef")  # what that release's hash was
        tracker.finish(status)
        return run_id

    same = logged_before_the_field("tiny-sweep-aepo-s0", "FINISHED")
    logged_before_the_field("tiny-sweep-grpo-s0", "FINISHED", lr=2 * configs["tiny-sweep-grpo-s0"].optim.lr)
    assert configs["tiny-sweep-aepo-s0"].config_hash() != "0123456789abcdef"
    assert {name: child.run_id for name, child in finished_children(tracker, spec, configs).items()} == {
        "tiny-sweep-aepo-s0": same}

    parent = tracker.start(configs["tiny-sweep-aepo-s0"], run_name=spec.name, group=True)  # a killed cell resumes too
    tracker.finish()
    logged_before_the_field("tiny-sweep-grpo-s0", "KILLED", parent)
    logged_before_the_field("tiny-sweep-aepo-s0", "KILLED", parent, lr=0.5)
    assert started_children(tracker, spec, configs, parent) == {"tiny-sweep-grpo-s0"}


@pytest.mark.slow  # trains
def test_a_scheduled_sweep_is_a_new_sweep_each_time_it_fires(prefect_harness: Any, tmp_path: Path) -> None:
    """Issue 49 §9: the weekly sweep re-ran nothing from its second week on (every cell FINISHED with the same config
    hash was skipped). The scheduled deployment's parameters make each firing a new sweep: its own dated parent run,
    every cell run again; `resume` still continues the newest firing. The sweep decides its numerics once (§8),
    records them on the parent and every cell computes in them."""
    from flows.serve import build_deployments
    from flows.sweep import sweep
    from infra.tracking.run import Tracker

    (scheduled,) = [d for d in build_deployments(tmp_path, REPO / "configs" / "tiny.yaml", TINY_SWEEP,
                                                 sweep_cron="0 3 * * 1") if d.name.startswith("sweep")]
    assert scheduled.schedules
    params = {**scheduled.parameters, "cells": ["aepo"]}  # one cell: the test's time
    first = sweep(**params)
    second = sweep(**params)
    assert first.started == second.started == ["tiny-sweep-aepo-s0"] and first.reused == second.reused == []
    assert first.parent_run_id != second.parent_run_id and first.out_dir != second.out_dir
    tracker = Tracker(first.tracking_uri)
    for result in (first, second):
        parent = tracker.client.get_run(result.parent_run_id)
        assert parent.info.run_name == f"tiny-sweep-{parent.data.tags['sweep_date']}"  # dated
        assert parent.data.tags["numerics.auto"] in ("bfloat16", "float32") and "system.capability" in parent.data.tags
        (child,) = tracker.search_runs(filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'"
                                       ).itertuples()  # its own cell, not the other firing's re-parented
        assert child.status == "FINISHED"
        tags = tracker.client.get_run(child.run_id).data.tags
        assert tags["system.numerics_source"] == f"sweep {result.parent_run_id}"
        assert tags["system.capability"] == parent.data.tags["system.capability"]
        assert (Path(result.out_dir) / "comparison.csv").is_file()

    resumed = sweep(**params, resume=True)  # continues the newest firing: nothing left to run
    assert resumed.parent_run_id == second.parent_run_id and resumed.started == []
    again = sweep(sweep_config=str(TINY_SWEEP), runs_dir=str(tmp_path), cells=["aepo"])  # by hand, undated
    assert again.started == ["tiny-sweep-aepo-s0"]  # a firing's cells stay under their own parent


def test_aepo_serve_adds_a_schedule_only_when_asked(tmp_path: Path) -> None:
    """`aepo serve` put a weekly sweep on the server by default ("Scheduled for 03:00", asked for by nobody)."""
    import inspect

    from flows.cli.serve import serve
    from flows.serve import build_deployments

    def served_sweep(**kwargs: Any) -> Any:
        (dep,) = [d for d in build_deployments(tmp_path, REPO / "configs" / "tiny.yaml", TINY_SWEEP, **kwargs)
                  if d.name.startswith("sweep")]
        return dep

    plain = served_sweep()
    assert not plain.schedules and not plain.parameters.get("dated")
    asked = served_sweep(sweep_cron="0 3 * * 1")
    (schedule,) = asked.schedules
    assert schedule.schedule.cron == "0 3 * * 1" and asked.parameters["dated"] is True
    assert not inspect.signature(serve).parameters["cron"].default  # the CLI asks for none unless --cron
