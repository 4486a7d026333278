"""The Parquet trajectory store: local and S3 (moto) round trips, schemas, filters, replacement, atomicity."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from scripted_engine import EchoSearch, ScriptedEngine, tool_then_answer

import infra.store as store_mod
from aepo_core.config import RolloutConfig, StorageConfig
from aepo_core.rollout.scheduler import Question, RolloutScheduler
from aepo_core.rollout.tree import RolloutTree
from aepo_core.scoring import LeafScore
from infra.data.rows import QuestionRow
from infra.store import NODE_SCHEMA, TRAJECTORY_SCHEMA, StoreError, TrajectoryStore, describe


def make_trees(n_questions: int = 3, seed: int = 0) -> list[RolloutTree]:
    """Real trees from the scheduler: a probe that branches, penalized steps, fills, a failing tool."""
    cfg = RolloutConfig(mode="aepo", premonitor=True, beta=0.5, k=4, initial_rollouts=2, beam_size=2, gamma=0.2,
                        tau=0.5, branch_penalty=0.7, entropy_window=20, max_tool_calls=6, max_response_tokens=2000)
    engine = ScriptedEngine(tool_then_answer(calls=2, h_first=1.0, h_after_tool=4.0))
    sched = RolloutScheduler(engine, {"search": EchoSearch(fail={"q1"})}, cfg)
    qs = [Question(f"q{i}", [ord(c) for c in f"Q{i}: what is x?\n"]) for i in range(n_questions)]
    return sched.run(qs, seed=seed).trees


def make_scores(trees: list[RolloutTree]) -> list[list[LeafScore]]:
    """Scores aligned with the trees; each tree's last leaf has NaN reward and advantage (stored as null)."""
    return [[LeafScore(0.25 * j, f"f1={0.25 * j}", 0.5 - 0.25 * j, j == 4) for j in range(len(t.leaves) - 1)]
            + [LeafScore(math.nan, "", math.nan, False)] for t in trees]


def make_questions(trees: list[RolloutTree]) -> dict[str, QuestionRow]:
    """The questions of the trees, two datasets, one with two gold answers."""
    return {t.question_id: QuestionRow(t.question_id, f"What is x in {t.question_id}?", ("x", f"ex-{i}"),
                                       "hotpotqa" if i % 2 else "nq", family="two_hop")
            for i, t in enumerate(trees)}


@pytest.fixture(scope="module")
def trees() -> list[RolloutTree]:
    return make_trees()


@pytest.fixture(scope="module")
def scores(trees: list[RolloutTree]) -> list[list[LeafScore]]:
    return make_scores(trees)


def check_round_trip(store: TrajectoryStore, run_id: str, step: int, trees: list[RolloutTree],
                     scores: list[list[LeafScore]] | None) -> None:
    """Every stored value equals the trees' own arrays and fields, and the scores (null / "" without them)."""
    df = store.read_trajectories(run_id=run_id, step=step)
    assert len(df) == sum(len(t.leaves) for t in trees)
    rows = {(r.question_id, r.leaf_id): r for r in df.itertuples()}
    for ti, t in enumerate(trees):
        for j, leaf in enumerate(t.leaves):
            score = scores[ti][j] if scores is not None else LeafScore(math.nan, "", math.nan, False)
            r = rows[(t.question_id, leaf.leaf_id)]
            assert r.run_id == run_id and r.step == step and r.sample_kind == leaf.sample_kind
            assert list(r.path) == leaf.node_ids and list(r.prompt_tokens) == t.prompt_ids
            assert list(r.response_tokens) == t.response_ids(leaf) and list(r.loss_mask) == t.loss_mask(leaf)
            np.testing.assert_allclose(r.logprobs, t.logprobs(leaf), rtol=1e-6)
            np.testing.assert_allclose(r.entropies, t.entropies(leaf), rtol=1e-6)
            if math.isnan(score.reward):
                assert pd_isnull(r.reward) and pd_isnull(r.advantage)
            else:
                assert r.reward == score.reward and r.advantage == score.advantage
            assert r.reward_reason == score.reason and r.status == leaf.status
            events = t.tool_events(leaf)
            assert r.num_tool_calls == len(events) and list(r.tool_names) == [e.name for e in events]
            assert r.tool_errors == sum(not e.ok for e in events) and r.tool_errors > 0
            assert r.branch_steps == leaf.branch_steps and r.wall_ms == pytest.approx(leaf.wall_s * 1000)
            assert r.response_text == t.text(leaf) and r.global_budget == t.global_budget
    nodes = store.read_nodes(run_id=run_id, step=step)
    assert len(nodes) == sum(len(t.nodes) for t in trees)
    by_id = {(r.question_id, r.node_id): r for r in nodes.itertuples()}
    for t in trees:
        for n in t.nodes:
            r = by_id[(t.question_id, n.node_id)]
            assert (None if pd_isnull(r.parent_id) else int(r.parent_id)) == n.parent_id
            assert (r.depth, r.kind, r.token_start, r.token_end) == (n.depth, n.kind, n.token_start, n.token_end)
            assert (r.consecutive_branches, r.branched, r.branch_reason) == (
                n.consecutive_branches, n.branched, n.branch_reason)
            for col in ("segment_entropy", "delta_entropy", "branch_score"):
                want = getattr(n, col)
                assert pd_isnull(getattr(r, col)) if math.isnan(want) else getattr(r, col) == want
            if n.tool is None:
                assert pd_isnull(r.tool_name) and pd_isnull(r.tool_ok)
            else:
                assert (r.tool_name, r.tool_ok, r.tool_cache_hit) == (n.tool.name, n.tool.ok, n.tool.cache_hit)
                assert r.tool_latency_ms == pytest.approx(n.tool.latency_s * 1000)
    assert nodes["branched"].any() and set(nodes["kind"]) == {"prompt", "model", "tool"}


def pd_isnull(x: object) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def test_local_round_trip_schemas_filters(tmp_path: Path, trees: list[RolloutTree],
                                          scores: list[list[LeafScore]]) -> None:
    store = TrajectoryStore(tmp_path / "traj")
    paths = store.write_step("run-a", 0, trees, scores)
    assert [Path(p).relative_to(tmp_path / "traj").as_posix() for p in paths] == [
        "nodes/run-a/step-000000.parquet", "trajectories/run-a/step-000000.parquet"]
    store.write_step("run-a", 1, trees[:2])
    store.write_step("run-b", 0, trees[:1])

    # The files carry exactly the documented schemas, zstd-compressed.
    assert pq.read_schema(paths[0]) == NODE_SCHEMA and pq.read_schema(paths[1]) == TRAJECTORY_SCHEMA
    assert pq.ParquetFile(paths[1]).metadata.row_group(0).column(0).compression == "ZSTD"
    assert store.dataset("trajectories").schema == TRAJECTORY_SCHEMA

    check_round_trip(store, "run-a", 0, trees, scores)
    check_round_trip(store, "run-b", 0, trees[:1], None)  # written without scores
    assert store.steps("run-a") == [0, 1] and store.steps("run-b") == [0] and store.steps("nope") == []
    assert store.run_ids() == ["run-a", "run-b"]
    assert len(store.read_trajectories()) == 4 * (3 + 2 + 1)
    assert set(store.read_trajectories(run_id="run-a")["step"]) == {0, 1}
    q1 = store.read_trajectories(run_id="run-a", question_id="q1")
    assert set(q1["question_id"]) == {"q1"} and len(q1) == 8
    assert len(store.read_nodes(run_id="run-a", step=[1], question_id=["q0", "q1"])) == sum(
        len(t.nodes) for t in trees[:2])
    sub = store.read_trajectories(run_id="run-b", columns=["question_id", "reward"])
    assert list(sub.columns) == ["question_id", "reward"]
    single = pq.read_table(paths[1]).to_pandas()  # one part alone is self-describing
    assert set(single["run_id"]) == {"run-a"} and set(single["step"]) == {0}


def test_rewriting_a_step_replaces_it(tmp_path: Path, trees: list[RolloutTree],
                                      scores: list[list[LeafScore]]) -> None:
    store = TrajectoryStore(str(tmp_path))
    store.write_step("r1", 3, trees, scores)
    rescored = [[replace(s, reward=1.0) for s in ts] for ts in scores[:2]]  # the resumed run re-scores the step
    store.write_step("r1", 3, trees[:2], rescored)
    df = store.read_trajectories(run_id="r1", step=3)
    assert len(df) == 8 and (df["reward"] == 1.0).all()
    assert len(store.read_nodes(run_id="r1")) == sum(len(t.nodes) for t in trees[:2])
    assert sorted(p.name for p in (tmp_path / "trajectories" / "r1").iterdir()) == ["step-000003.parquet"]
    assert store.steps("r1") == [3]


def test_the_update_s_groups_and_advantages_are_stored_in_its_order(tmp_path: Path, trees: list[RolloutTree],
                                                                    scores: list[list[LeafScore]]) -> None:
    # the update used trees 0 and 2 (tree 1 was filtered out), with advantages of its own: groups 0 and 1
    update = [tuple(0.1 * j for j in range(len(trees[0].leaves))), None,
              tuple(-0.2 * j for j in range(len(trees[2].leaves)))]
    store = TrajectoryStore(str(tmp_path))
    store.write_step("r1", 1, trees, scores, update=update)
    df = store.read_trajectories(run_id="r1", step=1)
    for ti, (t, used) in enumerate(zip(trees, update, strict=True)):
        rows = df[df["question_id"] == t.question_id].sort_values("leaf_id")
        if used is None:
            assert rows["update_group"].isna().all() and rows["update_advantage"].isna().all()
        else:
            assert set(rows["update_group"]) == {0 if ti == 0 else 1}
            assert list(rows["update_advantage"]) == pytest.approx(list(used))
    store.write_step("r1", 2, trees, scores)  # without them: null
    assert store.read_trajectories(run_id="r1", step=2)["update_group"].isna().all()
    with pytest.raises(StoreError, match="not aligned"):
        store.write_step("r1", 3, trees, scores, update=update[:2])
    with pytest.raises(StoreError, match="not aligned"):
        store.write_step("r1", 3, trees, scores, update=[(0.0,), None, None])


def test_delete_steps_after_removes_the_later_steps_of_that_run_only(tmp_path: Path, trees: list[RolloutTree],
                                                                     scores: list[list[LeafScore]]) -> None:
    store = TrajectoryStore(str(tmp_path))
    for run, step in (("r1", 1), ("r1", 2), ("r1", 3), ("r2", 3)):
        store.write_step(run, step, trees, scores)
    assert store.delete_steps_after("r1", 1) == [2, 3]  # a resume from the checkpoint of step 1
    assert store.steps("r1") == [1] and store.steps("r2") == [3]
    assert sorted(set(store.read_nodes(run_id="r1")["step"])) == [1]
    assert store.delete_steps_after("r1", 0) == [1] and store.steps("r1") == []  # no checkpoint: step 0
    assert store.delete_steps_after("r3", 0) == []


def test_crash_mid_write_leaves_no_visible_part(tmp_path: Path, trees: list[RolloutTree],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    store = TrajectoryStore(tmp_path)
    store.write_step("r1", 0, trees)  # a good step 0, and a good old version of step 1
    store.write_step("r1", 1, trees[:1])
    real = store_mod._serialize

    def crash_after_some_bytes(table: pa.Table, sink) -> None:
        sink.write(b"PAR1 half a file")
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(store_mod, "_serialize", crash_after_some_bytes)
    with pytest.raises(RuntimeError, match="killed mid-write"):
        store.write_step("r1", 2, trees)
    with pytest.raises(RuntimeError, match="killed mid-write"):
        store.write_step("r1", 1, trees)
    monkeypatch.setattr(store_mod, "_serialize", real)

    for table in ("nodes", "trajectories"):  # no step 2, and step 1 is the old one alone
        assert sorted(p.name for p in (tmp_path / table / "r1").iterdir()) == [
            "step-000000.parquet", "step-000001.parquet"]
    assert store.steps("r1") == [0, 1]
    assert len(store.read_trajectories(run_id="r1", step=1)) == 4  # the old step 1 is intact

    # A hard kill leaves a hidden temp file: readers skip it and the next write of that step removes it.
    leftover = tmp_path / "trajectories" / "r1" / ".step-000000.parquet.x.tmp"
    leftover.write_bytes(b"garbage")
    assert len(store.read_trajectories(run_id="r1", step=0)) == 12
    assert ds.dataset(str(tmp_path / "trajectories"), partitioning="hive").count_rows() == 16
    assert len(pd.read_parquet(tmp_path / "trajectories")) == 16
    store.write_step("r1", 0, trees)
    assert not leftover.exists()


def test_bad_inputs_give_clear_errors(tmp_path: Path, trees: list[RolloutTree]) -> None:
    store = TrajectoryStore(tmp_path)
    with pytest.raises(StoreError, match="run_id"):
        store.write_step("a/b", 0, trees)
    with pytest.raises(StoreError, match="run_id"):
        store.write_step("run_id=x", 0, trees)
    with pytest.raises(StoreError, match="question 'q2', which is not among the 2 questions given"):
        store.write_step("r", 0, trees, questions=make_questions(trees[:2]))
    with pytest.raises(StoreError, match="step must be"):
        store.write_step("r", -1, trees)
    with pytest.raises(StoreError, match="step must be"):
        store.write_step("r", True, trees)
    with pytest.raises(StoreError, match="list of RolloutTree"):
        store.write_step("r", 0, trees[0])
    with pytest.raises(StoreError, match=r"trees\[1\] is a dict"):
        store.write_step("r", 0, [trees[0], {}])
    with pytest.raises(StoreError, match="scores for 2 trees, but 3 trees given"):
        store.write_step("r", 0, trees, make_scores(trees)[:2])
    with pytest.raises(StoreError, match=r"trees\[1\] \(question q1\) has 4 leaves but 3 scores"):
        store.write_step("r", 0, trees, [ts[:3] if ti == 1 else ts for ti, ts in enumerate(make_scores(trees))])
    broken = make_trees(n_questions=1)[0]
    broken.nodes[1].logprobs = broken.nodes[1].logprobs[:-1]
    with pytest.raises(StoreError, match="question q0 leaf 0: token arrays disagree"):
        store.write_step("r", 0, [broken])
    with pytest.raises(StoreError, match="unknown table"):
        store.dataset("leaves")
    with pytest.raises(StoreError, match="unknown columns"):
        store.read_trajectories(columns=["question_id", "nope"])
    assert store.steps("r") == []  # nothing was written by the failed calls
    # An empty store reads as empty frames with the documented columns.
    empty = store.read_trajectories(run_id="r")
    assert empty.empty and list(empty.columns) == TRAJECTORY_SCHEMA.names


def test_s3_round_trip_through_moto(moto_s3: str, trees: list[RolloutTree], scores: list[list[LeafScore]]) -> None:
    import s3fs

    opts = {"client_kwargs": {"endpoint_url": moto_s3}, "skip_instance_cache": True}
    fs = s3fs.S3FileSystem(**opts)
    fs.mkdir("aepo-traj")
    store = TrajectoryStore("s3://aepo-traj/exp1", storage_options=opts)
    paths = store.write_step("run-s3", 0, trees, scores)
    store.write_step("run-s3", 1, trees[:1])
    store.write_step("run-s3", 1, trees[:2])  # replaced, not duplicated
    assert paths[1] == "s3://aepo-traj/exp1/trajectories/run-s3/step-000000.parquet"
    assert store.steps("run-s3") == [0, 1]
    check_round_trip(store, "run-s3", 0, trees, scores)
    assert len(store.read_trajectories(run_id="run-s3", step=1)) == 8
    assert sorted(fs.ls("aepo-traj/exp1/nodes/run-s3")) == [
        "aepo-traj/exp1/nodes/run-s3/step-000000.parquet", "aepo-traj/exp1/nodes/run-s3/step-000001.parquet"]
    # Plain pyarrow and pandas over s3fs, without this package.
    plain = ds.dataset("aepo-traj/exp1/trajectories", filesystem=fs, partitioning="hive")
    assert plain.schema == TRAJECTORY_SCHEMA and plain.count_rows() == 20
    assert len(pd.read_parquet("s3://aepo-traj/exp1/trajectories", storage_options=opts)) == 20
    # A fresh store object (another process) sees the same data; the config names the endpoint.
    assert TrajectoryStore("s3://aepo-traj/exp1", storage_options=opts).run_ids() == ["run-s3"]
    from_cfg = TrajectoryStore.from_config(StorageConfig(trajectories_uri="s3://aepo-traj/exp1",
                                                         s3_endpoint_url=moto_s3))
    assert from_cfg.steps("run-s3") == [0, 1]


def test_from_config_defaults_under_runs_dir(tmp_path: Path, trees: list[RolloutTree]) -> None:
    store = TrajectoryStore.from_config(StorageConfig(runs_dir=str(tmp_path / "runs")))
    store.write_step("r1", 0, trees[:1])
    runs = tmp_path / "runs"  # the store root: two sibling tables, one schema each
    assert (runs / "trajectories" / "r1" / "step-000000.parquet").is_file()
    assert (runs / "nodes" / "r1" / "step-000000.parquet").is_file()


def _read_every_way(directory: Path) -> dict[str, pd.DataFrame]:
    """The four readers on one directory, as a researcher calls them."""
    import duckdb
    import polars as pl

    return {
        "pandas": pd.read_parquet(directory),
        "polars": pl.read_parquet(f"{directory}/**/*.parquet").to_pandas(),
        "pyarrow": ds.dataset(directory, partitioning="hive").to_table().to_pandas(),
        "duckdb": duckdb.sql(f"SELECT * FROM read_parquet('{directory}/**/*.parquet', hive_partitioning=true)").df(),
    }


def test_every_reader_on_every_directory_of_the_store_reads_one_table(
        tmp_path: Path, trees: list[RolloutTree], scores: list[list[LeafScore]]) -> None:
    """The default store, under the runs dir: every directory of it (a table, a run) read with pandas, polars,
    pyarrow and DuckDB gives exactly that table's rows. Before, the default root ``<runs>/trajectories`` held both
    tables: pandas returned node and leaf rows mixed (563 rows = 443 nodes + 120 leaves in the issue's run)."""
    runs = tmp_path / "runs"
    n_leaves = write_two_runs(runs, trees, scores, TrajectoryStore.from_config(StorageConfig(runs_dir=str(runs))))
    n_nodes = 4 * sum(len(t.nodes) for t in trees)
    directories = sorted(d for d in runs.rglob("*") if d.is_dir())
    assert [d.relative_to(runs).as_posix() for d in directories] == [
        "nodes", "nodes/run-a", "nodes/run-b", "trajectories", "trajectories/run-a", "trajectories/run-b"]
    for directory in directories:
        table, *run = directory.relative_to(runs).parts
        schema = TRAJECTORY_SCHEMA if table == "trajectories" else NODE_SCHEMA
        rows = (n_leaves if table == "trajectories" else n_nodes) // (2 if run else 1)
        for reader, df in _read_every_way(directory).items():
            assert list(df.columns) == schema.names and len(df) == rows, (directory, reader)


def test_a_store_of_the_previous_default_layout_is_read_then_moved_by_the_next_write(
        tmp_path: Path, trees: list[RolloutTree], scores: list[list[LeafScore]]) -> None:
    """``<runs>/trajectories/{trajectories,nodes}/`` (written here as a store rooted at ``<runs>/trajectories``, as
    the previous default did): read in place; the next write moves both tables to ``<runs>/{trajectories,nodes}``,
    after which a plain reader of ``<runs>/trajectories`` sees leaves only."""
    runs = tmp_path / "runs"
    n_leaves = write_two_runs(runs / "trajectories", trees, scores)
    assert len(pd.read_parquet(runs / "trajectories")) > n_leaves  # the old layout: nodes and leaves mixed
    store = TrajectoryStore(runs)
    assert store.run_ids() == ["run-a", "run-b"] and store.steps("run-a") == [1, 2]
    assert len(store.read_trajectories()) == n_leaves
    store.write_step("run-c", 0, trees[:1])
    assert not (runs / "trajectories" / "trajectories").exists() and not (runs / "trajectories" / "nodes").exists()
    assert store.run_ids() == ["run-a", "run-b", "run-c"]
    assert len(store.read_nodes(run_id="run-b")) == 2 * sum(len(t.nodes) for t in trees)
    for reader, df in _read_every_way(runs / "trajectories").items():
        assert list(df.columns) == TRAJECTORY_SCHEMA.names and len(df) == n_leaves + len(trees[0].leaves), reader
    store.delete_run("run-a")
    assert store.run_ids() == ["run-b", "run-c"]


def write_two_runs(root: Path, trees: list[RolloutTree], scores: list[list[LeafScore]],
                   store: TrajectoryStore | None = None) -> int:
    """Runs run-a and run-b, steps 1 and 2 each, with questions; returns the number of trajectory rows."""
    store = store or TrajectoryStore(root)
    questions = make_questions(trees)
    for run in ("run-a", "run-b"):
        for step in (1, 2):
            store.write_step(run, step, trees, scores, questions)
    return 4 * sum(len(t.leaves) for t in trees)


def test_pandas_polars_pyarrow_duckdb_read_the_store(tmp_path: Path, trees: list[RolloutTree],
                                                     scores: list[list[LeafScore]]) -> None:
    """The issue's four readers, exactly as it calls them, on 2 runs x 2 steps: same rows, same columns."""
    import duckdb
    import polars as pl

    n = write_two_runs(tmp_path, trees, scores)
    for table, schema in (("trajectories", TRAJECTORY_SCHEMA), ("nodes", NODE_SCHEMA)):
        root = tmp_path / table
        frames = {
            "pandas": pd.read_parquet(root),
            "polars": pl.read_parquet(f"{root}/**/*.parquet").to_pandas(),
            "pyarrow": ds.dataset(root, partitioning="hive").to_table().to_pandas(),
            "duckdb": duckdb.sql(f"SELECT * FROM read_parquet('{root}/**/*.parquet', hive_partitioning=true)").df(),
        }
        for reader, df in frames.items():
            assert list(df.columns) == schema.names, reader
            assert len(df) == (n if table == "trajectories" else 4 * sum(len(t.nodes) for t in trees)), reader
            assert sorted(set(zip(df["run_id"], df["step"].astype(int)))) == [
                ("run-a", 1), ("run-a", 2), ("run-b", 1), ("run-b", 2)], reader
    traj = pd.read_parquet(tmp_path / "trajectories")
    first = traj[(traj["question_id"] == "q1")].iloc[0]
    assert (first["dataset"], first["question"], list(first["golds"]), first["family"]) == (
        "hotpotqa", "What is x in q1?", ["x", "ex-1"], "two_hop")
    assert pd.read_parquet(tmp_path / "trajectories" / "run-b").shape[0] == n // 2  # a run is its directory


def test_every_column_is_described_in_the_files(tmp_path: Path, trees: list[RolloutTree],
                                                scores: list[list[LeafScore]]) -> None:
    import duckdb

    write_two_runs(tmp_path, trees, scores)
    for table, schema in (("trajectories", TRAJECTORY_SCHEMA), ("nodes", NODE_SCHEMA)):
        part = tmp_path / table / "run-a" / "step-000001.parquet"
        stored = pq.read_schema(part)
        assert stored == schema and stored.metadata == schema.metadata
        assert [f.metadata for f in stored] == [f.metadata for f in schema]
        assert all(len(f.metadata[b"description"]) > 10 for f in stored), table
        kv = dict(duckdb.sql(f"SELECT decode(key), decode(value) FROM parquet_kv_metadata('{part}')").fetchall())
        assert json.loads(kv["aepo.columns"]) == describe(table) and kv["aepo.schema_version"] == "4"
    assert "response_tokens" in describe("nodes")["token_start"] and "prompt_tokens" in describe("nodes")["token_start"]


def test_parts_of_the_previous_layout_are_still_read(tmp_path: Path, trees: list[RolloutTree]) -> None:
    """A v2 part under run_id=…/step=…/ reads with null question columns; the current part of a step wins."""
    store = TrajectoryStore(tmp_path)
    tables = store_mod.trees_to_tables("old-run", 4, trees[:1])
    for name, table in tables.items():
        old = table.drop_columns(["dataset", "question", "golds", "family"]) if name == "trajectories" else table
        legacy = tmp_path / name / "run_id=old-run" / "step=4" / "part-00000.parquet"
        legacy.parent.mkdir(parents=True)
        pq.write_table(old, legacy)
    assert store.run_ids() == ["old-run"] and store.steps("old-run") == [4]
    df = store.read_trajectories(run_id="old-run", step=4)
    assert len(df) == 4 and df["question"].isna().all() and len(store.read_nodes(run_id="old-run")) == len(
        trees[0].nodes)
    store.write_step("old-run", 4, trees[:2], questions=make_questions(trees))  # the resumed run repeats step 4
    assert [p.legacy for p in store.parts("trajectories", "old-run")] == [False]
    assert len(store.read_trajectories(run_id="old-run")) == 8
    store.delete_run("old-run")
    assert store.run_ids() == [] and not any((tmp_path / "trajectories").iterdir())
